"""Launch helpers shared by the dense (``kbit.ops.gemv_mma``) and grouped (``kbit.ops.grouped_mma``) swap-AB
kernels: availability, the deterministic switch, the split-K workspace, the log8 exponent table, x staging and
kernel 7's pre-tiled x, and the checks of a weight in layout "mma-v1". Imports no op."""

from __future__ import annotations

import torch

from kbit import cuda, options
from kbit.ops._checks import check_params
from kbit.ops._common import e_table
from kbit.ops.mma.layout import SEG, geometry
from kbit.utils.checks import check_tensor, fail
from kbit.utils.device import interpreting

__all__ = ["check_repacked", "deterministic", "e_table", "kernels_available", "permute_x", "prep_x",
           "rows_aligned", "usable", "workspace", "x_rows", "x_tiles", "x_tiles_groups", "x_tiles_kernel",
           "x_tiles_reference"]


def kernels_available(device=None) -> bool:
    """True when the CUDA kernels can run on ``device`` (CUDA, NVRTC found, sm_80 or newer)."""
    if not cuda.available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False
    return torch.cuda.get_device_capability(dev)[0] >= 8


def usable(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` may run the CUDA kernels: ``x`` float16 / bfloat16 (the kernels read 16-bit
    activations; a float32 x read as float16 gave NaN) on a GPU where they are :func:`kernels_available`, Triton not
    interpreting, and ``kbit.options`` not forcing another backend."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and not interpreting()
            and options.get().backend in ("auto", "cuda") and kernels_available(x.device))


def deterministic() -> bool:
    """Whether kernels 1 and 3 add the parts of a split tile in a fixed order (bit-identical outputs run to run and
    replay to replay) instead of with fp32 atomics in arrival order: ``kbit.options`` ``deterministic``, or while
    ``torch.use_deterministic_algorithms(True)``. Off by default: it cost ~4% of a Llama-3-8B decode step at k = 4
    on an H100. Kernel 3 with CTA-aligned units is deterministic either way."""
    return torch.are_deterministic_algorithms_enabled() or options.get().deterministic

_WS: dict = {}
_WS_OLD: list = []  # replaced workspaces, kept allocated (see workspace)


def workspace(device, n_floats, n_tiles):
    """fp32 partial sums (``n_floats``) and per-tile counters, zero at rest (the kernel re-zeroes what it used)."""
    key = device  # one per device: calls on concurrent streams must not use split K at the same time
    ws = _WS.get(key)
    if ws is None or ws[0].numel() < n_floats or ws[1].numel() < n_tiles:
        # each part only grows: a call that needs more counters must not shrink the partial sums (the size the
        # workspace settles at would depend on the order of the calls)
        # the replaced buffers stay allocated: CUDA graphs captured before and prepared launches
        # (``kbit.ops.gemv_mma.prepare_repacked``) hold their addresses; sizes double, so what is kept is at most
        # the final size
        have = (0, 0) if ws is None else (ws[0].numel(), ws[1].numel())
        if ws is not None:
            _WS_OLD.append(ws)
        ws = (torch.zeros(_grown(have[0], n_floats, 1 << 16), dtype=torch.float32, device=device),
              torch.zeros(_grown(have[1], n_tiles, 4096), dtype=torch.int32, device=device))
        _WS[key] = ws
    return ws


def _grown(have, need, floor):
    """A workspace part's new size: kept if it holds ``need``, else at least doubled (and at least ``floor``)."""
    return have if have >= need else max(need, floor, 2 * have)


def permute_x(x2):
    """x columns in the K order of layout "mma-v1" (kernel 6's wgmma B operand): within each 32-column unit,
    column 8t + 4h + 2p + e moves to 16h + 8p + 2t + e."""
    M, Kw = x2.shape
    return x2.view(M, Kw // 32, 4, 2, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(M, Kw)



_XT_KERNELS: dict = {}


def x_tiles_kernel(name, device):
    """Kernel ``name`` of ``x_tiles.cu`` (``kbit_x_tiles``, ``kbit_x_tiles_g``), compiled once a device:
    compile_kernel hashes the whole source on every call."""
    kern = _XT_KERNELS.get((name, device))
    if kern is None:
        kern = _XT_KERNELS[(name, device)] = cuda.compile_kernel("x_tiles.cu", name, {}, device)
    return kern


def x_tiles_groups(n_ch: int, bt: int) -> int:
    """The x gathers' grid y: 256-thread groups a token block (a thread copies 4 of the block's ``n_ch * bt * 8``
    16-byte pieces: ``XT_CPT`` of ``x_tiles.cu``; ``n_ch`` is a multiple of 4)."""
    return -(-(n_ch // 4) * bt * 8 // 256)


def x_tiles(x2, bt, S):
    """x ``[M, S * 256]`` (rows 16-byte aligned) as kernel 7's bulk-copy tiles: ``[ceil(M / bt), S * 4, bt, 64]``
    in the "mma-v1" K order, each ``[bt, 64]`` tile in wgmma's 128-byte swizzle, rows past M zero
    (``kbit_x_tiles``; :func:`x_tiles_reference` is the torch definition)."""
    M = x2.shape[0]
    n_tb, n_ch = -(-M // bt), S * 4
    xt = torch.empty(n_tb * n_ch * bt * 64, dtype=x2.dtype, device=x2.device)
    kern = x_tiles_kernel("kbit_x_tiles", x2.device)
    kern((n_tb, x_tiles_groups(n_ch, bt)), 256, "QQiiii", x2.data_ptr(), xt.data_ptr(), M, x2.stride(0), n_ch, bt,
         pdl=True)
    return xt


def x_tiles_reference(x2, bt, S):
    """The definition of :func:`x_tiles` in torch."""
    M, Kw = x2.shape
    n_tb = -(-M // bt)
    xp = torch.zeros(n_tb * bt, Kw, dtype=x2.dtype, device=x2.device)
    xp[:M] = permute_x(x2)
    t = xp.view(n_tb, bt, S * 4, 8, 8).permute(0, 2, 1, 3, 4)  # [tb, chunk, row, piece, 8]
    r = torch.arange(bt, device=x2.device).view(bt, 1) % 8
    src = torch.arange(8, device=x2.device).view(1, 8) ^ r  # piece at position c holds piece c ^ (r % 8)
    return t[:, :, torch.arange(bt, device=x2.device).view(bt, 1), src].reshape(-1)


def rows_aligned(t: torch.Tensor) -> bool:
    """Whether the rows of a 2-D 16-bit ``t`` start on 16-byte boundaries with contiguous columns (the kernels read
    them as 16-byte vectors)."""
    return t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def x_rows(x2, S):
    """x rows as kernels 1, 3, 4 read them: ``x2`` itself where its rows are readable as 16-byte vectors (those
    kernels take the columns from K on as zero), else :func:`prep_x`'s zero-padded copy."""
    return x2 if x2.shape[1] % 8 == 0 and rows_aligned(x2) else prep_x(x2, S)


def prep_x(x2, S):
    """x rows readable as 16-byte vectors up to column S*256 (a zero-padded copy when needed)."""
    M, K = x2.shape
    Kw = S * SEG
    if K == Kw and rows_aligned(x2):
        return x2
    xp = torch.zeros(M, Kw, dtype=x2.dtype, device=x2.device)
    xp[:, :K] = x2
    return xp


def check_repacked(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias, lead=()):
    check_params(k, blocksize, scale_format, N, K)
    check_tensor("x", x, (torch.float16, torch.bfloat16, torch.float32))
    if x.dim() < 1 or x.shape[-1] != K:
        fail(ValueError, "x", f"last dimension K={K}", tuple(x.shape))
    _, Nt, S = geometry(N, K, blocksize)
    sdt = torch.uint8 if scale_format == "log8" else torch.float16
    check_tensor("rcodes", rcodes, (torch.int32,), (*lead, Nt, S, k, 32, 4), x.device)
    check_tensor("rscales", rscales, (sdt,), (*lead, Nt, S, 8, 16), x.device)
    check_tensor("tensor_scale", tensor_scale, (torch.float32,), lead, x.device)
    check_tensor("codebook", codebook, (torch.float32,), (2**k,), x.device)
    if not (rcodes.is_contiguous() and rscales.is_contiguous()):
        fail(ValueError, "rcodes, rscales", "contiguous tensors", (rcodes.stride(), rscales.stride()))
    if bias is not None:
        check_tensor("bias", bias, (torch.float16, torch.bfloat16, torch.float32), (N,), x.device)

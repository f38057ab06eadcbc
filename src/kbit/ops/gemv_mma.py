"""Small-M linear on k-bit weights with tensor cores (CUDA C++ through NVRTC): ``y = x @ W.T (+ bias)``.

Swap-AB: the weight is the A operand of ``mma.sync.m16n8k16`` (16 rows x 16 columns), the activations the B
operand (up to 8 tokens per mma), fp32 accumulation. Codes are looked up in a shared-memory table of
fp16/bf16 pairs (k = 3, 4), quads (k = 2) or single values (k = 5), stored once per lane (conflict-free).
The block scale multiplies each 32-column block's mma result (fp32) before it is added to the accumulator.

The kernels read the weight in layout "mma-v1" (``kbit.ops.mma.layout``). :func:`linear_small_m` takes canonical
tensors and caches their repacked copy per weight (the weight is then held twice); :func:`linear_repacked` takes a
weight held in layout "mma-v1" only (what ``kbit.nn.KbitLinear`` holds after ``repack_for_kernels``);
:func:`dequant_repacked` dequantizes such a weight. Kernels 1, 3, 4 take up to 64 rows a launch (more in chunks);
kernel 7 (wgmma, sm_90) any M in one launch. The configs and launch plans come from ``kbit.tuning.mma`` and
``kbit.tuning.mma_plan``. These ops need the CUDA kernels (``kbit.ops.mma.common.kernels_available``); choosing them or
another backend is ``kbit.dispatch``'s job.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kbit import cuda
from kbit.cuda.runtime import Prepared
from kbit.ops._checks import check_dense
from kbit.ops._ids import poison
from kbit.ops.mma.common import (
    check_repacked,
    deterministic,
    e_table,
    kernels_available,
    permute_x,
    prep_x,
    workspace,
    x_rows,
    x_tiles,
)
from kbit.ops.mma.layout import geometry, repacked
from kbit.tuning import mma as _tmma
from kbit.tuning.mma import MAX_M, LargeConfig, MmaConfig, large_config, uses_large
from kbit.tuning.mma_plan import KERNELS, SMEM_MAX, MmaPlan, make_plan, table_smem, x_rows_bytes
from kbit.tuning.tables import gpu_key
from kbit.tuning.tuned import tuned_candidate
from kbit.utils.checks import fail
from kbit.utils.device import sm_count

__all__ = ["EPI_SILU", "PAIRS_MAX", "PRO_ADD_NORM", "PLANS", "PlanCache", "dequant_repacked", "launch", "launch_config",
           "linear_repacked", "linear_small_m", "pairs_linear", "plan_launch", "prepare_repacked", "run_repacked"]


# ------------------------------------------------------------------------------------------------ plans


def launch_config(k: int, M: int, N: int, K: int, device) -> MmaConfig:
    """The default config of one launch of kernels 1, 3, 4 for ``M`` (<= 64) rows on ``device``."""
    dev = torch.device(device)
    cuda_dev = dev.type == "cuda"
    sm90 = cuda_dev and torch.cuda.get_device_capability(dev) == (9, 0)
    tuned = _tuned(k, M, N, K, dev, "mma")
    if tuned is not None:
        return tuned
    return _tmma.default_config(k, M, N, K, sm90=sm90, sms=sm_count(dev) if cuda_dev else None, gpu=gpu_key(dev))


def _tuned(k: int, M: int, N: int, K: int, dev: torch.device, family: str):
    """The config of ``family`` ("mma" or "large") that this GPU's tuned table (``kbit tune``) holds for the launch,
    or None (the built-in rules decide). A chunk of a larger M looks up its own row count."""
    cand = tuned_candidate(k, M, N, K, gpu_key(dev)) if dev.type == "cuda" else None
    return cand.config if cand is not None and cand.family == family else None


def _large_here(k: int, M: int, N: int, K: int, dev: torch.device) -> bool:
    """Whether M rows run as one kernel 7 launch: as the tuned table says where it names kernel 7 or kernels 1, 3, 4
    for this shape, else :func:`kbit.tuning.mma.uses_large`."""
    if dev.type == "cuda" and _tmma.large_ok(dev):
        if _tuned(k, M, N, K, dev, "large") is not None:
            return True
        if _tuned(k, M, N, K, dev, "mma") is not None:
            return False
    return uses_large(M, N, K, dev)


def plan_launch(k: int, M: int, N: int, K: int, scale_format: str = "log8",
                config: MmaConfig | LargeConfig | None = None, device=None, pro: int = 0, epi: int = 0,
                bf16: bool = False) -> MmaPlan:
    """The launch plan (``kbit.tuning.mma_plan.make_plan``) of ``M`` rows on a k-bit ``[N, K]`` weight on ``device``
    (default: the current CUDA device), built with NVRTC; ``config``: pin one (default :func:`launch_config`).
    ``pro`` / ``epi``: an x prologue / the SiLU epilogue (``kbit.dispatch.prologue``); ``bf16``: for bf16 activations
    (else fp16), the build the launch runs."""
    dev = torch.device(device or "cuda")
    if config is None:
        config = launch_config(k, M, N, K, dev)

    def build(kernel, defines):
        return cuda.compile_kernel(*KERNELS[kernel], defines, dev)

    sms = sm_count(dev) if dev.type == "cuda" else 0
    return make_plan(k, M, N, K, scale_format, config, sms=sms, build=build, deterministic=deterministic(), pro=pro,
                     epi=epi, bf16=bf16)


class PlanCache:
    """The per-process cache of launch plans with their compiled kernels (keyed by shape, format, config, dtype,
    device and deterministic mode). :meth:`clear` also drops the launchers prepared from plans (they register
    through :meth:`on_clear`)."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._d: dict = {}
        self._on_clear: list = []

    def get(self, k, M, N, K, scale_format, config, bf16, dev, kind=0, epi=0) -> tuple[MmaPlan, object]:
        """(plan, kernel built for x's dtype) of one launch on x rows of width ``K``, built on the first call."""
        key = (k, M, N, K, scale_format, config, bf16, dev, kind, epi, deterministic())
        hit = self._d.get(key)
        if hit is None:
            p = plan_launch(k, M, N, K, scale_format, config, dev, pro=kind, epi=epi, bf16=bf16)
            kern = cuda.compile_kernel(*p.source, p.defines, dev)  # the plan's own build: compiled once
            if len(self._d) >= self.max_entries:
                self._d.clear()
            hit = self._d[key] = (p, kern)
        return hit

    def clear(self) -> None:
        self._d.clear()
        for fn in self._on_clear:
            fn()

    def on_clear(self, fn) -> None:
        """Call ``fn()`` whenever the cache is cleared (caches of launches prepared from plans register here)."""
        self._on_clear.append(fn)

    def __len__(self) -> int:
        return len(self._d)


#: the plans of this process (``PLANS.clear()`` after changing ``kbit.options`` that plans depend on)
PLANS = PlanCache()


# ------------------------------------------------------------------------------------------------ launch

#: ``PRO`` value of kernel 3: residual add + RMSNorm x prologue (1, RMSNorm alone, is not used from Python)
PRO_ADD_NORM = 2
#: ``EPI`` value of kernel 3: SiLU * up of a fused gate/up weight (gate rows first; y is ``[M, N / 2]``)
EPI_SILU = 1

#: the kernels' argument list: pointers, then ints; ``_ARG_X`` / ``_ARG_Y``: x's and y's places
_ARGS_FMT = "QQQQQQQQQQiiiiiiiiiii"
_ARG_X, _ARG_Y = 5, 6
_BIAS_KIND = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


def _kernel_args(p: MmaPlan, rcodes, rscales, tensor_scale, codebook, x_ptr, y_ptr, bias, ws, cnt, M, N, x_stride,
                 y_stride, kx):
    """The arguments of plan ``p``'s launch, in ``_ARGS_FMT`` order; ``kx``: x's columns (a plan with ``XT``
    reads those from ``kx`` on as zero)."""
    return (rcodes.data_ptr(), rscales.data_ptr(), tensor_scale.data_ptr(), codebook.data_ptr(),
            e_table(rcodes.device).data_ptr(), x_ptr, y_ptr, bias.data_ptr() if bias is not None else 0,
            ws.data_ptr(), cnt.data_ptr(), M, N, x_stride, y_stride, p.S, p.Nt, p.splits, p.sps,
            0 if bias is None else _BIAS_KIND[bias.dtype], p.Nt * 16, kx)


def launch(x2, rcodes, rscales, tensor_scale, codebook, bias, y, *, k, scale_format, N, K, M, config=None, pro=None,
           epi=0) -> None:
    """One launch on x rows ``x2 [M, K]`` or ``[M, S * 256]`` zero-padded (16-byte aligned rows:
    :func:`kbit.ops.mma.common.x_rows`) into ``y``; ``pro``: ``(kind, residual, residual_out, norm_weight, eps)``
    of an x prologue; ``epi``: see :func:`plan_launch`."""
    dev = x2.device
    kind = pro[0] if pro else 0
    p, kern = PLANS.get(k, M, N, K, scale_format, config, x2.dtype == torch.bfloat16, dev, kind, epi)
    x_stride = x2.stride(0)
    if p.kernel == 7:  # reads x through a permuted copy of S * 256 columns
        x2 = prep_x(x2, p.S)
        x2 = x_tiles(x2, 8 * p.defines["NG"], p.S) if p.defines.get("XB") else permute_x(x2)
        x_stride = p.S * 4 if p.defines.get("XB") else x2.stride(0)  # XB: 64-column chunks a token block
    ws, cnt = workspace(dev, p.ws_floats, p.n_cnt) if p.use_ws else (y, y)
    fmt, extra = "", ()
    if kind:
        _, res, res_out, nw, eps = pro
        fmt, extra = "QQQfii", (res.data_ptr() if res is not None else 0,
                                res_out.data_ptr() if res_out is not None else 0,
                                nw.data_ptr(), float(eps), K, res.stride(0) if res is not None else 0)
    args = _kernel_args(p, rcodes, rscales, tensor_scale, codebook, x2.data_ptr(), y.data_ptr(), bias, ws, cnt, M,
                        N, x_stride, y.stride(0), kx=K)
    kern((p.grid,), p.warps * 32, _ARGS_FMT + fmt, *args, *extra, shared=p.shared, pdl=True)


def _need_kernels(x) -> None:
    if not kernels_available(x.device):
        fail(ValueError, "x", "a tensor on a CUDA device where the kernels run (sm_80+, NVRTC found; elsewhere "
             "kbit.dispatch chooses another backend)", x.device)
    if x.dtype not in (torch.float16, torch.bfloat16):  # the kernels read x as 16-bit values
        fail(TypeError, "x", "float16 or bfloat16 (float32 runs through kbit.dispatch's Triton GEMV)", x.dtype)


def _run(x, rc, rs, tensor_scale, codebook, bias, *, k, blocksize, scale_format, N, K, config):
    """Launch the kernels on repacked ``(rc, rs)``: one kernel 7 launch, or M rows in chunks of MAX_M."""
    if bias is not None:
        bias = bias.contiguous()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    S = rc.shape[1]
    large = isinstance(config, LargeConfig) if config is not None else _large_here(k, M, N, K, x.device)
    if large:
        config = config or _tuned(k, M, N, K, x.device, "large") or large_config(k, M, N, K)
        launch(x2, rc, rs, tensor_scale, codebook, bias, y, k=k, scale_format=scale_format, N=N, K=K, M=M,
               config=config)
        return y.reshape(*lead, N)
    for m0 in range(0, M, MAX_M):
        xm = x_rows(x2[m0:m0 + MAX_M], S)
        launch(xm, rc, rs, tensor_scale, codebook, bias, y[m0:m0 + MAX_M], k=k, scale_format=scale_format, N=N, K=K,
               M=xm.shape[0], config=config)
    return y.reshape(*lead, N)


# ------------------------------------------------------------------------------------------------ ops


def linear_small_m(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                   bias=None, config: MmaConfig | LargeConfig | None = None):
    """``y = x @ W.T (+ bias)`` for a k-bit weight ``W[N, K]`` in the canonical layout (repacked once and cached).

    x: fp16/bf16 ``[..., K]`` (any strides; leading dims flattened to M rows); codes / scales / tensor_scale /
    codebook as in ``kbit.ops.gemv.gemv``; bias optional ``[N]``; ``config``: pin a launch config (default:
    ``kbit.tuning.mma``). Returns ``[..., N]`` in x's dtype. Accumulation in fp32 (tensor cores); the codebook is
    rounded to x's dtype. Needs the CUDA kernels (``kbit.dispatch.linear.small_m`` chooses a backend).

    The cache (``kbit.ops.mma.layout.repacked``) keeps a repacked copy beside the canonical tensors for as long as
    they live: for weights held long (a model), hold them in layout "mma-v1" only and call
    :func:`linear_repacked` (``kbit.nn.KbitLinear.repack_for_kernels``).
    """
    check_dense(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    _need_kernels(x)
    if x.numel() == 0:
        return x.new_empty(*x.shape[:-1], N)
    rc, rs = repacked(codes, scales, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K)
    return run_repacked(x, rc, rs, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format, N=N,
                        K=K, bias=bias, config=config)


def run_repacked(x, rcodes, rscales, tensor_scale, codebook, *, k, blocksize, scale_format, N, K, bias=None,
                 config=None):
    """:func:`linear_repacked` on arguments the caller has checked (``kbit.dispatch`` checks them once)."""
    return _run(x, rcodes, rscales, tensor_scale, codebook, bias, k=k, blocksize=blocksize, scale_format=scale_format,
                N=N, K=K, config=config)


def linear_repacked(x, rcodes, rscales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                    bias=None, config: MmaConfig | LargeConfig | None = None):
    """:func:`linear_small_m` on a weight held in layout "mma-v1" (``rcodes, rscales`` from
    ``kbit.ops.mma.layout.repack``): no cache, nothing kept."""
    check_repacked(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    _need_kernels(x)
    return _run(x, rcodes, rscales, tensor_scale, codebook, bias, k=k, blocksize=blocksize, scale_format=scale_format,
                N=N, K=K, config=config)


def prepare_repacked(x, rcodes, rscales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                     bias=None):
    """A fast caller of :func:`linear_repacked` for inputs like ``x`` (same shape, strides, dtype, device; the
    weights' storage unchanged): checks the arguments once, packs the launch arguments once, and returns
    ``run(x) -> y`` (None from ``run`` where x's address is not 16-byte aligned: call :func:`linear_repacked`).
    None where the call is not one launch of kernels 1, 3, 4 with x read in place (no CUDA kernels here, M > 64 or
    kernel 7, x not contiguous or K not a multiple of 8). ``kbit.dispatch`` keeps one a signature: the host cost
    of a call is then about that of the launch itself."""
    check_repacked(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    if not (x.is_cuda and kernels_available(x.device)) or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    M = x.numel() // K
    if M > MAX_M or _large_here(k, M, N, K, x.device) or not x.is_contiguous() or K % 8:
        return None
    if bias is not None and not bias.is_contiguous():
        return None
    dev, dtype, shape = x.device, x.dtype, (*x.shape[:-1], N)
    p, kern = PLANS.get(k, M, N, K, scale_format, None, dtype == torch.bfloat16, dev)
    if p.defines.get("XB") or p.kernel == 7:
        return None
    ws, cnt = workspace(dev, max(p.ws_floats, 1), p.n_cnt)
    args = _kernel_args(p, rcodes, rscales, tensor_scale, codebook, 0, 0, bias, ws, cnt, M, N, K, N, kx=K)
    prep = Prepared(kern, (p.grid,), p.warps * 32, _ARGS_FMT, args, (_ARG_X, _ARG_Y), shared=p.shared, pdl=True)
    keep = (ws, cnt)  # alive for as long as the launch may use them (the e-table is cached per device for good)

    def run(x):
        xp = x.data_ptr()
        if xp & 15:
            return None
        y = torch.empty(shape, dtype=dtype, device=dev)
        prep.launch(xp, y.data_ptr())
        return y

    run.keep = keep
    return run


# ---------------------------------------------------------------------------------------------- a few tokens' MoE pairs

#: pairs a launch of :func:`pairs_linear` takes (``GRP_MAXP`` of ``common.cuh``)
PAIRS_MAX = 64
#: experts of a stack :func:`pairs_linear` takes (``GRP_MAXE``: their tensor scales staged in shared memory)
PAIRS_MAX_EXPERTS = 512
_PAIRS: dict = {}  # (k, P, N, K, scale_format, bf16, x rows, device, deterministic) -> its hit or None
PLANS.on_clear(_PAIRS.clear)


def _pairs_launch(k, P, N, K, scale_format, bf16, xn, dev):
    """(plan, GRP build, dynamic shared bytes) of the stacked ``[P N, K]`` launch at M = 1 on ``xn`` rows of x, or
    None where it does not apply: the dense path's pick for that shape is not kernel 3, or is one with K slices or the
    slot fix-up (deterministic mode), or has fewer threads than pairs (a thread a pair reads the ids). x's rows are
    staged where the plan stages x and they fit; else read from global memory."""
    key = (k, P, N, K, scale_format, bf16, xn, dev, deterministic())
    if key in _PAIRS:
        return _PAIRS[key]
    hit = None
    cfg = launch_config(k, 1, P * N, K, dev)
    for c in (cfg, replace(cfg, x_smem=False, x_slice=0)) if isinstance(cfg, MmaConfig) and cfg.kernel == 3 else ():
        p, _ = PLANS.get(k, 1, P * N, K, scale_format, c, bf16, dev)
        d = p.defines
        if p.kernel != 3 or d.get("XK") or d.get("DET") or P > p.warps * 32:
            break
        shared = p.shared + (xn - 1) * x_rows_bytes(1, p.S) if d.get("XS") else p.shared
        kern = cuda.compile_kernel(*p.source, {**d, "GRP": 1, "L2PF": 0}, dev)
        if shared <= SMEM_MAX and kern.occupancy(p.warps * 32, shared) >= 1:
            hit = (p, kern, shared)
            break
    _PAIRS[key] = hit
    return hit


def pairs_linear(x, rows, expert_ids, rcodes, rscales, tensor_scale, codebook, *, k, scale_format="log8", N, K,
                 bad=None):
    """A few tokens' MoE pairs ``y[p] = x[rows[p]] @ W[expert_ids[p]].T`` as one dense GEMV over the touched
    experts' stacked tiles: the dense path's M = 1 launch (kernel 3, its plan for a ``[P N, K]`` weight), built
    with ``GRP`` (stacked tile t reads expert ``expert_ids[t // (N / 16)]``'s tile, its pair's x row and tensor
    scale; ids and rows are read on the device after the launch's PDL wait, no host sync). On six MoE shapes one
    token's grouped GEMMs ran 1.09-1.60x slower than this (H200, ``benchmarks/results/h200/moe-pairs-2026-11-29/``);
    Qwen3-30B-A3B-shaped decode steps of 2-8 tokens 1.16-1.33x slower (``moe-pairs-few-tokens-2026-11-29/``).

    x: fp16/bf16 ``[R, K]`` (gate_up: the tokens; down: a row a pair); rows, expert_ids: int32 ``[P]`` in range
    (the caller's ``kbit.ops._ids.guard``; ``bad``: its mask, those rows NaN after); rcodes / rscales: a stack
    ``[E, N / 16, ...]`` in layout "mma-v1", tensor_scale float32 ``[E]``. Returns ``[P, N]``, or None where the
    launch does not apply (more than :data:`PAIRS_MAX` pairs or :data:`PAIRS_MAX_EXPERTS` experts, N not a multiple
    of 16, no CUDA kernels, or the stacked shape's dense pick is not a kernel-3 build it covers, or has fewer
    threads than pairs): the caller runs the grouped kernels then."""
    P = expert_ids.shape[0]
    dev = x.device
    if not (1 <= P <= PAIRS_MAX and tensor_scale.numel() <= PAIRS_MAX_EXPERTS and N % 16 == 0
            and rcodes.shape[1] * 16 == N and x.is_cuda
            and kernels_available(dev) and x.dtype in (torch.float16, torch.bfloat16)):
        return None
    hit = _pairs_launch(k, P, N, K, scale_format, x.dtype == torch.bfloat16, x.shape[0], dev)
    if hit is None:
        return None
    p, kern, shared = hit
    xm = x_rows(x.contiguous(), p.S)
    y = torch.empty(P, N, dtype=x.dtype, device=dev)
    ws, cnt = workspace(dev, p.ws_floats, p.n_cnt) if p.use_ws else (y, y)
    ids, rws = expert_ids.contiguous(), rows.contiguous()
    args = _kernel_args(p, rcodes, rscales, tensor_scale, codebook, xm.data_ptr(), y.data_ptr(), None, ws, cnt, 1,
                        P * N, xm.stride(0), P * N, kx=K)
    kern((p.grid,), p.warps * 32, _ARGS_FMT + "QQiii", *args, ids.data_ptr(), rws.data_ptr(), N // 16, xm.shape[0],
         tensor_scale.numel(), shared=shared, pdl=True)
    return poison(y, bad)


_DEQ_KERNELS: dict = {}  # (k, scale_format, dtype, vec, device) -> (kernel, grid slots)


def dequant_repacked(rcodes, rscales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                     dtype=torch.bfloat16, out=None):
    """``W [N, K]`` in ``dtype`` (float16 / bfloat16) from a weight in layout "mma-v1", in one kernel
    (``kbit_deq_mma``; bit-exact with ``kbit.ops.dequant`` of the canonical tensors) instead of unrepacking plus
    the canonical dequantize. ``out``: a contiguous ``[N, K]`` tensor of ``dtype`` to write into."""
    if dtype not in (torch.float16, torch.bfloat16):
        fail(TypeError, "dtype", "torch.float16 or torch.bfloat16", dtype)
    probe = torch.empty(0, K, dtype=dtype, device=rcodes.device)
    check_repacked(probe, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, None)
    if out is not None and (tuple(out.shape) != (N, K) or out.dtype != dtype or not out.is_contiguous()
                            or out.device != rcodes.device):
        fail(ValueError, "out", f"a contiguous {dtype} tensor of shape {(N, K)} on {rcodes.device}",
             f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous: {out.is_contiguous()})")
    if not kernels_available(rcodes.device):
        fail(ValueError, "rcodes", "tensors on a CUDA device where the kernel runs (sm_80+, NVRTC found); "
             "elsewhere use unrepack and kbit.ops.dequant", rcodes.device)
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=rcodes.device)
    _, Nt, S = geometry(N, K, blocksize)
    if N == 0 or K == 0:
        return out
    dev = out.device
    vec = int(K % 8 == 0 and out.data_ptr() % 16 == 0)
    key = (k, scale_format, dtype, vec, dev)
    hit = _DEQ_KERNELS.get(key)
    if hit is None:
        kern = cuda.compile_kernel("dequant_mma.cu", "kbit_deq_mma", dict(
            K_BITS=k, FP16_SCALES=int(scale_format == "fp16"), BF16=int(dtype == torch.bfloat16), VEC=vec), dev)
        hit = _DEQ_KERNELS[key] = (kern, sm_count(dev) * kern.occupancy(256, table_smem(k)))
    kern, slots = hit
    grid = max(1, min(slots, -(-(Nt * S) // 8)))
    kern((grid,), 256, "QQQQQQiiii", rcodes.data_ptr(), rscales.data_ptr(), tensor_scale.data_ptr(),
         codebook.data_ptr(), e_table(dev).data_ptr(), out.data_ptr(), N, K, S, Nt, shared=table_smem(k))
    return out



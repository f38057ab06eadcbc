"""GEMV on k-bit weights for M = 1..8 activation rows (decode), dense and MoE-grouped.

Launchers validate -> allocate -> pick a config -> launch ``kbit.kernels.gemv.gemv_kernel``; each op has a
plain-torch float64 reference beside it (``*_reference``) and is registered as a torch op
(``torch.ops.kbit.gemv``, ``torch.ops.kbit.grouped_gemv``) with a fake implementation.

Weights are read in the canonical layout of ``docs/format.md`` (no repack step). This is the Triton backend
only: ``kbit.dispatch`` decides when the CUDA small-M kernels (``kbit.ops.gemv_mma``) serve instead.
"""

from __future__ import annotations

import math

import torch

from kbit.kernels import gemv as _k
from kbit.kernels import gemv_ptx as _ptx
from kbit.ops._checks import check_dense, check_grouped
from kbit.ops._ids import check_bounds, check_ids, error_flag, host_checks
from kbit.ops.reference import gemv_reference, grouped_gemv_reference
from kbit.tuning.gemv import GemvConfig, gemv_config
from kbit.utils.cache import TensorCache
from kbit.utils.checks import check_tensor
from kbit.utils.device import interpreting, sm_count

__all__ = [
    "gemv",
    "grouped_gemv",
    "gemv_reference",
    "grouped_gemv_reference",
    "kbit_grouped_gemv",
    "lookup_table",
]

MAX_M = 8  # rows per launch; larger M is split into launches of 8


# ------------------------------------------------------------------------------------------------ helpers

_TABLES = TensorCache(max_entries=None)  # a few hundred bytes per live codebook


def lookup_table(codebook: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Byte tables of the codebook for the fast kernel: int32 [32 * 2**(k-1)] (32 equal copies).

    The codebook rounded to ``dtype`` (fp16/bf16); words 0 .. 2**k/4 - 1 hold the low bytes of entries
    4i .. 4i+3 (entry 4i in byte 0), the next 2**k/4 words their high bytes. Cached per codebook tensor
    version.
    """
    hit = _TABLES.get((codebook,), dtype)
    if hit is not None:
        return hit
    v = codebook.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
    lo = (v & 0xFF).to(torch.uint8)
    hi = (v >> 8).to(torch.uint8)
    tab = torch.cat([lo, hi]).view(torch.int32).contiguous()
    tab = tab.repeat(32)  # one copy per lane (see kbit.kernels.gemv._treg); tab[:2**(k-1)] is the table
    return _TABLES.put((codebook,), dtype, tab)


def _x_pairs(x2: torch.Tensor) -> torch.Tensor:
    """[M, K] halves -> int32 [M, ceil(K/2)] view of pairs (a zero-padded copy when it cannot be a view)."""
    M, K = x2.shape
    if K % 2 == 0 and x2.stride(1) == 1 and x2.stride(0) % 2 == 0 and x2.data_ptr() % 4 == 0:
        try:
            return x2.view(torch.int32)
        except RuntimeError:
            pass
    xc = torch.zeros(M, K + K % 2, dtype=x2.dtype, device=x2.device)
    xc[:, :K] = x2
    return xc.view(torch.int32)


def _sms(device) -> int:
    """SMs of ``device``; 132 (an H100's) where there is none (the interpreter), for the split heuristics."""
    return 132 if device is None or device.type != "cuda" else sm_count(device)


def _launch(x32, codes, scales, tensor_scale, codebook, bias, y, tok, exp, *, k, blocksize, scale_format, N,
            K, M, grouped, P, config: GemvConfig | None):
    bf16 = y.dtype == torch.bfloat16
    use_asm = codes.is_cuda and not interpreting()
    dev = codes.device if codes.is_cuda else None
    cfg = config or gemv_config(k, M, N, K, dev, grouped, P)
    tab = lookup_table(codebook, y.dtype) if use_asm else codebook
    Kp = math.ceil(K / blocksize) * blocksize
    ng = Kp // 32
    np_ = _ptx.n_pairs(k)
    sms = _sms(dev)
    n_rb = _cdiv(N, cfg.BN)
    splits, gs = _splits(cfg, n_rb * P, ng, grouped, sms)
    xtail = x32.shape[-1] % np_ != 0
    out = y
    if splits > 1:
        out = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    lead_c = codes.stride(0) if grouped else 0
    lead_b = bias.stride(0) if (grouped and bias is not None) else 0
    common = dict(K_BITS=k, LOG8=scale_format == "log8", M=M, BN=cfg.BN, G=cfg.G, BF16=bf16, USE_ASM=use_asm,
                  GROUPED=grouped, HAS_BIAS=bias is not None, XTAIL=xtail, SPLIT=splits > 1,
                  LASM=_ptx.LOOKUP_ASM[k], LCONS=_ptx.LOOKUP_CONS[k], DASM=_ptx.DOT_ASM[(np_, bf16)],
                  DCONS=_ptx.DOT_CONS[(np_, bf16)], num_warps=cfg.num_warps)
    ids = (tok if tok is not None else tensor_scale, exp if exp is not None else tensor_scale)
    # the ids' bounds and the error flag (kbit.ops._ids): the kernel reads an id out of range as 0, NaN row
    ids += (x32.shape[0], codes.shape[0], error_flag(y.device)) if grouped else (0, 0, tensor_scale)
    if not cfg.pipelined:  # v2: a program per (row block, K split), plain loop
        even_k = K == Kp and ng % cfg.G == 0
        lead_s = scales.stride(0) if grouped else 0
        _k.gemv_kernel[(n_rb, P if grouped else 1, splits)](
            x32, codes, scales, tensor_scale, tab, codebook, bias if bias is not None else y, out, *ids,
            N, x32.shape[-1], ng, Kp // blocksize, (blocksize // 32).bit_length() - 1, gs,
            x32.stride(0), out.stride(0), lead_c, lead_s, lead_b,
            EVEN_K=even_k, PREFETCH=False, num_stages=1, **common)
    else:  # v3: pipelined, persistent
        even_k = K == Kp and ng % cfg.G == 0 and ng % gs == 0
        if scales.data_ptr() % 4:  # the kernel reads scales as aligned int32 words
            scales = scales.clone()
        lead_s = scales.stride(0) if grouped else 0
        nt = n_rb * splits  # tiles per matrix
        xvec = use_asm and even_k and not xtail and x32.data_ptr() % 16 == 0 and x32.stride(0) % 4 == 0
        _k.gemv_kernel_v3[(_programs(cfg, nt, P, sms), P if grouped else 1)](
            x32, codes, scales, tensor_scale, tab, codebook, bias if bias is not None else y, out, *ids,
            N, x32.shape[-1], ng, Kp // blocksize, (blocksize // 32).bit_length() - 1, gs, nt, gs // cfg.G,
            splits, x32.stride(0), out.stride(0), lead_c, lead_s, lead_b,
            EVEN_K=even_k, STAGES=cfg.num_stages if use_asm else 1, XVEC=xvec, num_stages=1, **common)
    if splits > 1:
        y.copy_(out)


def _splits(cfg, tiles, ng, grouped, sms):
    """K splits and groups per split (a multiple of G): split K only when the row blocks alone cannot give
    every SM ``cfg.pps`` (or 4) programs; dense only."""
    gs_all = -(-ng // cfg.G) * cfg.G
    if grouped or cfg.split == 1:
        return 1, gs_all
    s = cfg.split
    if s == 0:
        want = sms * (cfg.pps or 4)
        s = max(1, min(-(-want // tiles), ng // (4 * cfg.G)))
    gs = -(-ng // s)
    gs = -(-gs // cfg.G) * cfg.G
    return -(-ng // gs), gs


def _programs(cfg, nt, P, sms):
    """Programs along the tile axis. pps = 0: one tile each. Else persistent: at most pps programs per SM
    (over all P matrices), each taking the same number of tiles (rounds), so no SM waits on a last wave."""
    if cfg.pps == 0:
        return nt
    slots = max(1, sms * cfg.pps // P)
    rounds = -(-nt // slots)
    return -(-nt // rounds)


def _cdiv(a, b):
    return (a + b - 1) // b


# ------------------------------------------------------------------------------------------------ dense


def gemv(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K, bias=None,
         config: GemvConfig | None = None):
    """``y = x @ W.T (+ bias)`` for a k-bit weight ``W[N, K]`` in the canonical layout.

    Parameters
    ----------
    x : fp16 or bf16 ``[..., K]`` (any strides); the leading dims are flattened to M rows.
    codes : int32 ``[N, Kp * k / 32]``; scales : uint8 (log8) or fp16 ``[N, Kp / blocksize]``;
    tensor_scale : float32 ``[]``; codebook : float32 ``[2**k]`` (see ``docs/format.md``).
    bias : optional ``[N]`` (any float dtype).
    config : pin a :class:`~kbit.tuning.gemv.GemvConfig` (tests, tuning); default from ``kbit.tuning.gemv``.

    Returns
    -------
    ``[..., N]`` in x's dtype. Accumulation: fp32 across words and blocks; the products of one code word
    (8 or 16 weights) are summed in half precision first (fp16: 8 a lane; bf16: 4 a lane).

    Example
    -------
    >>> y = gemv(x, w.codes, w.scales, w.tensor_scale, w.codebook, k=4, N=4096, K=4096)  # doctest: +SKIP
    """
    check_dense(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    if bias is not None:
        bias = bias.contiguous()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    for m0 in range(0, M, MAX_M):
        xm = x2[m0:m0 + MAX_M]
        x32 = _x_pairs(xm)
        _launch(x32, codes, scales, tensor_scale, codebook, bias, y[m0:m0 + MAX_M], None, None, k=k,
                blocksize=blocksize, scale_format=scale_format, N=N, K=K, M=xm.shape[0], grouped=False, P=1,
                config=config)
    return y.reshape(*lead, N)


# ------------------------------------------------------------------------------------------------ grouped


def grouped_gemv(x, token_ids, expert_ids, codes, scales, tensor_scale, codebook, *, k, blocksize=32,
                 scale_format="log8", N, K, bias=None, config: GemvConfig | None = None):
    """MoE decode: ``y[p] = x[token_ids[p]] @ W[expert_ids[p]].T (+ bias[expert_ids[p]])`` in one launch.

    Parameters
    ----------
    x : fp16/bf16 ``[T, K]``; token_ids, expert_ids : int32 ``[P]`` on x's device, ``0 <= token < T``,
    ``0 <= expert < E``; codes ``[E, N, Kp*k/32]``, scales ``[E, N, nb]``, tensor_scale float32 ``[E]``,
    codebook ``[2**k]``; bias optional ``[E, N]``.

    Returns
    -------
    ``[P, N]`` in x's dtype.

    Bad ids (``kbit.ops._ids``): on the CPU and in ``debug_ids`` mode ``ValueError`` (argument, range, value)
    before the launch; on CUDA no host read (no sync): a row whose token or expert id is out of range reads
    row / expert 0 (in bounds), is NaN, and sets the device's error flag (``check_errors`` raises).
    """
    E = check_grouped(x, "token_ids", token_ids, expert_ids, codes, scales, tensor_scale, codebook, k, blocksize,
                       scale_format, N, K)
    if bias is not None:
        check_tensor("bias", bias, (torch.float16, torch.bfloat16, torch.float32), (E, N), x.device)
        bias = bias.contiguous()
    P = token_ids.shape[0]
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0:
        return y
    check_bounds(P, x.shape[0], E)
    if host_checks(token_ids):
        check_ids("token_ids", token_ids, x.shape[0], "rows of x")
        check_ids("expert_ids", expert_ids, E, "experts of the stack")
    _launch(_x_pairs(x), codes, scales, tensor_scale, codebook, bias, y, token_ids.contiguous(),
            expert_ids.contiguous(), k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K, M=1,
            grouped=True, P=P, config=config)
    return y


# ------------------------------------------------------------------------------------------------ torch ops


@torch.library.custom_op("kbit::grouped_gemv", mutates_args=())
def _grouped_gemv_op(x: torch.Tensor, token_ids: torch.Tensor, expert_ids: torch.Tensor, codes: torch.Tensor,
                     scales: torch.Tensor, tensor_scale: torch.Tensor, codebook: torch.Tensor, k: int,
                     blocksize: int, scale_format: str, N: int, K: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return grouped_gemv(x, token_ids, expert_ids, codes, scales, tensor_scale, codebook, k=k,
                        blocksize=blocksize, scale_format=scale_format, N=N, K=K, bias=bias)


@_grouped_gemv_op.register_fake
def _(x, token_ids, expert_ids, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K,
      bias=None):
    return x.new_empty(token_ids.shape[0], N)


# ------------------------------------------------------------------------------------------------ KbitWeight


def _weight_args(weight):
    N, K = weight.shape[-2], weight.shape[-1]
    return dict(k=weight.k, blocksize=weight.blocksize, scale_format=weight.scale_format, N=N, K=K)


def kbit_grouped_gemv(x, token_ids, expert_ids, weight, bias=None) -> torch.Tensor:
    """Grouped GEMV over a stacked ``KbitWeight`` of shape ``(E, N, K)``."""
    a = _weight_args(weight)
    return torch.ops.kbit.grouped_gemv(x, token_ids, expert_ids, weight.codes, weight.scales,
                                       weight.tensor_scale, weight.codebook, a["k"], a["blocksize"],
                                       a["scale_format"], a["N"], a["K"], bias)



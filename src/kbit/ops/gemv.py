"""GEMV on k-bit weights for M = 1..8 activation rows (decode), dense and MoE-grouped.

Launchers validate -> allocate -> pick a config -> launch ``kbit.kernels.gemv.gemv_kernel``; each op has a
plain-torch float64 reference beside it (``*_reference``) and is registered as a torch op
(``torch.ops.kbit.gemv``, ``torch.ops.kbit.grouped_gemv``) with a fake implementation.

Weights are read in the canonical layout of ``docs/format.md`` (no repack step).
"""

from __future__ import annotations

import math
import os
import weakref

import torch

from kbit.format.pack import unpack
from kbit.kernels import gemv as _k
from kbit.tuning.gemv import GemvConfig, gemv_config

__all__ = [
    "gemv",
    "grouped_gemv",
    "gemv_reference",
    "grouped_gemv_reference",
    "kbit_gemv",
    "kbit_grouped_gemv",
    "lookup_table",
]

_SCALE_FORMATS = ("log8", "fp16")
MAX_M = 8  # rows per launch; larger M is split into launches of 8


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ------------------------------------------------------------------------------------------------ validation


def _fail(cls, name, expected, got):
    raise cls(f"{name}: expected {expected}, got {got}")


def _check_tensor(name, t, dtypes, shape=None, device=None):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        _fail(TypeError, name, "dtype " + " or ".join(str(d) for d in dtypes), t.dtype)
    if shape is not None and tuple(t.shape) != tuple(shape):
        _fail(ValueError, name, f"shape {tuple(shape)}", tuple(t.shape))
    if device is not None and t.device != device:
        _fail(ValueError, name, f"device {device}", t.device)


def _check_params(k, blocksize, scale_format, N, K):
    if k not in (2, 3, 4, 5):
        _fail(ValueError, "k", "one of 2, 3, 4, 5", k)
    if blocksize not in (32, 64, 128):
        _fail(ValueError, "blocksize", "one of 32, 64, 128", blocksize)
    if scale_format not in _SCALE_FORMATS:
        _fail(ValueError, "scale_format", "'log8' or 'fp16'", repr(scale_format))
    if not (isinstance(N, int) and N >= 1):
        _fail(ValueError, "N", "a positive int", N)
    if not (isinstance(K, int) and K >= 1):
        _fail(ValueError, "K", "a positive int", K)


def _check_weight(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, lead, device):
    Kp = math.ceil(K / blocksize) * blocksize
    _check_tensor("codes", codes, (torch.int32,), (*lead, N, Kp * k // 32), device)
    sdt = torch.uint8 if scale_format == "log8" else torch.float16
    _check_tensor("scales", scales, (sdt,), (*lead, N, Kp // blocksize), device)
    _check_tensor("tensor_scale", tensor_scale, (torch.float32,), lead, device)
    _check_tensor("codebook", codebook, (torch.float32,), (2**k,), device)
    if not codes.is_contiguous():
        _fail(ValueError, "codes", "a contiguous tensor", f"strides {codes.stride()}")
    if not scales.is_contiguous():
        _fail(ValueError, "scales", "a contiguous tensor", f"strides {scales.stride()}")


# ------------------------------------------------------------------------------------------------ helpers

_TABLES: dict = {}


def lookup_table(codebook: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Byte tables of the codebook for the fast kernel: int32 [32 * 2**(k-1)] (32 equal copies).

    The codebook rounded to ``dtype`` (fp16/bf16); words 0 .. 2**k/4 - 1 hold the low bytes of entries
    4i .. 4i+3 (entry 4i in byte 0), the next 2**k/4 words their high bytes. Cached per codebook tensor
    version.
    """
    # keyed by the tensor object (checked through a weak reference), not by its address: the memory of a
    # freed codebook is soon reused by another one
    key = (id(codebook), dtype)
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is codebook and hit[1] == codebook._version:
        return hit[2]
    v = codebook.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
    lo = (v & 0xFF).to(torch.uint8)
    hi = (v >> 8).to(torch.uint8)
    tab = torch.cat([lo, hi]).view(torch.int32).contiguous()
    tab = tab.repeat(32)  # one copy per lane (see kbit.kernels.gemv._treg); tab[:2**(k-1)] is the table
    if len(_TABLES) > 256:
        _TABLES.clear()
    _TABLES[key] = (weakref.ref(codebook), codebook._version, tab)
    return tab


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
    if device is None or device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(x32, codes, scales, tensor_scale, codebook, bias, y, tok, exp, *, k, blocksize, scale_format, N,
            K, M, grouped, P, config: GemvConfig | None):
    bf16 = y.dtype == torch.bfloat16
    use_asm = codes.is_cuda and not _interpret()
    dev = codes.device if codes.is_cuda else None
    cfg = config or gemv_config(k, M, N, K, dev, grouped, P)
    tab = lookup_table(codebook, y.dtype) if use_asm else codebook
    Kp = math.ceil(K / blocksize) * blocksize
    ng = Kp // 32
    np_ = _k.n_pairs(k)
    sms = _sms(dev)
    n_rb = triton_cdiv(N, cfg.BN)
    splits, gs = _splits(cfg, n_rb * P, ng, grouped, sms)
    xtail = x32.shape[-1] % np_ != 0
    out = y
    if splits > 1:
        out = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    lead_c = codes.stride(0) if grouped else 0
    lead_b = bias.stride(0) if (grouped and bias is not None) else 0
    common = dict(K_BITS=k, LOG8=scale_format == "log8", M=M, BN=cfg.BN, G=cfg.G, BF16=bf16, USE_ASM=use_asm,
                  GROUPED=grouped, HAS_BIAS=bias is not None, XTAIL=xtail, SPLIT=splits > 1,
                  LASM=_k.LOOKUP_ASM[k], LCONS=_k.LOOKUP_CONS[k], DASM=_k.DOT_ASM[(np_, bf16)],
                  DCONS=_k.DOT_CONS[(np_, bf16)], num_warps=cfg.num_warps)
    ids = (tok if tok is not None else tensor_scale, exp if exp is not None else tensor_scale)
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


def triton_cdiv(a, b):
    return (a + b - 1) // b


# ------------------------------------------------------------------------------------------------ dense


def _use_mma(x) -> bool:
    """The CUDA tensor-core kernel (kbit.ops.gemv_mma) serves dense calls on CUDA unless a Triton config is
    pinned or ``KBIT_GEMV_BACKEND=triton``."""
    if not x.is_cuda or _interpret() or os.environ.get("KBIT_GEMV_BACKEND", "") == "triton":
        return False
    from kbit.ops import gemv_mma

    return gemv_mma.available(x.device)



def _check_dense(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias):
    """The argument checks of a dense small-M call (``gemv``, ``kbit.ops.gemv_mma.linear_small_m``)."""
    _check_params(k, blocksize, scale_format, N, K)
    _check_tensor("x", x, (torch.float16, torch.bfloat16))
    if x.dim() < 1 or x.shape[-1] != K:
        _fail(ValueError, "x", f"last dimension K={K}", tuple(x.shape))
    _check_weight(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, (), x.device)
    if bias is not None:
        _check_tensor("bias", bias, (torch.float16, torch.bfloat16, torch.float32), (N,), x.device)

def gemv(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K, bias=None,
         config: GemvConfig | None = None):
    """``y = x @ W.T (+ bias)`` for a k-bit weight ``W[N, K]`` in the canonical layout.

    Parameters
    ----------
    x : fp16 or bf16 ``[..., K]`` (any strides); the leading dims are flattened to M rows.
    codes : int32 ``[N, Kp * k / 32]``; scales : uint8 (log8) or fp16 ``[N, Kp / blocksize]``;
    tensor_scale : float32 ``[]``; codebook : float32 ``[2**k]`` (see ``docs/format.md``).
    bias : optional ``[N]`` (any float dtype).
    config : pin a :class:`~kbit.tuning.gemv.GemvConfig` (tests, tuning) to run the Triton kernel. Without one,
        on CUDA with NVRTC, the call goes to the tensor-core kernel ``kbit.ops.gemv_mma.linear_small_m``
        (``KBIT_GEMV_BACKEND=triton`` keeps the Triton kernel with the tuning table's config).

    Returns
    -------
    ``[..., N]`` in x's dtype. Accumulation: fp32 across words and blocks; the products of one code word
    (8 or 16 weights) are summed in half precision first (fp16: 8 a lane; bf16: 4 a lane).

    Example
    -------
    >>> y = gemv(x, w.codes, w.scales, w.tensor_scale, w.codebook, k=4, N=4096, K=4096)  # doctest: +SKIP
    """
    _check_dense(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    if bias is not None:
        bias = bias.contiguous()
    if config is None and _use_mma(x):
        from kbit.ops import gemv_mma

        return gemv_mma._linear_small_m(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                                        scale_format=scale_format, N=N, K=K, bias=bias)  # checked above
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


def _check_grouped(x, rows_name, rows, expert_ids, codes, scales, tensor_scale, codebook, k, blocksize,
                   scale_format, N, K) -> int:
    """Validate the arguments of a grouped call (``y[r] = x[rows[r]] @ W[expert_ids[r]].T``); returns E."""
    _check_params(k, blocksize, scale_format, N, K)
    _check_tensor("x", x, (torch.float16, torch.bfloat16))
    if x.dim() != 2 or x.shape[1] != K:
        _fail(ValueError, "x", f"shape [T, {K}]", tuple(x.shape))
    if codes.dim() != 3:
        _fail(ValueError, "codes", "a 3-D stack [E, N, words]", tuple(codes.shape))
    E = codes.shape[0]
    _check_weight(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, (E,), x.device)
    _check_tensor(rows_name, rows, (torch.int32,), None, x.device)
    _check_tensor("expert_ids", expert_ids, (torch.int32,), None, x.device)
    if rows.dim() != 1 or expert_ids.shape != rows.shape:
        _fail(ValueError, "expert_ids", f"shape of {rows_name} {tuple(rows.shape)} (1-D)", tuple(expert_ids.shape))
    return E


def grouped_gemv(x, token_ids, expert_ids, codes, scales, tensor_scale, codebook, *, k, blocksize=32,
                 scale_format="log8", N, K, bias=None, config: GemvConfig | None = None):
    """MoE decode: ``y[p] = x[token_ids[p]] @ W[expert_ids[p]].T (+ bias[expert_ids[p]])`` in one launch.

    Parameters
    ----------
    x : fp16/bf16 ``[T, K]``; token_ids, expert_ids : int32 ``[P]`` on the device (not read by the host:
    ids must be valid, ``0 <= token < T``, ``0 <= expert < E``); codes ``[E, N, Kp*k/32]``, scales
    ``[E, N, nb]``, tensor_scale float32 ``[E]``, codebook ``[2**k]``; bias optional ``[E, N]``.

    Returns
    -------
    ``[P, N]`` in x's dtype.
    """
    E = _check_grouped(x, "token_ids", token_ids, expert_ids, codes, scales, tensor_scale, codebook, k, blocksize,
                       scale_format, N, K)
    if bias is not None:
        _check_tensor("bias", bias, (torch.float16, torch.bfloat16, torch.float32), (E, N), x.device)
        bias = bias.contiguous()
    P = token_ids.shape[0]
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0:
        return y
    _launch(_x_pairs(x), codes, scales, tensor_scale, codebook, bias, y, token_ids.contiguous(),
            expert_ids.contiguous(), k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K, M=1,
            grouped=True, P=P, config=config)
    return y


# ------------------------------------------------------------------------------------------------ references


def dequantize_reference(codes, scales, tensor_scale, codebook, *, k, blocksize, scale_format, K):
    """float64 W[..., N, K] from the canonical layout (the format's definition, nothing else)."""
    Kp = codes.shape[-1] * 32 // k
    c = unpack(codes, k, Kp).long()
    v = codebook.to(torch.float64)[c]
    if scale_format == "log8":
        q = scales.to(torch.float64)
        s = torch.where(q < 255, torch.exp2(-q / 16), torch.zeros_like(q))
        s = s * tensor_scale.to(torch.float64)[..., None, None]
    else:
        s = scales.to(torch.float64)
    w = v * s.repeat_interleave(blocksize, dim=-1)
    return w[..., :K]


def gemv_reference(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                   bias=None):
    """float64 ``x @ W.T (+ bias)``, shape ``[..., N]``."""
    w = dequantize_reference(codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                             scale_format=scale_format, K=K)
    y = x.to(torch.float64) @ w.T
    return y + bias.to(torch.float64) if bias is not None else y


def grouped_gemv_reference(x, token_ids, expert_ids, codes, scales, tensor_scale, codebook, *, k,
                           blocksize=32, scale_format="log8", N, K, bias=None):
    w = dequantize_reference(codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                             scale_format=scale_format, K=K)  # [E, N, K]
    e = expert_ids.long()
    y = torch.einsum("pk,pnk->pn", x.to(torch.float64)[token_ids.long()], w[e])
    return y + bias.to(torch.float64)[e] if bias is not None else y


# ------------------------------------------------------------------------------------------------ torch ops


@torch.library.custom_op("kbit::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
             codebook: torch.Tensor, k: int, blocksize: int, scale_format: str, N: int, K: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    return gemv(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format,
                N=N, K=K, bias=bias)


@_gemv_op.register_fake
def _(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias=None):
    return x.new_empty(*x.shape[:-1], N)


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


def kbit_gemv(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a 2-D ``kbit.format.KbitWeight`` (through ``torch.ops.kbit.gemv``)."""
    a = _weight_args(weight)
    return torch.ops.kbit.gemv(x, weight.codes, weight.scales, weight.tensor_scale, weight.codebook,
                               a["k"], a["blocksize"], a["scale_format"], a["N"], a["K"], bias)


def kbit_grouped_gemv(x, token_ids, expert_ids, weight, bias=None) -> torch.Tensor:
    """Grouped GEMV over a stacked ``KbitWeight`` of shape ``(E, N, K)``."""
    a = _weight_args(weight)
    return torch.ops.kbit.grouped_gemv(x, token_ids, expert_ids, weight.codes, weight.scales,
                                       weight.tensor_scale, weight.codebook, a["k"], a["blocksize"],
                                       a["scale_format"], a["N"], a["K"], bias)

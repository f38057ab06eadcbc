"""Split-KV decode attention: one query token per sequence against a (static) KV cache, no host sync.

``decode_attention`` is the op (validate -> allocate -> pick config -> launch, registered as
``kbit::decode_attention``); ``decode_attention_reference`` is its float64 plain-torch specification.
``rope_decode_attention`` (``kbit::rope_decode_attention``) is the decode step's rotary + KV append
(:func:`kbit.ops.glue.rope_append`) fused into it, one launch instead of two; its reference is
``rope_decode_attention_reference`` (rope_append's reference, then decode_attention's).
Kernels: ``kbit.kernels.attention``.

Why: SDPA on ``[B, Hkv, G, D]`` queries against a ``[B, Hkv, Lmax, D]`` static cache runs ``B * Hkv``
programs (8 on Llama-3-8B at batch 1, for 132 SMs) and reads the padded part of the cache. Here every
KV head's length is split over programs (about ``PROGRAMS_PER_SM`` per SM in all, chosen from ``Lmax``
so the grid is fixed under a CUDA graph), and a program whose keys are all invalid skips its K/V loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kbit.kernels import attention as _k
from kbit.ops._rope import check_rope_append, rope_append_reference
from kbit.ops.pdl import launch_kw
from kbit.utils.checks import fail
from kbit.utils.device import interpreting, sm_count

__all__ = [
    "DecodeAttentionConfig",
    "attention_config",
    "decode_attention",
    "decode_attention_reference",
    "rope_decode_attention",
    "rope_decode_attention_reference",
    "supports",
]

_DTYPES = (torch.float16, torch.bfloat16)
_MASK_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
MASKED = -65504.0  # additive mask values <= this exclude the key (see kbit.kernels.attention.MASKED)
MAX_G = 64  # query rows per KV head in one tile (padded to a power of two >= 16)
PROGRAMS_PER_SM = 4  # split target: B * Hkv * splits ~ this many programs per SM (2-4 do well)
#: splits a KV head at most: the program that finishes last merges all of them, one after another, so past this many
#: the merge costs more than the extra programs save (H100, the decode step at context 4096 with 4 and 8 KV heads:
#: 129 -> 33 splits saved 24 us a layer, 65 -> 33 saved 7; docs/notes/2026-11-26-attention-splits.md)
MAX_SPLITS = 33
#: chunks up to this many keys run in blocks of 32 keys with 2 warps (2 stages past one block), which the same
#: measurements preferred to 64-key blocks with 4 warps
SMALL_CHUNK = 128
DEFAULT_SMS = 132  # H100 SXM; used when the device is not a GPU (interpreter) or does not say
COMBINE_BLOCK_S = 16  # partials merged per step of the combine loop
FOLD_TILE = 8192  # elements of one [SB, G, D] step of the folded merge (SB partials loaded together)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def device_sms(device: torch.device) -> int:
    """SMs of ``device``, or DEFAULT_SMS off CUDA (the interpreter): the split count depends on it."""
    return sm_count(device) if device.type == "cuda" else DEFAULT_SMS


# --------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DecodeAttentionConfig:
    """Launch choices of ``decode_attention``; ``attention_config`` gives the default, tests may pin one.

    Attributes
    ----------
    chunk : int
        Keys per split program (a multiple of ``block_n``); the grid is ``(B * Hkv, ceil(L / chunk))``.
        One split (``chunk >= L``) writes the output directly and skips the combine kernel.
    block_n : int
        Keys per step of a program's loop (power of two, >= 16: the ``tl.dot`` minimum).
    num_warps : int
        ``num_warps`` of the split kernel.
    num_stages : int
        ``num_stages`` of the split kernel (software pipelining of the K/V loads of the length-only loop;
        stages hold ``2 * block_n * D`` input elements of shared memory each).
    """

    chunk: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            fail(ValueError, "DecodeAttentionConfig.block_n", "a power of two >= 16", self.block_n)
        if self.chunk < self.block_n or self.chunk % self.block_n:
            fail(ValueError, "DecodeAttentionConfig.chunk", f"a positive multiple of block_n = {self.block_n}",
                 self.chunk)
        if self.num_warps not in (1, 2, 4, 8, 16):
            fail(ValueError, "DecodeAttentionConfig.num_warps", "1, 2, 4, 8 or 16", self.num_warps)
        if not 1 <= self.num_stages <= 6:
            fail(ValueError, "DecodeAttentionConfig.num_stages", "in [1, 6]", self.num_stages)


def attention_config(batch_heads: int, length: int, head_dim: int, sms: int = DEFAULT_SMS) -> DecodeAttentionConfig:
    """Split ``length`` (the cache length, not the valid one) so that ``batch_heads * splits`` is about
    ``PROGRAMS_PER_SM * sms`` programs, at most ``MAX_SPLITS`` a head; chunks are whole blocks of 64 keys (32 for
    D = 256, or for chunks up to ``SMALL_CHUNK`` keys). Measured in the decode step (Llama-3-8B and Qwen3-30B-A3B
    shapes, batch 1, context 512 and 4096, H100); the other batches and contexts are held out."""
    splits = min(MAX_SPLITS, max(1, (PROGRAMS_PER_SM * sms) // max(1, batch_heads)))
    chunk = -(-length // splits)
    block_n = 32 if head_dim > 128 or chunk <= SMALL_CHUNK else 64
    chunk = max(block_n, -(-chunk // block_n) * block_n)
    if chunk == block_n == 32:  # one block a program: 2 warps and no pipeline are faster than 4 warps, 2 stages
        return DecodeAttentionConfig(chunk=chunk, block_n=block_n, num_warps=2, num_stages=1)
    if block_n == 32 and head_dim <= 128:
        return DecodeAttentionConfig(chunk=chunk, block_n=block_n, num_warps=2, num_stages=2)
    return DecodeAttentionConfig(chunk=chunk, block_n=block_n)


# ----------------------------------------------------------------------------------- validation
def _check_inputs(query, key, value, length, mask, scale):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, "a torch.Tensor", type(t).__name__)
        if t.dim() != 4:
            fail(ValueError, name, "4 dimensions", f"shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            fail(TypeError, name, "float16 or bfloat16", t.dtype)
        if t.stride(-1) != 1:
            fail(ValueError, name, "contiguous in its last dimension", f"strides {t.stride()}")
    device = query.device
    if not (device.type == "cuda" or (interpreting() and device.type == "cpu")):
        fail(ValueError, "query", "on a CUDA device (or the CPU under TRITON_INTERPRET=1)", device)
    B, H, G, D = query.shape
    if D < 16 or D > 256 or D & (D - 1):
        fail(ValueError, "query", "a head dim that is a power of two in [16, 256]", D)
    if not 1 <= G <= MAX_G:
        fail(ValueError, "query", f"1 <= G <= {MAX_G} rows per KV head (dim 2)", G)
    L = key.shape[2]
    if L < 1:
        fail(ValueError, "key", "at least one position (dim 2)", f"shape {tuple(key.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            fail(TypeError, name, f"query's dtype {query.dtype}", t.dtype)
        if t.device != device:
            fail(ValueError, name, f"on {device}", t.device)
        if tuple(t.shape) != (B, H, L, D):
            fail(ValueError, name, f"shape (B, Hkv, L, D) = ({B}, {H}, L, {D}) (query {tuple(query.shape)})",
                 tuple(t.shape))
    if tuple(value.shape) != tuple(key.shape):
        fail(ValueError, "value", f"key's shape {tuple(key.shape)}", tuple(value.shape))
    if length is not None:
        if not isinstance(length, torch.Tensor):
            fail(TypeError, "length", "an int32/int64 tensor or None", type(length).__name__)
        if length.dtype not in _INT_DTYPES:
            fail(TypeError, "length", "an int32 or int64 tensor", length.dtype)
        if length.dim() > 1 or length.numel() not in (1, B):
            fail(ValueError, "length", f"shape (), (1,) or (B,) = ({B},)", tuple(length.shape))
        if length.device != device:
            fail(ValueError, "length", f"on {device}", length.device)
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            fail(TypeError, "mask", "a tensor or None", type(mask).__name__)
        if mask.dtype not in _MASK_DTYPES:
            fail(TypeError, "mask", "bool, float16, bfloat16 or float32", mask.dtype)
        if mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1] != 1 or mask.shape[2] != 1 \
                or mask.shape[3] != L:
            fail(ValueError, "mask", f"shape (B or 1, 1, 1, L) = ({B}, 1, 1, {L})", tuple(mask.shape))
        if mask.device != device:
            fail(ValueError, "mask", f"on {device}", mask.device)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            fail(TypeError, "scale", "a finite float or None", repr(scale))


def _check_counters(counters, n: int, device) -> None:
    if counters is None:
        return
    if not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32:
        fail(TypeError, "counters", "an int32 tensor or None",
             counters.dtype if isinstance(counters, torch.Tensor) else type(counters).__name__)
    if counters.device != device or not counters.is_contiguous() or counters.numel() < n:
        fail(ValueError, "counters", f"a contiguous tensor of at least B * Hkv = {n} elements on {device}",
             f"{tuple(counters.shape)} on {counters.device}")


def _pick(config, B, H, L, D, device) -> DecodeAttentionConfig:
    if config is None:
        return attention_config(B * H, L, D, device_sms(device))
    if not isinstance(config, DecodeAttentionConfig):
        fail(TypeError, "config", "a DecodeAttentionConfig", type(config).__name__)
    return config


def supports(query, key, value, mask=None) -> bool:
    """Whether ``decode_attention(query, key, value, mask=mask)`` accepts these tensors (no exception)."""
    try:
        _check_inputs(query, key, value, None, mask, None)
    except (TypeError, ValueError):
        return False
    return True


# ------------------------------------------------------------------------------------------ op
@torch.library.custom_op("kbit::decode_attention", mutates_args=())
def _decode_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    length: torch.Tensor | None, mask: torch.Tensor | None, new_from: torch.Tensor | None,
    scale: float, chunk: int, block_n: int, num_warps: int, num_stages: int,
) -> torch.Tensor:
    return _launch(query, key, value, length, mask, new_from, None, scale, chunk, block_n, num_warps, num_stages)


# a second op: torch.compile cannot functionalize an optional mutated argument given as None
@torch.library.custom_op("kbit::decode_attention_counted", mutates_args=("counters",))
def _decode_attention_counted_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    length: torch.Tensor | None, mask: torch.Tensor | None, new_from: torch.Tensor | None,
    counters: torch.Tensor,
    scale: float, chunk: int, block_n: int, num_warps: int, num_stages: int,
) -> torch.Tensor:
    return _launch(query, key, value, length, mask, new_from, counters, scale, chunk, block_n, num_warps, num_stages)


def _launch(query, key, value, length, mask, new_from, counters, scale, chunk, block_n, num_warps, num_stages):
    B, H, G, D = query.shape
    L = key.shape[2]
    out_dtype = query.dtype
    if interpreting() and out_dtype == torch.bfloat16:  # the interpreter's bfloat16 arithmetic is wrong
        query, key, value = query.float(), key.float(), value.float()
    out = torch.empty(B, H, G, D, dtype=query.dtype, device=query.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
        elif interpreting() and mask.dtype == torch.bfloat16:
            mask = mask.float()
        stride_mb = mask.stride(0) if mask.shape[0] > 1 else 0
        stride_mn = mask.stride(3)
    else:
        stride_mb = stride_mn = 0
    S = -(-L // chunk)
    pdl = launch_kw(query.device)  # programmatic dependent launch on sm_90
    part_o, part_m, part_l = _partials(out, S)
    fold = S > 1 and counters is not None
    prefetch = new_from is not None and length is not None and mask is None
    G_PAD = _next_pow2(G)
    S_PAD = _next_pow2(S)
    _k.split_kernel[(B * H, S)](
        query, key, value, mask if mask is not None else out, length if length is not None else out,
        new_from if prefetch else out, counters if fold else out,
        out, part_o, part_m, part_l,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        stride_mb, stride_mn,
        out.stride(0), out.stride(1), out.stride(2),
        H, G, L, S, chunk, scale * 1.4426950408889634,
        BLOCK_N=block_n, BLOCK_G=max(16, _next_pow2(G)), D=D,
        HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.uint8,
        HAS_LENGTH=length is not None, LENGTH_PER_ROW=length is not None and length.numel() > 1,
        SPLIT=S > 1, PREFETCH=prefetch, FOLD=fold,
        G_PAD=G_PAD, S_PAD=S_PAD, SB=max(1, min(S_PAD, FOLD_TILE // (G_PAD * D))),
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    if S > 1 and not fold:
        _combine(out, part_o, part_m, part_l, S, pdl)
    return out.to(out_dtype)


def _partials(out, S):
    """The float32 partials (acc, running max, sum) of S > 1 splits of each KV head's rows; with one split the
    kernel writes ``out`` directly and these arguments are placeholders."""
    if S == 1:
        return out, out, out
    B, H, G, D = out.shape
    return (torch.empty(B * H, S, G, D, dtype=torch.float32, device=out.device),
            torch.empty(B * H, S, G, dtype=torch.float32, device=out.device),
            torch.empty(B * H, S, G, dtype=torch.float32, device=out.device))


def _combine(out, part_o, part_m, part_l, S, pdl):
    """The S partials merged into ``out`` by a second kernel (when no arrival counters fold them)."""
    B, H, G, D = out.shape
    _k.combine_kernel[(B * H * G,)](
        part_o, part_m, part_l, out, out.stride(0), out.stride(1), out.stride(2), H, G, S,
        D=D, S_PAD=_next_pow2(S), BLOCK_S=min(_next_pow2(S), COMBINE_BLOCK_S), num_warps=4 if D >= 128 else 2, **pdl,
    )


@_decode_attention_op.register_fake
def _(query, key, value, length, mask, new_from, scale, chunk, block_n, num_warps, num_stages):
    return query.new_empty(query.shape)


@_decode_attention_counted_op.register_fake
def _(query, key, value, length, mask, new_from, counters, scale, chunk, block_n, num_warps, num_stages):
    return query.new_empty(query.shape)


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    length: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    config: DecodeAttentionConfig | None = None,
    new_from: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Attention of one decode step, grouped-query heads as rows: ``softmax(q k^T * scale + mask) v``.

    Parameters
    ----------
    query : torch.Tensor, shape (B, Hkv, G, D), float16 / bfloat16
        The G = Hq / Hkv query heads of each KV head as rows (query head ``kv * G + g``, the order of
        transformers' ``repeat_kv``: ``q.reshape(B, Hkv, G, D)`` of a ``[B, Hq, 1, D]`` query).
    key, value : torch.Tensor, shape (B, Hkv, L, D), query's dtype and device
        The whole cache (e.g. a static cache of ``L = Lmax`` positions); only valid keys are read.
    length : int32 / int64 tensor of shape (), (1,) or (B,), optional
        Keys ``[0, length)`` (of each row, for shape (B,)) are valid. A device tensor: the value may
        change between CUDA-graph replays. Values above L count as L.
    mask : tensor of shape (B or 1, 1, 1, L), optional
        Additive float mask (float16 / bfloat16 / float32, as SDPA's ``attn_mask``): added to the scaled
        scores; a value ``<= -65504`` (any dtype's minimum, ``-inf``, NaN) excludes the key, which is then
        not read. A bool mask keeps the keys where it is true. Given with ``length``, both apply.
        Without either, all L keys are valid.
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    config : DecodeAttentionConfig, optional
        Launch choices; default ``attention_config(B * Hkv, L, D, <SMs of the device>)``.
    new_from : int32 / int64 tensor of length's shape, optional
        With ``length`` and no mask: the first key written in this step (e.g. the decode position). Keys before
        it, and ``length`` itself, must have been written before the kernels of the current programmatic
        dependent-launch chain (earlier steps, or any ordinary kernel since); the kernel then loads them before
        its PDL wait, while the kernels before it still run. Same result either way.
    counters : int32 tensor of at least B * Hkv zeros, optional
        The caller's workspace (left all zero after each call): with it, the split program that finishes last
        merges the partials (one launch instead of two). Calls that may run at the same time (other streams)
        must not share it.

    Returns
    -------
    torch.Tensor, shape (B, Hkv, G, D), query's dtype (contiguous)
        Rows with no valid key are zeros (SDPA would give NaN or a uniform average).

    Notes
    -----
    Grid ``(B * Hkv, ceil(L / chunk))`` fixed by L, so the call is capturable in a CUDA graph while the
    valid length changes between replays; a second small kernel merges the splits when there are more
    than one. Scores, softmax and accumulation are float32; the probabilities are rounded to the input
    dtype for the ``P @ V`` product (as flash attention does). No host synchronisation.

    Examples
    --------
    >>> q = torch.randn(1, 8, 4, 128, device="cuda", dtype=torch.bfloat16)
    >>> k = torch.randn(1, 8, 544, 128, device="cuda", dtype=torch.bfloat16)
    >>> n = torch.tensor([529], device="cuda")
    >>> decode_attention(q, k, k, length=n).shape
    torch.Size([1, 8, 4, 128])
    """
    _check_inputs(query, key, value, length, mask, scale)
    B, H, G, D = query.shape
    L = key.shape[2]
    config = _pick(config, B, H, L, D, query.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if new_from is not None:
        if not isinstance(new_from, torch.Tensor) or new_from.dtype not in _INT_DTYPES:
            fail(TypeError, "new_from", "an int32/int64 tensor or None",
                 new_from.dtype if isinstance(new_from, torch.Tensor) else type(new_from).__name__)
        if length is None or new_from.shape != length.shape or new_from.device != query.device:
            fail(ValueError, "new_from", f"to come with length and have its shape and device "
                 f"({None if length is None else tuple(length.shape)}, {query.device})",
                 f"{tuple(new_from.shape)} on {new_from.device}")
    _check_counters(counters, B * H, query.device)
    cfg = (scale, config.chunk, config.block_n, config.num_warps, config.num_stages)
    if counters is None:
        return torch.ops.kbit.decode_attention(query, key, value, length, mask, new_from, *cfg)
    return torch.ops.kbit.decode_attention_counted(query, key, value, length, mask, new_from, counters, *cfg)


# ----------------------------------------------------------------- fused: rotary + KV append + attention
def _check_rope_inputs(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, eps, scale):
    check_rope_append(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, _DTYPES)
    B, H, _, D = k_cache.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype != q.dtype:
            fail(TypeError, name, f"q's dtype {q.dtype}", c.dtype)
    if D < 16 or D > 256:
        fail(ValueError, "k_cache", "a head dim (dim 3) in [16, 256]", D)
    if q.shape[1] % (H * D) or not 1 <= q.shape[1] // (H * D) <= MAX_G:
        fail(ValueError, "q", f"Hq * D columns, Hq = G * Hkv with 1 <= G <= {MAX_G} (Hkv = {H}, D = {D})",
             f"shape {tuple(q.shape)}")
    _check_inputs(q.view(B, H, -1, D), k_cache, v_cache, None, None, scale)  # device, scale
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        fail(ValueError, "eps", "a float > 0", repr(eps))


@torch.library.custom_op("kbit::rope_decode_attention", mutates_args=("k_cache", "v_cache"))
def _rope_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
    eps: float, scale: float, chunk: int, block_n: int, num_warps: int, num_stages: int,
) -> torch.Tensor:
    return _launch_rope(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, None, eps, scale, chunk, block_n,
                        num_warps, num_stages)


@torch.library.custom_op("kbit::rope_decode_attention_counted", mutates_args=("k_cache", "v_cache", "counters"))
def _rope_attention_counted_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
    counters: torch.Tensor, eps: float, scale: float, chunk: int, block_n: int, num_warps: int, num_stages: int,
) -> torch.Tensor:
    return _launch_rope(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, counters, eps, scale, chunk,
                        block_n, num_warps, num_stages)


def _launch_rope(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, counters, eps, scale, chunk, block_n,
                 num_warps, num_stages):
    B, H, L, D = k_cache.shape
    G = q.shape[1] // (H * D)
    out_dtype = q.dtype
    kc, vc = k_cache, v_cache
    if interpreting() and out_dtype == torch.bfloat16:  # the interpreter's bfloat16 arithmetic is wrong
        q, k, v, cos, sin = (t.float() for t in (q, k, v, cos, sin))
        q_norm, k_norm = (None if t is None else t.float() for t in (q_norm, k_norm))
        kc, vc = k_cache.float(), v_cache.float()
    out = torch.empty(B, H, G, D, dtype=q.dtype, device=q.device)
    S = -(-L // chunk)
    pdl = launch_kw(q.device)  # programmatic dependent launch on sm_90
    part_o, part_m, part_l = _partials(out, S)
    fold = S > 1 and counters is not None
    G_PAD, S_PAD = _next_pow2(G), _next_pow2(S)
    _k.rope_split_kernel[(B * H, S)](
        q, k, v, cos, sin, pos, cos if q_norm is None else q_norm, cos if k_norm is None else k_norm, kc, vc,
        counters if fold else out, out, part_o, part_m, part_l,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        H, G, L, S, chunk, scale * 1.4426950408889634, eps,
        BLOCK_N=block_n, BLOCK_G=max(16, G_PAD), D=D, QK_NORM=q_norm is not None, SPLIT=S > 1, FOLD=fold,
        G_PAD=G_PAD, S_PAD=S_PAD, SB=max(1, min(S_PAD, FOLD_TILE // (G_PAD * D))),
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    if S > 1 and not fold:
        _combine(out, part_o, part_m, part_l, S, pdl)
    if kc is not k_cache:
        k_cache.copy_(kc)
        v_cache.copy_(vc)
    return out.to(out_dtype)


@_rope_attention_op.register_fake
def _(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, eps, scale, chunk, block_n, num_warps, num_stages):
    B, H, _, D = k_cache.shape
    return q.new_empty(B, H, q.shape[1] // (H * D), D)


@_rope_attention_counted_op.register_fake
def _(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, counters, eps, scale, chunk, block_n, num_warps,
      num_stages):
    B, H, _, D = k_cache.shape
    return q.new_empty(B, H, q.shape[1] // (H * D), D)


def rope_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None, eps: float = 1e-6, *, scale: float | None = None,
    config: DecodeAttentionConfig | None = None, counters: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""One decode step's attention from the raw q/k/v projections: :func:`kbit.ops.glue.rope_append` (optional
    per-head RMSNorm, rotary embedding, k and v appended to the caches at ``pos``) and :func:`decode_attention` over
    the keys ``[0, pos]``, in one launch.

    Parameters
    ----------
    q : torch.Tensor, shape (B, Hq * D), float16 / bfloat16
        The step's raw queries (before norm and rotary); query head ``kv * G + g`` attends to KV head ``kv``
        (G = Hq / Hkv). A column slice of a fused q/k/v output is fine (rows contiguous in their last dim).
    k, v : torch.Tensor, shape (B, Hkv * D), q's dtype and device
        The step's raw key (before norm and rotary) and value.
    cos, sin : torch.Tensor, shape (positions, D), same row stride
        Rotary tables indexed by position (any float dtype; rows at ``pos`` are read).
    pos : int32 / int64 tensor of one element, on the device
        The step's position, the same for every row: keys ``[0, pos)`` of the caches are the earlier steps', and
        must have been written before the kernels of the current programmatic dependent-launch chain (earlier
        steps, or any ordinary kernel since; they are loaded before the PDL wait). ``pos < L`` (not checked: a
        device value); the value may change between CUDA-graph replays.
    k_cache, v_cache : torch.Tensor, shape (B, Hkv, L, D), q's dtype
        The static caches; position ``pos`` is written (the step's key after norm and rotary, its value).
    q_norm, k_norm : torch.Tensor, shape (D,), optional
        Qwen3's per-head RMSNorm weights (both or neither), with ``eps``.
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    config : DecodeAttentionConfig, optional
        Launch choices; default ``attention_config(B * Hkv, L, D, <SMs of the device>)`` (as decode_attention).
    counters : int32 tensor of at least B * Hkv zeros, optional
        As in :func:`decode_attention`: the split program that finishes last merges the partials.

    Returns
    -------
    torch.Tensor, shape (B, Hkv, G, D), q's dtype (contiguous)

    Notes
    -----
    The program whose split chunk holds ``pos`` computes the new key with rope_append's kernel arithmetic (the
    cache entries it writes are rope_append's, up to the summation order of the q/k norm's sum of squares), writes
    k and v, and folds the new key into its softmax from registers; the q heads are rotated by every program of
    their KV head. Same grid and config as :func:`decode_attention`, capturable in a CUDA graph, no host sync.
    One new token per row, at one position for all rows: the form of rope_append and of the fast decode step
    (``kbit.hf.fast_decode``); other steps keep rope_append and decode_attention (``new_from``, per-row lengths).

    Examples
    --------
    >>> qkv = torch.randn(1, (32 + 2 * 8) * 128, device="cuda", dtype=torch.bfloat16)
    >>> q, k, v = qkv[:, :4096], qkv[:, 4096:5120], qkv[:, 5120:]
    >>> kc = torch.zeros(1, 8, 544, 128, device="cuda", dtype=torch.bfloat16)
    >>> vc = torch.zeros_like(kc)
    >>> t = torch.arange(544, device="cuda")[:, None] * 1e-2 * torch.ones(128, device="cuda")
    >>> pos = torch.tensor([528], device="cuda")
    >>> rope_decode_attention(q, k, v, t.cos(), t.sin(), pos, kc, vc).shape
    torch.Size([1, 8, 4, 128])
    """
    _check_rope_inputs(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, eps, scale)
    B, H, L, D = k_cache.shape
    config = _pick(config, B, H, L, D, q.device)
    _check_counters(counters, B * H, q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    args = (q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm)
    cfg = (float(eps), scale, config.chunk, config.block_n, config.num_warps, config.num_stages)
    if counters is None:
        return torch.ops.kbit.rope_decode_attention(*args, *cfg)
    return torch.ops.kbit.rope_decode_attention_counted(*args, counters, *cfg)


# ------------------------------------------------------------------------------------ reference
def decode_attention_reference(query, key, value, *, length=None, mask=None, scale=None, out_dtype=None):
    """``decode_attention``'s semantics in float64 torch (same arguments); returns ``out_dtype``
    (default query's dtype). Invalid keys are never touched (NaN there does not leak)."""
    B, H, G, D = query.shape
    L = key.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q, k, v = query.double(), key.double(), value.double()
    valid = torch.ones(B, 1, 1, L, dtype=torch.bool, device=query.device)
    bias = torch.zeros(B, 1, 1, L, dtype=torch.float64, device=query.device)
    if length is not None:
        valid = valid & (torch.arange(L, device=query.device).view(1, 1, 1, L) < length.reshape(-1, 1, 1, 1))
    if mask is not None:
        if mask.dtype == torch.bool:
            valid = valid & mask
        else:
            m = mask.double()
            valid = valid & (m > MASKED)
            bias = torch.where(valid, m, 0.0)
    k = torch.where(valid.transpose(-1, -2), k, 0.0)
    v = torch.where(valid.transpose(-1, -2), v, 0.0)
    s = (q @ k.transpose(-1, -2)) * scale + bias
    s = s.masked_fill(~valid, -math.inf)
    mx = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(mx), mx, 0.0))
    den = p.sum(-1, keepdim=True)
    out = (p @ v) / torch.where(den > 0, den, 1.0)
    return out.to(query.dtype if out_dtype is None else out_dtype)


def rope_decode_attention_reference(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm=None, k_norm=None, eps=1e-6, *,
                                    scale=None, out_dtype=None):
    """``rope_decode_attention``'s semantics in torch (same arguments): ``rope_append_reference`` (writes the
    caches), then ``decode_attention_reference`` (float64) over the keys ``[0, pos]``; returns ``out_dtype``
    (default q's dtype), shape (B, Hkv, G, D)."""
    B, H, _, D = k_cache.shape
    qr = rope_append_reference(q, k, v, cos, sin, pos, k_cache, v_cache, q_norm, k_norm, eps)
    length = pos.reshape(-1)[:1] + 1
    return decode_attention_reference(qr.reshape(B, H, -1, D), k_cache, v_cache, length=length, scale=scale,
                                      out_dtype=q.dtype if out_dtype is None else out_dtype)

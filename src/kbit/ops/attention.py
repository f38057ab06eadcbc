"""Split-KV decode attention: one query token per sequence against a (static) KV cache, no host sync.

``decode_attention`` is the op (validate -> allocate -> pick config -> launch, registered as
``kbit::decode_attention``); ``decode_attention_reference`` is its float64 plain-torch specification.
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
from kbit.ops.pdl import launch_kw
from kbit.utils.checks import fail
from kbit.utils.device import interpreting, sm_count

__all__ = [
    "DecodeAttentionConfig",
    "attention_config",
    "decode_attention",
    "decode_attention_reference",
    "folds",
    "supports",
]

_DTYPES = (torch.float16, torch.bfloat16)
_MASK_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
MASKED = -65504.0  # additive mask values <= this exclude the key (see kbit.kernels.attention.MASKED)
MAX_G = 64  # query rows per KV head in one tile (padded to a power of two >= 16)
PROGRAMS_PER_SM = 4  # split target: B * Hkv * splits ~ this many programs per SM (2-4 do well)
#: splits a KV head at most: past this many the merge costs more than the extra programs save (H100, the decode step
#: at context 4096 with 4 and 8 KV heads, when the last split merged: 129 -> 33 splits saved 24 us a layer, 65 -> 33
#: saved 7; docs/notes/2026-11-26-attention-splits.md). Again with the one-round second launch at context 16384,
#: batch 1: 65 and 129 splits from -2.9 to +3.8 us a layer (benchmarks/results/h100/combine-next-2026-11-28/)
MAX_SPLITS = 33
#: chunks up to this many keys run in blocks of 32 keys with 2 warps (2 stages past one block), which the same
#: measurements preferred to 64-key blocks with 4 warps
SMALL_CHUNK = 128
DEFAULT_SMS = 132  # H100 SXM; used when the device is not a GPU (interpreter) or does not say
#: elements of one [BLOCK_S, D] step of the second launch's merge: 64 partials at D = 128, so the default split
#: counts (at most MAX_SPLITS) merge in one round of loads. Loading every partial at once rather than 16 at a time,
#: each step's values behind a load of its maxima, saved 2.4-3.2 us a layer at context 4096 and 0.2-1.2 at 512 (H100,
#: batch 1, Llama-3-8B and Qwen2.5-7B shapes, a lab kernel; benchmarks/results/h100/attn-next-2026-11-28/); as
#: shipped, 0.4-0.8 in the whole step of four models at context 512 (benchmarks/results/h100/combine-next-2026-11-28/)
COMBINE_TILE = 8192
FOLD_TILE = 8192  # elements of one [SB, G, D] step of the folded merge (SB partials loaded together)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fold_steps(S: int, G: int, D: int) -> tuple[int, int]:
    """``(SB, steps)`` of the folded merge of ``S`` partials of ``[G, D]``: SB partials loaded together a step."""
    SB = max(1, min(_next_pow2(S), FOLD_TILE // (_next_pow2(G) * D)))
    return SB, -(-S // SB)


def folds(S: int, G: int, D: int) -> bool:
    """Whether the split program that finishes last merges the ``S`` partials itself (given ``counters``), rather
    than a second launch: only where its merge is one step of ``SB`` partials (:func:`fold_steps`). Each further
    step is one more round of loads from L2, one after another, in one program of 2-4 warps; the second launch
    merges a query row a program. H100, the decode step (first 8 layers) of Llama-3-8B, Qwen2.5-7B and Qwen3-30B-A3B
    shapes at batch 1, 4, 16 and context 512, 4096: where the merge took 2-5 steps, a second launch saved 1.5-7.1
    us a layer; where it took one, the fold saved 0.2-2.8 us at context 512, and at batch 16, context 4096 the
    second launch still saved 0.5-4.7 (``lab/attn_chain_sweep.py --fold-ab``,
    ``benchmarks/results/h100/attn-fold-rule-2026-11-28/``). Against the one-round second launch (batch 4 and 16,
    ``benchmarks/results/h100/combine-next-2026-11-28/``) the same: the fold 0.6-3.3 us faster at context 512,
    0.2-5.6 slower at batch 16, context 4096."""
    return S > 1 and fold_steps(S, G, D)[1] == 1


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
    if S > 1:
        part_o = torch.empty(B * H, S, G, D, dtype=torch.float32, device=query.device)
        part_m = torch.empty(B * H, S, G, dtype=torch.float32, device=query.device)
        part_l = torch.empty(B * H, S, G, dtype=torch.float32, device=query.device)
    else:
        part_o = part_m = part_l = out
    fold = counters is not None and folds(S, G, D)
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
        G_PAD=G_PAD, S_PAD=S_PAD, SB=fold_steps(S, G, D)[0],
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    if S > 1 and not fold:
        block_s = max(1, min(S_PAD, COMBINE_TILE // D))
        _k.combine_kernel[(B * H * G,)](
            part_o, part_m, part_l, out, out.stride(0), out.stride(1), out.stride(2), H, G, S,
            D=D, BLOCK_S=block_s, ONE_STEP=S <= block_s, num_warps=4 if D >= 128 else 2, **pdl,
        )
    return out.to(out_dtype)


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
        merges the partials (one launch instead of two) where that merge is one step (:func:`folds`). Calls that
        may run at the same time (other streams) must not share it.

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
    if config is None:
        config = attention_config(B * H, L, D, device_sms(query.device))
    elif not isinstance(config, DecodeAttentionConfig):
        fail(TypeError, "config", "a DecodeAttentionConfig", type(config).__name__)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if new_from is not None:
        if not isinstance(new_from, torch.Tensor) or new_from.dtype not in _INT_DTYPES:
            fail(TypeError, "new_from", "an int32/int64 tensor or None",
                 new_from.dtype if isinstance(new_from, torch.Tensor) else type(new_from).__name__)
        if length is None or new_from.shape != length.shape or new_from.device != query.device:
            fail(ValueError, "new_from", f"to come with length and have its shape and device "
                 f"({None if length is None else tuple(length.shape)}, {query.device})",
                 f"{tuple(new_from.shape)} on {new_from.device}")
    if counters is not None:
        if not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32:
            fail(TypeError, "counters", "an int32 tensor or None",
                 counters.dtype if isinstance(counters, torch.Tensor) else type(counters).__name__)
        if counters.device != query.device or not counters.is_contiguous() or counters.numel() < B * H:
            fail(ValueError, "counters", f"a contiguous tensor of at least B * Hkv = {B * H} elements on "
                 f"{query.device}", f"{tuple(counters.shape)} on {counters.device}")
    cfg = (scale, config.chunk, config.block_n, config.num_warps, config.num_stages)
    if counters is None:
        return torch.ops.kbit.decode_attention(query, key, value, length, mask, new_from, *cfg)
    return torch.ops.kbit.decode_attention_counted(query, key, value, length, mask, new_from, counters, *cfg)


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

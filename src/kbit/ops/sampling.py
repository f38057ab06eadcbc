"""Fused token sampling: penalties, temperature, top-k, top-p and min-p in two passes, no sort.

``sample`` is the op (validate -> allocate -> pick config -> launch, registered as ``kbit::sample``);
``filtered_probs_reference`` and ``sample_reference`` are its sort-based plain-torch specification.
Kernels: ``kbit.kernels.sampling`` (pass 2, penalties) and ``kbit.kernels.sampling_chunks`` (pass 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kbit.kernels import sampling as _k
from kbit.kernels.sampling_chunks import chunk_summary_kernel
from kbit.kernels.sampling_common import row_max_kernel
from kbit.ops._ids import ERR_LOGITS, debug_mode, error_flag
from kbit.utils.checks import fail
from kbit.utils.device import interpreting

__all__ = [
    "SamplingConfig",
    "sampling_config",
    "sample",
    "filtered_probs_reference",
    "sample_reference",
    "apply_penalties_reference",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
_SEARCH_ITERS = 24  # pass-1 bisection steps before a chunk settles for fewer entries than it wanted
_ROW_BLOCK = 1024  # tile of the whole-row fallback passes
_ROW_MAX_TILE = 2048  # row-max launch: entries a program reads at a time (8 warps: 16 bytes a thread in bf16)
_ROW_MAX_PROGRAMS = 2048  # programs the row-max launch aims at over all rows (a few waves of an H100/H200)
_ROW_MAX_SPLIT = 128  # at most this many programs a row (a power of two)
_STREAM_VECTORS = 1024  # candidate vectors pass 2 expands at a time (4096 entries) when packing
_PIVOTS = 16  # pivots per fallback pass: 32-bit keys are resolved in 8 passes
_FAST_ENTRIES = 128  # pass-2 fast path: entries >= the top-k lower bound (~k expected), ranked all-pairs
_PASS1_MAXNREG = 64  # pass-1 register cap: the common path needs ~72, its general branch (a call) ~150
_PASS1_CAP_BATCH = 16  # cap only from this batch size: below it the grid fits the GPU uncapped anyway


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# --------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class SamplingConfig:
    """Launch choices of ``sample``; ``sampling_config`` gives the default, tests may pin one.

    Attributes
    ----------
    chunk : int
        Vocabulary entries read by one program of pass 1 (power of two).
    candidates : int
        Candidate slots kept per chunk (power of two, at most ``chunk``), each a 16-byte vector of
        4 entries holding one >= the chunk's bound. A chunk with more takes pass 1's slower general
        branch; rows whose support is wider than the candidates take the whole-row fallback.
    warps_chunk : int
        ``num_warps`` of pass 1.
    warps_select : int
        ``num_warps`` of pass 2 (one program per row).
    select_slots : int
        Entries pass 2 keeps, per row, of the candidates above the certificate (power of two);
        a row with more takes the whole-row fallback.
    """

    chunk: int
    candidates: int
    warps_chunk: int = 1
    warps_select: int = 8
    select_slots: int = 2048

    def __post_init__(self):
        for name in ("chunk", "candidates", "select_slots"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                fail(ValueError, f"SamplingConfig.{name}", "a power of two", value)
        if self.chunk < 16:
            fail(ValueError, "SamplingConfig.chunk", ">= 16", self.chunk)
        if not 2 <= self.candidates <= self.chunk:
            fail(ValueError, "SamplingConfig.candidates", f"in [2, chunk = {self.chunk}]", self.candidates)


def sampling_config(batch: int, vocab: int) -> SamplingConfig:
    """Launch config: 4096-entry pass-1 chunks of 4 warps and 16 warps
    in pass 2 at every batch size. Pass 2's fast path works on all ~S * 32 candidate slots and the
    2S chunk values at once, so fewer, larger chunks keep its tiles small (2048-entry chunks double them
    and spill); pass 1 keeps ``{x >= min of the tile-row maxima}`` per chunk either way.
    """
    chunk = min(4096, max(16, _next_pow2(vocab)))
    candidates = max(2, chunk // 2) if vocab <= chunk else 32  # one chunk: keep up to half of it
    return SamplingConfig(chunk, candidates, warps_chunk=max(1, min(4, chunk // 1024)), warps_select=16)


def _row_max_split(B: int, V: int) -> tuple[int, int, int]:
    """(programs a row, entries a program, tile) of the row-max launch: enough programs that the B rows fill the
    GPU (about ``_ROW_MAX_PROGRAMS``; at B = 1 one tile a program, so one load's latency), at least one tile
    each, at most ``_ROW_MAX_SPLIT`` a row (a power of two: the passes combine the partial maxima in one load)."""
    block = min(_ROW_MAX_TILE, _next_pow2(V))
    nsplit = min(_ROW_MAX_SPLIT, _next_pow2(-(-V // block)), _next_pow2(-(-_ROW_MAX_PROGRAMS // B)))
    per = -(-V // nsplit)  # entries a program, rounded up to whole tiles
    span = -(-per // block) * block
    return nsplit, span, block


def _tile(chunk: int, warps: int) -> tuple[int, int]:
    """Pass-1 tile [G, T] of a chunk: T = 128 * warps columns (one 16-byte load per thread and
    row), G = chunk / T rows; the candidate bound is the min of the G row maxima."""
    cols = min(128 * warps, chunk)
    return chunk // cols, cols


# ----------------------------------------------------------------------------------- validation
def _check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        fail(TypeError, "logits", "a torch.Tensor", type(logits).__name__)
    if logits.dim() != 2:
        fail(ValueError, "logits", "shape (B, V)", f"shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        fail(TypeError, "logits", "float16, bfloat16 or float32", logits.dtype)
    if logits.shape[1] < 1:
        fail(ValueError, "logits", "V >= 1 columns", f"shape {tuple(logits.shape)}")
    if not (logits.is_cuda or (interpreting() and logits.device.type == "cpu")):
        fail(ValueError, "logits", "on a CUDA device (or the CPU under TRITON_INTERPRET=1)", logits.device)


def _row_param(name, value, batch, device, integer, ok, expected):
    """Validate a per-request parameter; returns (tensor or None, python scalar)."""
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) != (batch,):
            fail(ValueError, name, f"shape (B,) = ({batch},)", tuple(value.shape))
        if value.device != device:
            fail(ValueError, name, f"on {device}", value.device)
        if integer and value.dtype not in _INT_DTYPES:
            fail(TypeError, name, "an int32 or int64 tensor", value.dtype)
        if not integer and not value.is_floating_point():
            fail(TypeError, name, "a floating-point tensor", value.dtype)
        if value.device.type == "cpu":  # reading CUDA values would synchronise
            bad = ~ok(value)
            if bool(bad.any()):
                got = value[bad][0].item()
                fail(ValueError, name, expected, f"{got} at index {int(bad.nonzero()[0])}")
        if not integer and value.dtype != torch.float32:
            value = value.float()
        return value.contiguous(), 0 if integer else 0.0
    if integer:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(TypeError, name, "an int or an integer tensor of shape (B,)", repr(value))
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(TypeError, name, "a float or a float tensor of shape (B,)", repr(value))
    if not ok(value):
        fail(ValueError, name, expected, value)
    return None, int(value) if integer else float(value)


def _rng_param(name, value, batch, device):
    if value is None:
        return None, 0
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INT_DTYPES:
            fail(TypeError, name, "an int32 or int64 tensor", value.dtype)
        if value.numel() not in (1, batch) or value.dim() > 1:
            fail(ValueError, name, f"shape (), (1,) or (B,) = ({batch},)", tuple(value.shape))
        if value.device != device:
            fail(ValueError, name, f"on {device}", value.device)
        return value.reshape(-1).contiguous(), 0
    if isinstance(value, bool) or not isinstance(value, int):
        fail(TypeError, name, "an int or an integer tensor", repr(value))
    if not 0 <= value < 2**63:
        fail(ValueError, name, "in [0, 2**63)", value)
    return None, value


def _finite(t):
    """Works on python numbers (no tensor, so torch.compile sees no data-dependent branch) and tensors."""
    return abs(t) < math.inf


# ------------------------------------------------------------------------------------------ op
def _penalised_copy(logits, history, rep_t, rep, pres_t, pres, freq_t, freq):
    x = logits.to(torch.float32, copy=True)
    history = torch.sort(history, dim=1).values
    B, L = history.shape
    if L == 0:
        return x
    block = min(256, _next_pow2(L))
    grid = (B, -(-L // block))
    _k.apply_penalties_kernel[grid](
        x, x.stride(0), x.shape[1], history, history.stride(0), L, max(1, L).bit_length(),
        rep_t if rep_t is not None else x, rep, pres_t if pres_t is not None else x, pres,
        freq_t if freq_t is not None else x, freq,
        REP_PER_ROW=rep_t is not None, PRES_PER_ROW=pres_t is not None, FREQ_PER_ROW=freq_t is not None,
        BLOCK_L=block, num_warps=4,
    )
    return x


@torch.library.custom_op("kbit::sample", mutates_args=())
def _sample_op(
    logits: torch.Tensor,
    temperature_t: torch.Tensor | None, temperature: float,
    top_k_t: torch.Tensor | None, top_k: int,
    top_p_t: torch.Tensor | None, top_p: float,
    min_p_t: torch.Tensor | None, min_p: float,
    rep_t: torch.Tensor | None, rep: float,
    pres_t: torch.Tensor | None, pres: float,
    freq_t: torch.Tensor | None, freq: float,
    token_history: torch.Tensor | None,
    seed_t: torch.Tensor | None, seed: int,
    offset_t: torch.Tensor | None, offset: int,
    chunk: int, candidates: int, warps_chunk: int, warps_select: int, select_slots: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, V = logits.shape
    device = logits.device
    tokens = torch.empty(B, dtype=torch.int64, device=device)
    logprobs = torch.empty(B, dtype=torch.float32, device=device)
    if B == 0:
        return tokens, logprobs
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    if interpreting() and x.dtype == torch.bfloat16:
        x = x.float()  # the interpreter's bfloat16 arithmetic is wrong
    penalised = token_history is not None and (
        rep_t is not None or pres_t is not None or freq_t is not None
        or rep != 1.0 or pres != 0.0 or freq != 0.0
    )
    if penalised:
        x = _penalised_copy(x, token_history, rep_t, rep, pres_t, pres, freq_t, freq)

    nsplit, span, block = _row_max_split(B, V)
    shift = torch.empty(B, nsplit, dtype=torch.float32, device=device)  # partial row maxima: x - max is read
    row_max_kernel[(B, nsplit)](x, x.stride(0), V, shift, span, NSPLIT=nsplit, BLOCK=block,
                                num_warps=max(1, min(8, block // 256)))
    S = -(-V // chunk)
    KC = candidates
    cand_idx = torch.empty(B, S * KC, dtype=torch.int32, device=device)
    cand_val = torch.empty(B, S * KC, dtype=torch.float32, device=device)
    stats = torch.empty(6, B, S, dtype=torch.float32, device=device)
    dummy = logprobs

    def ptr(t):
        return dummy if t is None else t

    G, T = _tile(chunk, warps_chunk)
    cap = {"maxnreg": _PASS1_MAXNREG} if B >= _PASS1_CAP_BATCH else {}
    chunk_summary_kernel[(B, S)](
        x, x.stride(0), V, shift, ptr(temperature_t), temperature, ptr(top_k_t), top_k,
        cand_idx, cand_val, stats, B, S,
        TEMP_PER_ROW=temperature_t is not None, TOPK_PER_ROW=top_k_t is not None,
        CHUNK=chunk, KC=KC, G=G, T=T, MAX_ITERS=_SEARCH_ITERS, NSPLIT=nsplit, num_warps=warps_chunk, **cap,
    )
    NVP = _next_pow2(S * KC)
    P = select_slots
    if 4 * NVP > P:
        scr_val = torch.empty(B, P, dtype=torch.float32, device=device)
        scr_idx = torch.empty(B, P, dtype=torch.int32, device=device)
    else:
        scr_val, scr_idx = dummy, cand_idx
    PE = _FAST_ENTRIES
    fscr = torch.empty(B, PE, dtype=torch.int64, device=device)
    _k.select_sample_kernel[(B,)](
        x, x.stride(0), V, shift, error_flag(device), cand_idx, cand_val, stats, B, S, scr_val, scr_idx, fscr,
        ptr(temperature_t), temperature, ptr(top_k_t), top_k, ptr(top_p_t), top_p,
        ptr(min_p_t), min_p, ptr(seed_t), seed, ptr(offset_t), offset,
        tokens, logprobs,
        TEMP_PER_ROW=temperature_t is not None, TOPK_PER_ROW=top_k_t is not None,
        TOPP_PER_ROW=top_p_t is not None, MINP_PER_ROW=min_p_t is not None,
        SEED_MODE=0 if seed_t is None else (2 if seed_t.numel() == B and B > 1 else 1),
        OFFSET_MODE=0 if offset_t is None else (2 if offset_t.numel() == B and B > 1 else 1),
        CHUNK=chunk, KC=KC, SP=_next_pow2(S), NVP=NVP, P=P, VB=min(NVP, _STREAM_VECTORS),
        BLOCK=min(_ROW_BLOCK, _next_pow2(V)), NPIV=_PIVOTS, PE=PE, EVEN4=V % 4 == 0, FUSED=not interpreting(),
        NSPLIT=nsplit, num_warps=warps_select,
    )
    return tokens, logprobs


@_sample_op.register_fake
def _(logits, *args):
    B = logits.shape[0]
    return logits.new_empty(B, dtype=torch.int64), logits.new_empty(B, dtype=torch.float32)


def sample(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
    repetition_penalty: float | torch.Tensor = 1.0,
    presence_penalty: float | torch.Tensor = 0.0,
    frequency_penalty: float | torch.Tensor = 0.0,
    token_history: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    seed: int | torch.Tensor | None = None,
    offset: int | torch.Tensor | None = None,
    return_logprobs: bool = False,
    config: SamplingConfig | None = None,
):
    r"""Sample one token per row from filtered, tempered logits, without sorting the vocabulary.

    For row ``b`` with raw logits ``x`` (upcast to float32) the filtered distribution is, in order:

    1. **Penalties** on the raw logits, for each token ``v`` that occurs ``c_v > 0`` times among the
       valid ids (``0 <= id < V``) of ``token_history[b]``: ``x_v <- x_v / r`` if ``x_v > 0`` else
       ``x_v * r`` (``r = repetition_penalty``), then ``x_v <- x_v - presence - frequency * c_v``.
    2. **Temperature**: ``z = x * (1 / T)`` (the float32 reciprocal); ``T == 0`` makes the row greedy:
       the lowest index holding ``max(x)`` is returned and no filter or random number is used.
    3. **top-k** (``k > 0``): keep ``z_i >= t_k``, ``t_k`` the k-th largest of ``z`` counting
       duplicates. *Ties at the boundary are all kept*, so more than k tokens survive when the k-th
       value repeats (as in Hugging Face's ``TopKLogitsWarper``).
    4. **top-p** on ``p = softmax(z)`` restricted to the top-k set: keep token ``i`` iff the mass of
       the kept tokens with ``z_j > z_i`` is ``< top_p``; equivalently keep ``z_i >= t_p``, the
       largest value whose upper set holds at least ``top_p`` of the mass. Tied tokens are all kept.
    5. **min-p**: keep ``p_i >= min_p * max(p)``, i.e. ``z_i >= max(z) + log(min_p)``.

    The support is ``{i : z_i >= max(t_k, t_p, t_min)}`` and the token is drawn with probability
    ``exp(z_i) / sum over the support``.

    **Edge cases** (the kernel and :func:`sample_reference` agree): the logits are shifted by their row
    max first, ``z = (x - max x) / T`` with the max landing on 0 exactly (the same distribution, without
    overflow), so

    - NaN logits count as ``-inf``;
    - ``+inf`` logits: the support is the ``+inf`` entries, drawn uniformly (the limit of the softmax);
      the logprob is ``-log(count of them)``, greedy takes the lowest such index;
    - tiny temperatures (down to subnormal ``T``, ``1 / T`` capped at the largest float32) and huge
      logits (``+-3e38``) cannot overflow: ``T = 1e-38`` returns the argmax (ties drawn uniformly);
      equal maxima are tied entries, drawn uniformly among them (greedy: the lowest index);
    - a row without a finite or ``+inf`` logit (all NaN / ``-inf``, also after penalties) returns token
      ``-1`` and logprob NaN, and sets bit 8 of the device's error flag (``kbit.ops._ids``:
      ``check_errors()`` raises; no sync here). In ``kbit.ops._ids.debug_ids`` mode ``ValueError``
      at once.

    Parameters
    ----------
    logits : torch.Tensor, shape (B, V), float16 / bfloat16 / float32, CUDA
        (CPU under ``TRITON_INTERPRET=1``).
    temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty :
        float or float tensor of shape (B,). Scalars must satisfy ``temperature >= 0``,
        ``0 < top_p <= 1``, ``0 <= min_p <= 1``, ``repetition_penalty > 0``; values of CUDA tensors
        are not checked (that would synchronise): ``T <= 0`` is greedy, ``top_p >= 1`` and
        ``min_p <= 0`` switch the filter off.
    top_k : int or int32/int64 tensor of shape (B,)
        ``0`` (or ``>= V``) switches top-k off; negative tensor values count as ``0``.
    token_history : int32/int64 tensor of shape (B, L), optional
        Previous tokens of each row, padded with ``-1``; needed only by the penalties.
    generator : torch.Generator, optional
        Used only when ``seed`` is None: one int64 seed is drawn from it on the device.
    seed, offset : int or int64 tensor of shape (), (1,) or (B,), optional
        Philox key and counter. Row ``b`` draws its uniform from counter ``(b, offset)`` under key
        ``seed``: the same seed and offset give the same tokens. Device tensors keep a CUDA graph
        replayable with fresh randomness (advance ``offset`` between replays).
    return_logprobs : bool
        Also return the log-probability of each chosen token under its filtered distribution
        (``0`` for greedy rows).
    config : SamplingConfig, optional
        Launch choices; default ``sampling_config(B, V)``.

    Returns
    -------
    tokens : torch.Tensor, shape (B,), int64 (``-1`` for a row without a finite or ``+inf`` logit)
    logprobs : torch.Tensor, shape (B,), float32
        Only when ``return_logprobs``.

    Notes
    -----
    A row-max launch (the shift: one more read of the logits, split over up to 128 programs a row, whose partial
    maxima each later program combines in one small load), then two kernels: pass 1 summarises
    vocabulary chunks into candidate lists, pass 2 finds the thresholds on the candidates and draws one
    Philox uniform per row (inverse CDF). Rows whose support is wider than the candidates (e.g. top-p
    alone over a flat distribution, or thousands of tied logits) take a slower whole-row search in pass 2. Penalties
    add a float32 copy of the logits. No host synchronisation; capturable in a CUDA graph.

    Examples
    --------
    >>> logits = torch.randn(4, 151936, device="cuda")
    >>> seed = torch.tensor([1234], device="cuda")
    >>> offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    >>> tokens = sample(logits, temperature=0.7, top_k=50, top_p=0.9, seed=seed, offset=offset)
    >>> tokens.shape, tokens.dtype
    (torch.Size([4]), torch.int64)
    """
    _check_logits(logits)
    B, V = logits.shape
    dev = logits.device
    temp = _row_param("temperature", temperature, B, dev, False, lambda t: (t >= 0) & _finite(t),
                      "a finite value >= 0")
    tk = _row_param("top_k", top_k, B, dev, True, lambda t: t >= 0, ">= 0")
    tp = _row_param("top_p", top_p, B, dev, False, lambda t: (t > 0) & (t <= 1), "in (0, 1]")
    mp = _row_param("min_p", min_p, B, dev, False, lambda t: (t >= 0) & (t <= 1), "in [0, 1]")
    rp = _row_param("repetition_penalty", repetition_penalty, B, dev, False,
                    lambda t: (t > 0) & _finite(t), "a finite value > 0")
    pp = _row_param("presence_penalty", presence_penalty, B, dev, False, _finite, "finite")
    fp = _row_param("frequency_penalty", frequency_penalty, B, dev, False, _finite, "finite")
    if token_history is not None:
        if not isinstance(token_history, torch.Tensor) or token_history.dtype not in _INT_DTYPES:
            got = token_history.dtype if isinstance(token_history, torch.Tensor) else type(token_history)
            fail(TypeError, "token_history", "an int32 or int64 tensor", got)
        if token_history.dim() != 2 or token_history.shape[0] != B:
            fail(ValueError, "token_history", f"shape (B, L) with B = {B}", tuple(token_history.shape))
        if token_history.device != dev:
            fail(ValueError, "token_history", f"on {dev}", token_history.device)
    if generator is not None and not isinstance(generator, torch.Generator):
        fail(TypeError, "generator", "a torch.Generator", type(generator).__name__)
    seed_t, seed_v = _rng_param("seed", seed, B, dev)
    offset_t, offset_v = _rng_param("offset", offset, B, dev)
    if seed is None:
        seed_t = torch.randint(0, 2**62, (1,), device=dev, dtype=torch.int64, generator=generator)
    if config is None:
        config = sampling_config(B, V)
    elif not isinstance(config, SamplingConfig):
        fail(TypeError, "config", "a SamplingConfig", type(config).__name__)
    tokens, logprobs = torch.ops.kbit.sample(
        logits, *temp, *tk, *tp, *mp, *rp, *pp, *fp, token_history,
        seed_t, seed_v, offset_t, offset_v,
        config.chunk, config.candidates, config.warps_chunk, config.warps_select, config.select_slots,
    )
    if debug_mode():  # kbit.ops._ids.debug_ids: a sync, raise at once
        _raise_empty_rows(tokens)
    return (tokens, logprobs) if return_logprobs else tokens


def _raise_empty_rows(tokens: torch.Tensor) -> None:
    empty = (tokens < 0).nonzero().flatten().tolist()
    if empty:
        error_flag(tokens.device).bitwise_and_(~ERR_LOGITS)
        fail(ValueError, "logits", "a finite or +inf logit in every row (after penalties)",
             f"none in row(s) {empty[:8]}")


# ------------------------------------------------------------------------------------ reference
def _as_rows(value, batch, device, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.full((batch,), value, device=device, dtype=dtype)


def apply_penalties_reference(x, token_history, repetition_penalty=1.0, presence_penalty=0.0,
                              frequency_penalty=0.0):
    """Penalised float32 logits (step 1 of ``sample``), by counting with ``scatter_add``."""
    x = x.float()
    if token_history is None:
        return x
    B, V = x.shape
    hist = token_history.long()
    valid = (hist >= 0) & (hist < V)
    counts = torch.zeros(B, V + 1, device=x.device, dtype=torch.float32)
    counts.scatter_add_(1, torch.where(valid, hist, V), valid.float())
    counts = counts[:, :V]
    seen = counts > 0
    rep = _as_rows(repetition_penalty, B, x.device, torch.float32)[:, None]
    pres = _as_rows(presence_penalty, B, x.device, torch.float32)[:, None]
    freq = _as_rows(frequency_penalty, B, x.device, torch.float32)[:, None]
    penalised = torch.where(x > 0, x / rep, x * rep) - pres - freq * counts
    return torch.where(seen, penalised, x)


def filtered_probs_reference(
    logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
    presence_penalty=0.0, frequency_penalty=0.0, token_history=None, dtype=torch.float64,
):
    """The exact distribution ``sample`` draws from, by sorting the whole vocabulary.

    Same arguments and semantics as ``sample``. Returns a tensor of shape (B, V) and ``dtype``
    whose rows sum to one (one-hot at the first arg-max for greedy rows).
    """
    B, V = logits.shape
    dev = logits.device
    x = apply_penalties_reference(logits, token_history, repetition_penalty, presence_penalty,
                                  frequency_penalty)
    temp = _as_rows(temperature, B, dev, torch.float32)
    greedy = temp <= 0
    inv = torch.reciprocal(torch.where(greedy, 1.0, temp)).clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where(greedy, 1.0, inv)
    x = torch.where(torch.isnan(x), -math.inf, x)
    shift = x.amax(1, keepdim=True) if V else x.new_zeros(B, 1)  # the row max lands on 0 exactly
    empty = shift[:, 0] == -math.inf  # no finite or +inf logit
    x = torch.where((x == shift) & ~empty[:, None], 0.0, x - shift)
    z = x * scale[:, None] + 0.0
    z = torch.where(z > -math.inf, z, -math.inf)  # NaN -> -inf
    fin = z > -math.inf
    n_fin = fin.sum(1)
    M = z.max(1, keepdim=True).values
    zs = torch.sort(z, dim=1, descending=True).values
    ws = torch.exp((zs - M).to(dtype))

    k = _as_rows(top_k, B, dev, torch.int64)
    topk_on = (k > 0) & (k < n_fin)
    t_k = torch.where(topk_on, zs.gather(1, (k - 1).clamp(0, V - 1)[:, None])[:, 0], -math.inf)
    in_k = (zs >= t_k[:, None]) & (zs > -math.inf)
    wk = torch.where(in_k, ws, 0)
    W_k = wk.sum(1)
    # mass at or above each sorted value: the cumulative sum at the last member of its tie group
    neg = (-zs).contiguous()
    last = torch.searchsorted(neg, neg, right=True) - 1
    mass_ge = torch.cumsum(wk, 1).gather(1, last)
    p = _as_rows(top_p, B, dev, torch.float32)
    good = in_k & (mass_ge >= p.to(dtype)[:, None] * W_k[:, None])
    first = torch.argmax(good.to(torch.int8), dim=1)
    t_p = torch.where((p < 1) & good.any(1), zs.gather(1, first[:, None])[:, 0], -math.inf)
    mp = _as_rows(min_p, B, dev, torch.float32)
    t_min = torch.where(mp > 0, M[:, 0] + torch.log(mp), -math.inf)
    t = torch.maximum(torch.maximum(t_k, t_p), t_min)

    keep = fin & (z >= t[:, None])
    w = torch.where(keep, torch.exp((z - M).to(dtype)), 0)
    probs = w / w.sum(1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter_(1, x.argmax(1, keepdim=True), 1.0)
    return torch.where(empty[:, None], 0.0, torch.where(greedy[:, None], onehot, probs))


def sample_reference(
    logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
    presence_penalty=0.0, frequency_penalty=0.0, token_history=None, generator=None,
    return_logprobs=False,
):
    """Sort-based torch sampler with ``sample``'s semantics (float32 probabilities, exponential race); a row
    without a finite or +inf logit gives token -1 and logprob NaN (it raises nothing)."""
    probs = filtered_probs_reference(logits, temperature, top_k, top_p, min_p, repetition_penalty,
                                     presence_penalty, frequency_penalty, token_history,
                                     dtype=torch.float32)
    q = torch.empty_like(probs).exponential_(generator=generator)
    empty = probs.sum(1) == 0
    tokens = torch.where(empty, -1, (probs / q).argmax(1))
    if not return_logprobs:
        return tokens
    lp = torch.log(probs.gather(1, tokens.clamp(min=0)[:, None])[:, 0])
    return tokens, torch.where(empty, math.nan, lp)

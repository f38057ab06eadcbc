"""Static-cache decoding of a Hugging Face causal LM, with the decode step captured in a CUDA graph.

:class:`StaticDecoder` owns a transformers ``StaticCache`` of fixed ``[batch, heads, max_len, head_dim]`` tensors
and a handful of device tensors (the current token ids, the position, the sampler's seed and offset). The
prefill runs eagerly; every decode step runs the model on one token per row, picks the next token (argmax or
:func:`kbit.sample`) and writes it back into the input-ids tensor, advancing position and offset in place.
On CUDA that step is captured once in a CUDA graph and replayed, so a step costs one graph launch instead of
one launch per op (several hundred for an 8B model). On the CPU the same step runs eagerly.

The model's own forward is used (any kbit modules inside: ``KbitLinear``, ``KbitMoE``); only the attention mask
and the position ids are made here (a 4-D additive mask over the whole static cache, built on the device from
the position tensor, once per step), so the step depends on no transformers mask or position logic that reads
the host. The attention of a one-token step is transformers' SDPA with the query heads of each KV group as
the query rows (``[B, Hkv, G, D]`` against the cache's ``[B, Hkv, L, D]``; on CUDA the split-KV kernel of
:mod:`kbit.ops.attention`, ``StaticDecoder(decode_attention="sdpa")`` for SDPA): transformers' own SDPA path
repeats the whole static cache G times whenever a mask is given (``repeat_kv``: at batch 64 and 600
positions, ~20 GB of copies a step on Llama-3-8B). The prefill uses transformers' SDPA as is.

Graph capture needs a sync-free forward: ``KbitExperts`` on CUDA runs the grouped kernels over the routed pairs
(no host sync); :class:`kbit.nn.KbitMoE` also routes on the device and reads the experts in the tensor-core layout
(:func:`use_kbit_moe` swaps it in where it reproduces the block, sharing the weights).

    dec = StaticDecoder(model, batch_size=1, max_len=prompt_len + 64)
    token = dec.prefill(input_ids)          # [B] first new token
    for _ in range(63):
        token = dec.step()                  # [B] (a view of the decoder's buffer: clone to keep it)
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import sys
import traceback
import types
import warnings

import torch
from torch import nn

from kbit.hf.experts import KbitExperts
from kbit.hf.fast_decode import FastDecodeStep, attention_windows, text_config, unsupported_reason
from kbit.nn import KbitMoE
from kbit.nn.moe import check_activation, hf_block_mismatch, hf_routing
from kbit.ops import attention as _attn
from kbit.ops.glue import argmax
from kbit.ops.sampling import sample, sample_reference
from kbit.utils.checks import check_choice

__all__ = ["DECODE_ATTENTION", "STATIC_ATTENTION", "StaticDecoder", "static_attention", "use_kbit_moe"]

#: the name under which :func:`static_attention` (``kernel="auto"``) is registered in transformers'
#: ``AttentionInterface``
STATIC_ATTENTION = "kbit_static"
#: choices of ``StaticDecoder(decode_attention=...)`` / ``static_attention(kernel=...)`` for one-token steps
DECODE_ATTENTION = ("auto", "kbit", "sdpa")
#: the registered name of each choice (no "sdpa" in a name: transformers reads that word in implementation names)
_ATTENTION_NAMES = {"auto": STATIC_ATTENTION, "kbit": f"{STATIC_ATTENTION}_kbit", "sdpa": f"{STATIC_ATTENTION}_torch"}
_PAD = 16  # the cache length is rounded up to this (aligned mask rows for the SDPA kernels)


def graph_blocker(model) -> str | None:
    """The first module of ``model`` whose forward syncs with the host every step, so that no CUDA graph can hold
    it (``"name (type)"``), else None: MoE experts that loop over the experts a step routes to (transformers'
    per-expert lists, and its fused modules under the ``"eager"`` experts implementation). ``KbitMoE`` and
    ``KbitExperts`` (on CUDA in fp16 / bf16, as the decode step runs) route on the device."""
    for name, m in model.named_modules():
        if isinstance(m, (KbitMoE, KbitExperts)):
            continue
        fused = isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and m.gate_up_proj.dim() == 3
        eager = getattr(getattr(m, "config", None), "_experts_implementation", "eager") in (None, "eager")
        if isinstance(getattr(m, "experts", None), nn.ModuleList) or (fused and eager):
            return f"{name} ({type(m).__name__})"
    return None


def _host_sync_site(fn) -> str | None:
    """Run ``fn()`` with PyTorch's CUDA sync debug mode set to raise; the file and line (outside torch) of the
    first operation that synchronised with the host, else None."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        torch_dir = os.path.dirname(torch.__file__) + os.sep
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(torch_dir)]
        where = frames[-1] if frames else None
        return "an operation" if where is None else f"{os.path.basename(where.filename)}:{where.lineno}, " \
            f"{(where.line or '').strip()[:60]!r}"
    finally:
        torch.cuda.set_sync_debug_mode(before)
    return None


def static_unsupported(model) -> str | None:
    """Why :class:`StaticDecoder` cannot decode ``model`` (its layer types, :func:`attention_windows`), else None."""
    try:
        attention_windows(model)
    except ValueError as e:
        return str(e)
    return None


def _static_cache(model, max_len: int):
    """transformers' ``StaticCache`` with every layer a full-length ``StaticLayer``: key j is position j in every
    layer, and the masks apply the sliding windows (:func:`attention_windows`), where transformers' sliding
    layers would keep a rolling window of their own."""
    from transformers import StaticCache  # transformers is optional (kbit[hf]): imported when a decoder is made

    config = copy.copy(text_config(model))
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * len(config.layer_types)
    if getattr(config, "sliding_window", None):
        config.sliding_window = None
    return StaticCache(config=config, max_cache_len=max_len)


def static_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, *,
                     kernel: str = "auto", **kwargs):
    """Attention for the static cache: ``query [B, Hq, q, D]``, ``key [B, Hkv, L, D]`` and ``value
    [B, Hkv, L, Dv]`` (the whole cache; Dv < D in multi-head latent attention), ``attention_mask`` additive
    ``[B, 1, q, L]``. A one-token step runs one SDPA on ``[B, Hkv, G, D]`` queries (the G = Hq / Hkv heads
    sharing a KV head as rows: no copy of the cache); longer ones (prefill)
    go to transformers' ``sdpa`` forward. On CUDA the one-token step is :func:`kbit.ops.attention.decode_attention`
    (split over the cache length, the same additive mask; keys past the position are not read) unless
    the tensors are outside its support (fp32, odd head dims, other mask shapes). ``kernel`` (one of
    :data:`DECODE_ATTENTION`): ``auto`` runs that kernel when batch x KV heads <= DECODE_KERNEL_MAX_HEADS, else
    SDPA; ``kbit`` the kernel always; ``sdpa`` SDPA always. Returns ``([B, q, Hq, Dv], None)`` as transformers'
    functions do. A call with an argument of :data:`OWN_ATTENTION_ARGS` runs the model's own eager attention."""
    own = [k for k in OWN_ATTENTION_ARGS if kwargs.get(k) is not None]
    if own:  # an attention this function does not compute: the model's own
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise NotImplementedError(f"{type(module).__name__}: attention with {own} and no eager_attention_forward "
                                      f"in {type(module).__module__}")
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    B, Hq, q, D = query.shape
    Hkv = key.shape[1]
    if q != 1 or Hq % Hkv or dropout:
        # transformers is optional (kbit[hf]); a prefill only runs inside a transformers model anyway
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    Dv = value.shape[-1]  # multi-head latent attention (DeepSeek-V2/V3): values narrower than queries and keys
    qg = query.reshape(B, Hkv, Hq // Hkv, D)  # head h = kv * G + g, the order of transformers' repeat_kv
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]
    choice = kernel if query.is_cuda else "sdpa"
    if choice == "kbit" or (choice == "auto" and B * Hkv <= DECODE_KERNEL_MAX_HEADS):
        if _attn.supports(qg, key, value, mask):
            out = _attn.decode_attention(qg, key, value, mask=mask, scale=scaling)
            return out.reshape(B, 1, Hq, Dv), None
    out = torch.nn.functional.scaled_dot_product_attention(qg, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, 1, Hq, Dv), None


#: attention arguments :func:`static_attention` does not implement (gpt-oss's sinks, Gemma-2's logit soft-capping):
#: a call that carries one runs the ``eager_attention_forward`` of the attention module's own modeling file
OWN_ATTENTION_ARGS = ("s_aux", "sinks", "softcap", "logit_softcapping")

#: ``auto`` runs the decode kernel up to this many (batch row, KV head) pairs: on the H100 (mask path) it beats
#: SDPA up to 64 pairs and loses at 128 pairs from 2048 keys on.
DECODE_KERNEL_MAX_HEADS = 64


def attention_name(kernel: str) -> str:
    """The ``AttentionInterface`` name of :func:`static_attention` with ``kernel`` (one of DECODE_ATTENTION)."""
    check_choice("decode_attention", kernel, DECODE_ATTENTION)
    return _ATTENTION_NAMES[kernel]


def _register() -> None:
    # transformers is optional (kbit[hf]): imported when a decoder is made
    from transformers import AttentionInterface

    for kernel in DECODE_ATTENTION:
        AttentionInterface.register(attention_name(kernel), functools.partial(static_attention, kernel=kernel))


class _AttnImpl:
    """Set ``_attn_implementation`` of every config in the model for the duration of a forward."""

    def __init__(self, model: nn.Module, name: str):
        seen, self.configs = set(), []
        for m in model.modules():
            c = getattr(m, "config", None)
            if c is not None and id(c) not in seen and hasattr(c, "_attn_implementation_internal"):
                seen.add(id(c))
                self.configs.append(c)
        self.name = name

    def __enter__(self):
        self.saved = [c._attn_implementation_internal for c in self.configs]
        for c in self.configs:
            c._attn_implementation_internal = self.name

    def __exit__(self, *exc):
        for c, v in zip(self.configs, self.saved, strict=True):
            c._attn_implementation_internal = v


class StaticDecoder:
    """Prefill + fixed-shape decode steps of ``model`` for ``batch_size`` sequences of up to ``max_len`` tokens.

    Parameters
    ----------
    model : a transformers causal LM (Llama, Qwen2/3, Mistral, Qwen3-MoE, ...), float or kbit-quantized.
    batch_size : rows decoded together (every row has the same prompt length).
    max_len : prompt + new tokens; the static cache holds this many positions (rounded up to a multiple of 16).
    graph : capture the decode step in a CUDA graph (default: when the model is on CUDA and has no module whose
        forward waits on the host, :func:`graph_blocker`). False runs it eagerly.
    temperature, top_k, top_p : the sampler (:func:`kbit.sample` on CUDA, :func:`kbit.sample_reference` on the
        CPU); ``temperature == 0`` is greedy (argmax).
    seed : the sampler's Philox key; the offset starts at 0 for the token after the prompt and advances by one
        per step, as :func:`kbit.hf.generate.generate_tokens` draws them.
    fast : decode steps through :class:`kbit.hf.fast_decode.FastDecodeStep` (kbit's fused glue kernels around
        the model's own projections) instead of transformers' forward. ``None`` (default): on CUDA when the model
        is supported; ``True`` requires it (ValueError naming why not); ``False``: transformers' forward.
        The prefill always runs transformers' forward.
    decode_attention : the attention of one-token steps through transformers' forward (see
        :func:`static_attention`): ``"auto"`` (default), ``"kbit"`` (the split-KV kernel) or ``"sdpa"``.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, *, graph: bool | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 fast: bool | None = None, decode_attention: str = "auto"):
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if not (isinstance(max_len, int) and max_len >= 2):
            raise ValueError(f"max_len: expected an int >= 2, got {max_len!r}")
        if temperature < 0:
            raise ValueError(f"temperature: expected >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k: expected >= 0 (0: off), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p: expected in (0, 1] (1: off), got {top_p}")
        param = next(iter(model.parameters()), None)
        buf = next(iter(model.buffers()), None)
        self.device = (param if param is not None else buf).device
        blocker = graph_blocker(model)
        self._graph_asked = graph is not None and bool(graph)
        if graph is None:
            graph = self.device.type == "cuda" and blocker is None
        if graph and self.device.type != "cuda":
            raise ValueError(f"graph: CUDA graphs need the model on a CUDA device, got {self.device}")
        if graph and blocker is not None:
            raise ValueError(f"graph: a CUDA graph cannot hold {blocker} (its forward waits on the host for the "
                             "experts each step routes to); kbit.hf.use_kbit_moe swaps such blocks for KbitMoE "
                             "where it reproduces them")
        attn_name = attention_name(decode_attention)
        attn = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        if attn not in ("sdpa", "eager") and not attn.startswith(STATIC_ATTENTION):
            raise ValueError(f"model.config._attn_implementation: expected 'sdpa' or 'eager' (the decoder brings "
                             f"its own attention and mask), got {attn!r}")
        _register()
        self._attn = _AttnImpl(model, attn_name)
        max_len = -(-max_len // _PAD) * _PAD
        self.model, self.B, self.L, self.graph = model, batch_size, max_len, bool(graph)
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self._dtype = getattr(model, "dtype", torch.float32)
        dev = self.device
        self._windows = attention_windows(model)
        # transformers 5 renamed the forward's past_key_values to cache (the old name warns, and goes in 5.40)
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.cache = _static_cache(model, max_len)
        self._fast_write = False  # decode steps: write K/V at `pos` in 2 launches (see _patch_cache)
        self._patch_cache()
        self.ids = torch.zeros(batch_size, 1, dtype=torch.long, device=dev)  # the token fed to the next step
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # its position
        self.seed = torch.full((1,), int(seed), dtype=torch.long, device=dev)
        self.offset = torch.zeros(1, dtype=torch.long, device=dev)
        self._arange = torch.arange(max_len, device=dev)
        self._gen = torch.Generator(device="cpu").manual_seed(int(seed))  # CPU sampling only
        self.logits: torch.Tensor | None = None  # float32 [B, V] of the last step (a static buffer under graphs)
        self.length = 0  # tokens in the cache (host copy)
        self._cuda_graph: torch.cuda.CUDAGraph | None = None
        self._out: torch.Tensor | None = None
        self._fast = self._fast_step(model, fast)

    def _fast_step(self, model, fast):
        if fast is None:
            fast = self.device.type == "cuda" and unsupported_reason(model, self.L) is None
        return FastDecodeStep(model, self.cache, self.L) if fast else None

    # -- pieces ---------------------------------------------------------------------------------------------
    def _patch_cache(self) -> None:
        """A decode step writes its K/V at ``pos`` with two ``index_copy_`` (transformers' static layer spends
        five launches: ``arange``, add, the length counter, two copies). Only for plain ``StaticLayer``s
        (:func:`_static_cache` makes every layer one); the prefill keeps transformers' update (it allocates the
        tensors)."""
        if not all(type(layer).__name__ == "StaticLayer" for layer in self.cache.layers):
            return
        dec = self

        def update(layer, key_states, value_states, *args, **kwargs):
            if dec._fast_write and getattr(layer, "is_initialized", False) and key_states.shape[-2] == 1:
                layer.keys.index_copy_(2, dec.pos, key_states)
                layer.values.index_copy_(2, dec.pos, value_states)
                return layer.keys, layer.values
            return type(layer).update(layer, key_states, value_states, *args, **kwargs)

        for layer in self.cache.layers:
            layer.update = types.MethodType(update, layer)

    def _mask(self, q_pos: torch.Tensor):
        """Additive ``[B, 1, q, L]`` in the model's dtype: 0 where key j is visible from query position p
        (j <= p, and p - window < j in a sliding-window layer), the dtype's minimum elsewhere (positions past the
        prompt + steps so far: stale or empty). One per layer type where the model has several
        (:func:`attention_windows`)."""
        if isinstance(self._windows, dict):
            return {t: self._mask_of(q_pos, w) for t, w in self._windows.items()}
        return self._mask_of(q_pos, self._windows)

    def _mask_of(self, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
        j, p = self._arange.view(1, -1), q_pos.view(-1, 1)
        allowed = j <= p  # [q, L]
        if window is not None:
            allowed = allowed & (j > p - window)
        zero = torch.zeros((), dtype=self._dtype, device=self.device)
        mask = torch.where(allowed, zero, torch.finfo(self._dtype).min)
        return mask.view(1, 1, *allowed.shape).expand(self.B, 1, -1, -1)

    def _forward(self, ids: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        with self._attn:
            out = self.model(input_ids=ids, attention_mask=self._mask(q_pos),
                             position_ids=q_pos.view(1, -1).expand(self.B, -1), **{self._cache_arg: self.cache},
                             use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0.0:
            if logits.is_cuda:
                return argmax(logits)
            return logits.argmax(dim=-1)
        if logits.is_cuda:
            return sample(logits, self.temperature, self.top_k, self.top_p, seed=self.seed, offset=self.offset)
        return sample_reference(logits, self.temperature, self.top_k, self.top_p, generator=self._gen)

    def _step_body(self) -> torch.Tensor:
        """One decode step on the device tensors only (what the graph captures)."""
        if self._fast is not None:
            logits = self._fast(self.ids, self.pos)
        else:
            self._fast_write = True
            try:
                logits = self._forward(self.ids, self.pos)
            finally:
                self._fast_write = False
        token = self._pick(logits)
        self.ids.copy_(token.view(-1, 1))
        self.pos.add_(1)
        self.offset.add_(1)
        self._logits_buf = logits
        return self.ids.view(-1)

    def _set_length(self, n: int) -> None:
        """Make the cache hold ``n`` tokens (the static layers count their own length on the device)."""
        for layer in self.cache.layers:
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                length.fill_(n)
            elif length is not None:
                layer.cumulative_length = n
        self.pos.fill_(n)
        self.length = n

    # -- public ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``input_ids [B, T]`` (eagerly), return the first new token ``[B]`` (and ``self.logits``).

        May be called again to start over with a new prompt (the graph, if captured, stays valid)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != self.B:
            raise ValueError(f"input_ids: expected shape [{self.B}, T], got {tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        if not 1 <= T < self.L:
            raise ValueError(f"input_ids: expected 1 <= T < max_len = {self.L} tokens, got T = {T}")
        self._set_length(0)
        self.offset.zero_()
        ids = input_ids.to(self.device)
        logits = self._forward(ids, self._arange[:T])
        self._set_length(T)
        token = self._pick(logits)
        self.offset.add_(1)
        self.ids.copy_(token.view(-1, 1))
        self.logits = logits
        return self.ids.view(-1)

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Feed the last token, return the next one ``[B]`` (a view of a buffer the next step overwrites)."""
        if self.length == 0:
            raise RuntimeError("StaticDecoder.step: call prefill first")
        if self.length >= self.L:
            raise RuntimeError(f"StaticDecoder.step: the cache is full (max_len = {self.L})")
        if self.graph and self._cuda_graph is None:
            self.capture()  # a step that waits on the host turns a default graph off (capture's docstring)
        if not self.graph:
            out = self._step_body()
            self.logits = self._logits_buf
        else:
            self._cuda_graph.replay()
            out = self._out
            self.logits = self._logits_buf
        self.length += 1
        return out

    @torch.no_grad()
    def capture(self, warmup: int = 2) -> None:
        """Capture the decode step in a CUDA graph (after a prefill). Warm-up steps run first on a side
        stream (Triton compiles, lookup tables get cached); the cache length is restored afterwards.

        The last warm-up step runs with PyTorch's sync debug mode set to raise: a step that waits on the host
        (a module's ``.item()``, a branch on a device tensor, a copy from pageable host memory: PhiMoE's rotary
        embedding does the last two every call) cannot be captured. Then a graph the caller asked for raises
        ``ValueError`` naming the line; a default one is turned off with a warning, and steps run eagerly."""
        if not self.graph:
            raise RuntimeError("StaticDecoder.capture: graph=False")
        if self.length == 0:
            raise RuntimeError("StaticDecoder.capture: call prefill first (the cache is allocated by it)")
        n, ids, offset = self.length, self.ids.clone(), self.offset.clone()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                for _ in range(max(1, warmup) - 1):  # these may sync once (first-call set-up); the last may not
                    self._step_body()
                site = _host_sync_site(self._step_body)
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._restore(n, ids, offset)
        if site is not None:
            why = f"the decode step waits on the host ({site}), which a CUDA graph cannot hold"
            if self._graph_asked:
                raise ValueError(f"graph: {why}; pass graph=None or False to decode without one")
            warnings.warn(f"kbit: decoding without a CUDA graph: {why}", UserWarning, stacklevel=3)
            self.graph = False
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = self._step_body()
        self._cuda_graph = graph
        self._restore(n, ids, offset)

    def _restore(self, n: int, ids: torch.Tensor, offset: torch.Tensor) -> None:
        self._set_length(n)
        self.ids.copy_(ids)
        self.offset.copy_(offset)

    def rewind(self, n: int) -> None:
        """Set the cache back to ``n`` tokens (positions >= n are overwritten by later steps); the next step
        feeds the current ``ids`` at position ``n`` (benchmarks replay the same positions with this)."""
        if not 1 <= n < self.L:
            raise ValueError(f"n: expected 1 <= n < {self.L}, got {n}")
        self._set_length(n)

    def release(self) -> None:
        """Drop the graph and the cache tensors."""
        self._cuda_graph = None
        self._out = None
        self.cache = None
        self.logits = self._logits_buf = None


# ------------------------------------------------------------------------------------------------ MoE blocks


def _sparse_blocks(model: nn.Module):
    for name, module in model.named_modules():
        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if gate is not None and experts is not None and isinstance(getattr(gate, "weight", None), torch.Tensor):
            yield name, module


def use_kbit_moe(model: nn.Module, k: int | None = None, **quantize_kw) -> int:
    """Replace the sparse MoE blocks of ``model`` by :class:`kbit.nn.KbitMoE` (sync-free, graph-capturable), in
    place; returns how many were replaced.

    Blocks whose experts are :class:`kbit.hf.experts.KbitExperts` (a ``kbit.quantize_model`` result or a loaded
    checkpoint) are rebuilt around the same k-bit tensors (no re-quantization; ``k`` must be None). Blocks with
    float experts are quantized with ``KbitMoE.from_hf(block, k=k, **quantize_kw)`` (``k`` required).

    The router options come from the block (:func:`kbit.nn.moe.hf_routing`: softmax, or DeepSeek-V3-style sigmoid
    with a correction bias, groups and scaling; shared experts). Before a block is replaced, the new module must
    give the block's output on a few random tokens (:func:`kbit.nn.moe.hf_block_mismatch`, with the block's router
    logits);
    a block it does not reproduce (a router or an activation ``KbitMoE`` does not have) is kept as it is, with a
    warning naming it and why: transformers' block over ``KbitExperts`` computes the same k-bit experts.
    """
    done, kept = 0, []
    for name, block in list(_sparse_blocks(model)):
        if isinstance(block, KbitMoE):
            continue
        experts = block.experts
        quantized = isinstance(experts, KbitExperts)
        if quantized and k is not None:
            raise ValueError(f"k: expected None for already-quantized experts ({name}), got {k}")
        if not quantized and k is None:
            raise ValueError(f"k: expected the bits to quantize the float experts of {name}, got None")
        try:
            if quantized:
                routing = hf_routing(block)
                if experts.gate_fn is not None or experts.down_bias is not None:
                    raise ValueError("experts with their own gate or biases: the grouped kernels have neither")
                check_activation(experts.act_fn)
                new = KbitMoE.from_weights(experts.weight("gate_up_proj"), experts.weight("down_proj"),
                                           dtype=experts.dtype, **routing)
            else:
                new = KbitMoE.from_hf(block, k=k, **quantize_kw)
        except (ValueError, NotImplementedError) as e:
            kept.append(f"{name} ({type(block).__name__}: {e})")
            continue
        # float experts: from_hf compared the routing (the outputs differ by the rounding)
        why = hf_block_mismatch(block, new) if quantized else None
        if why is not None:
            kept.append(f"{name} ({type(block).__name__}: {why})")
            continue
        model.set_submodule(name, new)
        done += 1
    if kept:
        more = f" and {len(kept) - 1} more" if len(kept) > 1 else ""
        warnings.warn(f"kbit: MoE block kept as transformers runs it (KbitMoE does not reproduce it): "
                      f"{kept[0]}{more}", UserWarning, stacklevel=2)
    return done


# ------------------------------------------------------------------------------------------------ glue fusion

#: RMSNorm classes whose forward is ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm",
             "MixtralRMSNorm")
_COMPILED: dict = {}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _compiled(fn):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, fullgraph=True)
    return _COMPILED[fn]


def _norm_forward(self, hidden_states):
    return _compiled(_rms_norm)(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    return self.down_proj(_compiled(_silu_mul)(self.gate_proj(x), self.up_proj(x)))


def compile_glue(model: nn.Module) -> list[str]:
    """Fuse the element-wise glue of a Llama/Qwen/Mistral-style decoder with ``torch.compile``, in place: every
    RMSNorm (about 7 kernels -> 1), the rotary embedding of q and k (``apply_rotary_pos_emb`` of the modeling
    module, about 10 kernels -> 1-2) and SiLU(gate) * up of dense MLPs (2 -> 1). The matmuls (bf16, KbitLinear,
    KbitMoE) and the attention are not touched, so bf16 and kbit models get the same fusion. The same math as
    transformers' code (Inductor may keep the float32 value where that code rounds to bf16 in between).
    Returns the names of what was patched. Compilation happens at the first call of each shape: run a step
    before capturing a CUDA graph (:meth:`StaticDecoder.capture` does).
    """
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    done, rotary_modules = [], set()
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls in RMS_NORMS and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_norm_forward, m)
            done.append(name)
        elif cls.endswith("MLP") and all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")) \
                and type(m.act_fn).__name__ in ("SiLU", "SiLUActivation"):
            m.forward = types.MethodType(_mlp_forward, m)
            done.append(name)
        elif cls.endswith("Attention"):
            rotary_modules.add(type(m).__module__)
    for modname in sorted(rotary_modules):
        mod = sys.modules.get(modname)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None or getattr(fn, "_kbit_compiled", False):
            continue
        compiled = torch.compile(fn, fullgraph=True)
        compiled._kbit_compiled = True
        compiled._kbit_original = fn
        mod.apply_rotary_pos_emb = compiled
        done.append(f"{modname}.apply_rotary_pos_emb")
    return done


def uncompile_glue(model: nn.Module) -> None:
    """Undo :func:`compile_glue` (instance forwards removed, the modeling modules' rotary function restored)."""
    for m in model.modules():
        if "forward" in m.__dict__ and getattr(m.forward, "__func__", None) in (_norm_forward, _mlp_forward):
            del m.forward
        if type(m).__name__.endswith("Attention"):
            mod = sys.modules.get(type(m).__module__)
            fn = getattr(mod, "apply_rotary_pos_emb", None)
            if getattr(fn, "_kbit_compiled", False):
                mod.apply_rotary_pos_emb = fn._kbit_original

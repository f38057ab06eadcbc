"""Static-cache decoding of a Hugging Face causal LM, with the decode step captured in a CUDA graph.

:class:`StaticDecoder` owns a transformers ``StaticCache`` of fixed ``[batch, heads, max_len, head_dim]`` tensors
and a handful of device tensors (the current token ids, the position, the sampler's seed and offset). The
prefill runs eagerly; every decode step runs the model on one token per row, picks the next token (argmax or
:func:`kbit.sample`) and writes it back into the input-ids tensor, advancing position and offset in place.
On CUDA that step is captured once in a CUDA graph and replayed, so a step costs one graph launch instead of
one launch per op (several hundred for an 8B model). On the CPU the same step runs eagerly.

The model's own forward is used (any kbit modules inside: ``KbitLinear``, ``KbitMoE``); only the attention mask
and the position ids are made here (a 4-D boolean mask over the whole static cache, built on the device from
the position tensor), so the step depends on no transformers mask or position logic that reads the host.

Graph capture needs a sync-free forward: quantized MoE models should use :class:`kbit.nn.KbitMoE`
(:func:`use_kbit_moe` swaps the looping ``KbitExperts`` of a loaded checkpoint for it, sharing the weights).

    dec = StaticDecoder(model, batch_size=1, max_len=prompt_len + 64)
    token = dec.prefill(input_ids)          # [B] first new token
    for _ in range(63):
        token = dec.step()                  # [B] (a view of the decoder's buffer: clone to keep it)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["StaticDecoder", "use_kbit_moe"]


def _static_cache(model, max_len: int):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


class StaticDecoder:
    """Prefill + fixed-shape decode steps of ``model`` for ``batch_size`` sequences of up to ``max_len`` tokens.

    Parameters
    ----------
    model : a transformers causal LM (Llama, Qwen2/3, Mistral, Qwen3-MoE, ...), float or kbit-quantized.
    batch_size : rows decoded together (every row has the same prompt length).
    max_len : prompt + new tokens; the static cache holds this many positions.
    graph : capture the decode step in a CUDA graph (default: when the model is on CUDA). False runs it eagerly.
    temperature, top_k, top_p : the sampler (:func:`kbit.sample` on CUDA, :func:`kbit.sample_reference` on the
        CPU); ``temperature == 0`` is greedy (argmax).
    seed : the sampler's Philox key; the offset starts at 0 for the token after the prompt and advances by one
        per step, as :func:`kbit.hf.generate.generate_tokens` draws them.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, *, graph: bool | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0):
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if not (isinstance(max_len, int) and max_len >= 2):
            raise ValueError(f"max_len: expected an int >= 2, got {max_len!r}")
        if temperature < 0:
            raise ValueError(f"temperature: expected >= 0, got {temperature}")
        param = next(iter(model.parameters()), None)
        buf = next(iter(model.buffers()), None)
        self.device = (param if param is not None else buf).device
        if graph is None:
            graph = self.device.type == "cuda"
        if graph and self.device.type != "cuda":
            raise ValueError(f"graph: CUDA graphs need the model on a CUDA device, got {self.device}")
        attn = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"model.config._attn_implementation: expected 'sdpa' or 'eager' (the decoder makes "
                             f"its own 4-D mask), got {attn!r}")
        self.model, self.B, self.L, self.graph = model, batch_size, max_len, bool(graph)
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self._bool_mask = attn == "sdpa"
        self._dtype = getattr(model, "dtype", torch.float32)
        dev = self.device
        self.cache = _static_cache(model, max_len)
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

    # -- pieces ---------------------------------------------------------------------------------------------
    def _mask(self, q_pos: torch.Tensor) -> torch.Tensor:
        """``[B, 1, q, L]``: key j visible from query position p iff j <= p (boolean for sdpa, additive for eager)."""
        allowed = self._arange.view(1, -1) <= q_pos.view(-1, 1)  # [q, L]
        allowed = allowed.view(1, 1, *allowed.shape).expand(self.B, 1, -1, -1)
        if self._bool_mask:
            return allowed
        zero = torch.zeros((), dtype=self._dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self._dtype).min)

    def _forward(self, ids: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=self._mask(q_pos),
                         position_ids=q_pos.view(1, -1).expand(self.B, -1), past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0.0:
            return logits.argmax(dim=-1)
        if logits.is_cuda:
            from kbit.ops.sampling import sample

            return sample(logits, self.temperature, self.top_k, self.top_p, seed=self.seed, offset=self.offset)
        from kbit.ops.sampling import sample_reference

        return sample_reference(logits, self.temperature, self.top_k, self.top_p, generator=self._gen)

    def _step_body(self) -> torch.Tensor:
        """One decode step on the device tensors only (what the graph captures)."""
        logits = self._forward(self.ids, self.pos)
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
        if not self.graph:
            out = self._step_body()
            self.logits = self._logits_buf
        else:
            if self._cuda_graph is None:
                self.capture()
            self._cuda_graph.replay()
            out = self._out
            self.logits = self._logits_buf
        self.length += 1
        return out

    @torch.no_grad()
    def capture(self, warmup: int = 2) -> None:
        """Capture the decode step in a CUDA graph (after a prefill). Warm-up steps run first on a side
        stream (Triton compiles, lookup tables get cached); the cache length is restored afterwards."""
        if not self.graph:
            raise RuntimeError("StaticDecoder.capture: graph=False")
        if self.length == 0:
            raise RuntimeError("StaticDecoder.capture: call prefill first (the cache is allocated by it)")
        n, ids, offset = self.length, self.ids.clone(), self.offset.clone()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(max(1, warmup)):
                self._step_body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._restore(n, ids, offset)
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
    """
    from kbit.hf.experts import KbitExperts
    from kbit.nn import KbitMoE

    done = 0
    for name, block in list(_sparse_blocks(model)):
        if isinstance(block, KbitMoE):
            continue
        experts, gate = block.experts, block.gate
        if isinstance(experts, KbitExperts):
            if k is not None:
                raise ValueError(f"k: expected None for already-quantized experts ({name}), got {k}")
            top_k = getattr(block, "top_k", None) or getattr(gate, "top_k", None)
            norm = next((o.norm_topk_prob for o in (block, gate) if hasattr(o, "norm_topk_prob")), True)
            if getattr(block, "shared_expert", None) is not None:
                raise NotImplementedError(f"{name}: shared experts with KbitExperts are not supported here")
            new = KbitMoE.from_weights(experts.weight("gate_up_proj"), experts.weight("down_proj"), int(top_k),
                                       router_weight=gate.weight.detach(), norm_topk_prob=bool(norm),
                                       dtype=experts.dtype)
        else:
            if k is None:
                raise ValueError(f"k: expected the bits to quantize the float experts of {name}, got None")
            new = KbitMoE.from_hf(block, k=k, **quantize_kw)
        model.set_submodule(name, new)
        done += 1
    return done

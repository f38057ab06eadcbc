"""Calibrate a whole decoder model layer by layer, as GPTQ does, with one decoder layer's Hessians in memory.

1. One forward of the unquantized model per calibration batch records the input of the first decoder layer and
   the other arguments every decoder layer receives (masks, position embeddings: they do not depend on the
   weights; Gemma-style models pass different ones to different layers); it stops before the head.
2. Per decoder layer: the recorded inputs run through it with hooks summing each ``nn.Linear``'s Hessian
   ``X^T X``; every Linear is then quantized from its Hessian; the inputs run through the quantized layer and
   become the next layer's inputs, so each layer is calibrated on what its quantized predecessors produce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kbit.calibrate.gptq import Hessian, gptq_quantize
from kbit.format.spec import DEFAULT_BLOCKSIZE, DEFAULT_K, DEFAULT_SCALE_FORMAT
from kbit.nn.linear import KbitLinear
from kbit.utils.checks import check_int, fail

#: ``quantize_layer(name, linear, H)`` -> a module to put in the Linear's place, or None (the Linear was
#: changed in place, e.g. its weight fake-quantized)
LayerQuantizer = Callable[[str, nn.Linear, torch.Tensor], "nn.Module | None"]


class _Stop(Exception):
    """Raised by a hook to end the recording forward pass once the last decoder layer's arguments are in."""


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layers: the longest ``nn.ModuleList`` of ``model`` whose entries hold ``nn.Linear`` modules."""
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and all(
                any(isinstance(c, nn.Linear) for c in layer.modules()) for layer in m):
            if best is None or len(m) > len(best[1]):
                best = (name, m)
    if best is None:
        fail(ValueError, "model", "a model with an nn.ModuleList of layers holding nn.Linear modules",
             type(model).__name__)
    return best


def token_batches(tokenizer, texts: str | Iterable[str], seq_len: int = 512, max_batches: int | None = None
                  ) -> list[torch.Tensor]:
    """Token ids ``[1, seq_len]`` from ``texts`` (joined by blank lines, cut into consecutive windows)."""
    check_int("seq_len", seq_len, minimum=1)
    text = texts if isinstance(texts, str) else "\n\n".join(texts)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    n = ids.numel() // seq_len
    if max_batches is not None:
        n = min(n, check_int("max_batches", max_batches, minimum=1))
    if n == 0:
        fail(ValueError, "texts", f"at least {seq_len} tokens", ids.numel())
    return [ids[i * seq_len:(i + 1) * seq_len][None] for i in range(n)]


@torch.no_grad()
def _record(model: nn.Module, layers: nn.ModuleList, batches: list[torch.Tensor]):
    """Per batch: the first layer's hidden states and, per layer, its other positional and keyword arguments."""
    hidden, calls = [], []
    current: list = []

    def pre_hook(index):
        def hook(_module, args, kwargs):
            if index == 0:
                hs = args[0] if args else kwargs["hidden_states"]
                hidden.append(hs)
            rest = args[1:] if args else ()
            kw = {n: v for n, v in kwargs.items() if n != "hidden_states"}
            current.append((rest, kw))
            if index == len(layers) - 1:
                raise _Stop
        return hook

    handles = [layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for ids in batches:
            current = []
            try:
                model(ids.to(_device(model)), use_cache=False)
            except _Stop:
                pass
            calls.append(current)
    finally:
        for h in handles:
            h.remove()
    return hidden, calls


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _run_layer(layer: nn.Module, hs: torch.Tensor, call) -> torch.Tensor:
    args, kwargs = call
    out = layer(hs, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def calibrate_layers(model: nn.Module, batches: list[torch.Tensor], quantize_layer: LayerQuantizer,
                     log: Callable[[str], None] | None = None) -> nn.Module:
    """Run the layer-by-layer pass (module docstring) with ``quantize_layer(name, linear, H)`` deciding what
    becomes of each ``nn.Linear`` inside the decoder layers (``H [K, K]`` float32). Returns ``model``.

    ``batches`` : token ids ``[B, T]`` (e.g. from :func:`token_batches`); the model is called as
    ``model(ids, use_cache=False)`` (a Hugging Face causal LM or anything with that signature).
    """
    if not batches:
        fail(ValueError, "batches", "at least one batch of token ids", 0)
    prefix, layers = decoder_layers(model)
    hidden, calls = _record(model, layers, list(batches))
    for i, layer in enumerate(layers):
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        hessians = {n: Hessian(m.in_features, device=m.weight.device) for n, m in linears.items()}
        handles = [m.register_forward_pre_hook(lambda _m, a, h=hessians[n]: h.add(a[0]))
                   for n, m in linears.items()]
        try:
            for b, hs in enumerate(hidden):
                _run_layer(layer, hs, calls[b][i])
        finally:
            for h in handles:
                h.remove()
        for n, m in linears.items():
            replacement = quantize_layer(f"{prefix}.{i}.{n}", m, hessians.pop(n).H)
            if replacement is not None:
                layer.set_submodule(n, replacement)
        hidden = [_run_layer(layer, hs, calls[b][i]) for b, hs in enumerate(hidden)]
        if log is not None:
            log(f"calibrated layer {i + 1}/{len(layers)} ({len(linears)} linears)")
    return model


def calibrate_model(model: nn.Module, batches: list[torch.Tensor], k: int = DEFAULT_K,
                    blocksize: int = DEFAULT_BLOCKSIZE, codebook=None, scale_format: str = DEFAULT_SCALE_FORMAT,
                    damp: float = 0.1, act_order: bool = False, scales: str = "updated",
                    log: Callable[[str], None] | None = None, rotation=None, seed: int = 0) -> nn.Module:
    """Replace every ``nn.Linear`` of the decoder layers by a :class:`kbit.nn.KbitLinear` rounded with
    :func:`gptq_quantize` on its calibration Hessian (embeddings and the head stay). Returns ``model``.
    ``rotation`` / ``seed``: rotated layers (``gptq_quantize``'s; one rotation per input width and seed, so
    layers reading one input share it). ``kbit.quantize_model(calibration=...)`` is the whole-model front door.

    Example
    -------
    >>> batches = token_batches(tok, text, seq_len=512, max_batches=16)  # doctest: +SKIP
    >>> calibrate_model(model, batches, k=3)  # doctest: +SKIP
    """

    def to_kbit(_name: str, linear: nn.Linear, H: torch.Tensor) -> nn.Module:
        qw = gptq_quantize(linear.weight, H, k=k, blocksize=blocksize, codebook=codebook,
                           scale_format=scale_format, damp=damp, act_order=act_order, scales=scales,
                           rotation=rotation, seed=seed)
        return KbitLinear.from_weight(qw, linear.bias, dtype=linear.weight.dtype)

    return calibrate_layers(model, batches, to_kbit, log=log)

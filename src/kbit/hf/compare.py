"""``kbit generate --compare``: the point of kbit on one screen. The default model runs unquantized through
plain transformers ``generate``, then quantized in place at ``k`` bits through ``kbit generate``'s decode loop,
on the same prompt, sampling settings and device; each row shows the weight memory, the time to the first
token, the decode speed and the text.

Memory is what the model's parameters and buffers hold (the k-bit codes, scales and the float parts that stay
float: embeddings, norms); ``cache MiB`` is what the modules keep beside them (on the CPU, ``KbitLinear``
keeps its dequantized float32 weight to run at the speed of a plain ``Linear``); on CUDA, ``peak MiB`` is
``torch.cuda.max_memory_allocated`` during the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kbit.hf.quantize_model import quantize_model
from kbit.nn import KbitLinear
from kbit.utils.device import cpu_decode_dtype


@dataclass(frozen=True)
class Row:
    """One measured run: ``tokens`` generated, seconds to the first one, then decode tokens per second."""

    label: str
    weight_mib: float
    cache_mib: float
    peak_mib: float | None
    first_token_s: float
    decode_tokens_per_s: float
    tokens: int
    text: str


def model_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """``(parameters and buffers, tensors modules keep besides them)`` in bytes, each storage counted once."""
    seen, held, extra = set(), 0, 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            held += t.untyped_storage().nbytes()
    for m in model.modules():
        for name, value in vars(m).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    extra += t.untyped_storage().nbytes()
    return held, extra + _kept_cpu_weights(model)


def _kept_cpu_weights(model: torch.nn.Module) -> int:
    """Bytes of the weights the CPU path keeps for ``model``'s KbitLinear modules (float32 and bfloat16)."""
    kept = (m.kept_cpu_weight(dt) for m in model.modules() if isinstance(m, KbitLinear)
            for dt in (torch.float32, torch.bfloat16))
    return sum(w.untyped_storage().nbytes() for w in kept if w is not None)


def _timed(run: Callable[[Callable[[], None]], list[int]], device: torch.device) -> tuple[list[int], list[float]]:
    """Run ``run(tick)``, where ``tick()`` is called once per new token; returns (tokens, tick times)."""
    times: list[float] = []

    def tick():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times.append(time.perf_counter())
    tokens = run(tick)
    return tokens, times


def _row(label, model, tok, tokens, times, device) -> Row:
    held, extra = model_bytes(model)
    n = len(tokens)
    decode = (n - 1) / (times[-1] - times[1]) if n > 1 else float("nan")
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return Row(label, held / 2**20, extra / 2**20, peak, times[1] - times[0], decode, n,
               tok.decode(tokens, skip_special_tokens=True))


def run_transformers(model, tok, ids, max_new_tokens, temperature, top_k, top_p, seed) -> Row:
    """Plain ``model.generate`` (dynamic cache), exactly ``max_new_tokens`` tokens."""
    from transformers.generation.streamers import BaseStreamer  # transformers is optional (kbit[hf])

    device = ids.device

    def run(tick):
        class Clock(BaseStreamer):
            calls = 0

            def put(self, value):  # first call: the prompt; then one call per new token
                self.calls += 1
                if self.calls > 1:
                    tick()

            def end(self):
                pass

        torch.manual_seed(seed)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": top_p} \
            if temperature > 0 else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, streamer=Clock(), pad_token_id=tok.eos_token_id,
                             **sampling)
        return out[0, ids.shape[1]:].tolist()

    tokens, times = _timed(run, device)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return _row(f"unquantized {dtype} (transformers generate)", model, tok, tokens, times, device)


def run_kbit(model, tok, ids, k, max_new_tokens, temperature, top_k, top_p, seed, generate_tokens) -> Row:
    """``kbit generate``'s loop (``generate_tokens``) on the quantized model, exactly ``max_new_tokens``."""
    def run(tick):
        tokens = []
        for t in generate_tokens(model, ids, max_new_tokens, temperature, top_k, top_p, seed, None):
            tick()
            tokens.append(t)
        return tokens

    tokens, times = _timed(run, ids.device)
    return _row(f"kbit k={k} (kbit generate)", model, tok, tokens, times, ids.device)


def compare(model, tok, ids, k: int, codebook, max_new_tokens: int, temperature: float, top_k: int,
            top_p: float, seed: int, generate_tokens, log=print) -> list[Row]:
    """Both rows for ``model`` (unquantized, quantized in place at ``k`` between the two runs)."""
    base = run_transformers(model, tok, ids, max_new_tokens, temperature, top_k, top_p, seed)
    log(format_row(base))
    start = time.perf_counter()
    quantize_model(model, k=k, codebook=codebook, progress=False)
    dtype = model.dtype if ids.is_cuda else cpu_decode_dtype()  # as `kbit generate` runs it
    model.to(dtype)
    log(f"[quantized every Linear but lm_head to k={k} in {time.perf_counter() - start:.1f} s; "
        f"runs in {str(dtype)[6:]}]")
    row = run_kbit(model, tok, ids, k, max_new_tokens, temperature, top_k, top_p, seed, generate_tokens)
    log(format_row(row))
    return [base, row]


HEADER = f"{'model':<42} {'weights MiB':>11} {'cache MiB':>9} {'peak MiB':>8} {'first s':>7} {'tokens/s':>8}"


def format_row(r: Row) -> str:
    peak = f"{r.peak_mib:8.0f}" if r.peak_mib is not None else f"{'-':>8}"
    text = " ".join(r.text.split())
    text = text if len(text) <= 100 else text[:97] + "..."
    return (f"{r.label:<42} {r.weight_mib:11.1f} {r.cache_mib:9.1f} {peak} {r.first_token_s:7.2f} "
            f"{r.decode_tokens_per_s:8.1f}\n    {text!r}")

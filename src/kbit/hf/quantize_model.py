"""``kbit.quantize_model``: quantize a Hugging Face transformers model in place; ``save_quantized`` /
``load_quantized``: a folder with ``config.json`` (the model's), ``kbit_config.json`` (what was quantized how)
and ``model.safetensors`` (``kbit.save_file``: quantized weights as their four tensors, the rest as is).

Which modules are quantized comes from the table in :mod:`kbit.hf.models` (by ``config.model_type``);
``overrides`` change the format of some of them, skip them, or add Linear modules the table leaves alone
(``lm_head``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from kbit.format.serialize import load_file, save_file
from kbit.format.spec import DEFAULT_BLOCKSIZE, DEFAULT_K, DEFAULT_SCALE_FORMAT, KbitWeight
from kbit.hf.experts import WEIGHTS as EXPERT_WEIGHTS
from kbit.hf.experts import KbitExperts
from kbit.hf.models import compile_patterns, select_modules
from kbit.nn import KbitLinear
from kbit.ops.quantize import quantize
from kbit.utils.checks import fail

CONFIG_NAME = "kbit_config.json"
WEIGHTS_NAME = "model.safetensors"
CHECKPOINT_VERSION = 1
OVERRIDE_KEYS = ("k", "blocksize", "codebook", "scale_format", "skip")


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
        out.append((pattern, dict(opts)))
    return out


def plan(model: nn.Module, k: int = DEFAULT_K, blocksize: int = DEFAULT_BLOCKSIZE, codebook=None,
         scale_format: str = DEFAULT_SCALE_FORMAT, overrides=None, include=None) -> dict[str, dict]:
    """What :func:`quantize_model` would do: module name -> ``{"kind", "k", "blocksize", "codebook",
    "scale_format"}`` (``kind`` is ``"linear"`` or ``"experts"``), in module order. Changes nothing."""
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
    base = {"k": k, "blocksize": blocksize, "codebook": codebook, "scale_format": scale_format}
    out = {}
    for name in modules:  # module order
        if name not in chosen:
            continue
        cfg = dict(base, kind=chosen[name])
        for pattern, opts in rules:  # later overrides win
            if compile_patterns([pattern]).match(name):
                cfg.update(opts)
        if not cfg.pop("skip", False):
            out[name] = cfg
    return out


#: sibling projections that read the same input: quantized together (one tensor scale, one codebook) by
#: ``quantize_model(joint=True)``, so the decode step can run each group as one GEMV (FastDecodeStep)
JOINT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantize_model(model: nn.Module, k: int = DEFAULT_K, blocksize: int = DEFAULT_BLOCKSIZE, codebook=None,
                   scale_format: str = DEFAULT_SCALE_FORMAT, overrides: dict | None = None, include=None,
                   progress: bool = True, joint: bool = True) -> nn.Module:
    """Replace the Linear layers (and fused MoE experts) of a transformers model by k-bit ones, in place.

    Parameters
    ----------
    model : a transformers model whose ``config.model_type`` is in :data:`kbit.hf.models.MODELS` (Llama,
        Mistral, Qwen2/3, Qwen2/3-MoE, Mixtral, BERT), or any model with ``include`` given.
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

    Weights are quantized on their own device (Triton on CUDA, the torch reference on the CPU). Embeddings,
    ``lm_head``, norms and MoE routers stay as they are unless an override names them.

    Returns
    -------
    The same ``model``, with :class:`kbit.nn.KbitLinear` / :class:`kbit.hf.experts.KbitExperts` modules.

    Example
    -------
    >>> model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()  # doctest: +SKIP
    >>> kbit.quantize_model(model, k=4, overrides={r"down_proj": {"k": 5}})  # doctest: +SKIP
    """
    todo = plan(model, k, blocksize, codebook, scale_format, overrides, include)
    items = list(todo.items())
    groups = _joint_groups(model, todo) if joint else {}
    bar = _progress(len(items), progress)
    for name, cfg in items:
        kw = {key: cfg[key] for key in ("k", "blocksize", "codebook", "scale_format")}
        if name in groups:
            names = groups[name]
            if name == names[0]:  # the group quantizes with its first member
                for n, new in zip(names, _quantize_joint([model.get_submodule(n) for n in names], kw), strict=True):
                    model.set_submodule(n, new)
        else:
            module = model.get_submodule(name)
            if cfg["kind"] == "experts":
                new = KbitExperts.from_experts(module, **kw)
            else:
                new = KbitLinear.from_linear(module, **kw)
            model.set_submodule(name, new)
        if bar is not None:
            bar.set_postfix_str(name, refresh=False)
            bar.update()
    if bar is not None:
        bar.close()
    return model


def _joint_groups(model: nn.Module, todo: dict) -> dict[str, list[str]]:
    """Module name -> its group's names, for the :data:`JOINT_GROUPS` whose members are all planned plain
    ``nn.Linear`` of one format, input size, dtype, device and bias presence."""
    out = {}
    keys = ("kind", "k", "blocksize", "codebook", "scale_format")
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


def _quantize_joint(mods: list[nn.Linear], kw: dict) -> list[KbitLinear]:
    """Quantize the row-concatenation of ``mods``' weights once; one KbitLinear per module (its rows)."""
    w = torch.cat([m.weight.detach() for m in mods])
    qw = quantize(w, **kw)
    del w
    w0 = mods[0].weight
    dtype = w0.dtype if (w0.dtype in (torch.float16, torch.bfloat16) or not w0.is_cuda) else torch.bfloat16
    out, lo = [], 0
    for m in mods:
        hi = lo + m.out_features
        part = KbitWeight(qw.codes[lo:hi].clone(), qw.scales[lo:hi].clone(), qw.tensor_scale.clone(),
                          qw.codebook.clone(), (m.out_features, m.in_features), qw.k, qw.blocksize, qw.scale_format,
                          qw.codebook_name)
        out.append(KbitLinear.from_weight(part, m.bias, dtype))
        lo = hi
    return out


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    try:  # tqdm is optional: no progress bar without it
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="kbit quantize", unit="module")


# ------------------------------------------------------------------------------------------------ save / load


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_quantized(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write a model quantized by :func:`quantize_model` to ``directory`` (created if needed).

    Files: ``config.json`` (``model.config.save_pretrained``), ``kbit_config.json`` (the model class, each
    quantized module's kind and activation dtype, tied parameters), ``model.safetensors``
    (``kbit.save_file``: ``P.weight`` of a KbitLinear and ``P.gate_up_proj`` / ``P.down_proj`` of
    KbitExperts as quantized weights; every other parameter and buffer, non-persistent ones included, as is).
    Modules holding their weights in a kernel layout (``KbitLinear.repack_for_kernels``) are saved in the
    canonical layout: the file is the same either way. Save the tokenizer yourself.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state: dict = {}
    modules: dict[str, dict] = {}
    tied: dict[str, str] = {}
    seen: dict[int, str] = {}
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        if isinstance(module, KbitLinear):
            state[f"{prefix}weight"] = module.weight()
            if module.bias is not None:
                state[f"{prefix}bias"] = module.bias
            modules[mname] = {"kind": "linear", "dtype": _dtype_name(module.dtype)}
            continue
        if isinstance(module, KbitExperts):
            for w in EXPERT_WEIGHTS:
                state[f"{prefix}{w}"] = module.weight(w)
            modules[mname] = {"kind": "experts", "dtype": _dtype_name(module.dtype)}
            continue
        if any(mname.startswith(q + ".") for q in modules):
            continue  # inside a quantized module (KbitExperts.act_fn has no tensors, but be safe)
        bufs = module._buffers
        if callable(getattr(module, "canonical_buffers", None)):  # kbit.nn modules held in a kernel layout
            bufs = module.canonical_buffers()
        local = list(module._parameters.items()) + list(bufs.items())
        for pname, t in local:
            if t is None:
                continue
            full = f"{prefix}{pname}"
            key = id(t)
            if key in seen:
                tied[full] = seen[key]
                continue
            seen[key] = full
            state[full] = t
    save_file(state, directory / WEIGHTS_NAME)
    model.config.save_pretrained(directory)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(directory)
        except Exception:  # noqa: BLE001 (a generation config that does not validate is not ours to fix)
            pass
    meta = {"kbit_checkpoint_version": CHECKPOINT_VERSION, "class": type(model).__name__,
            "modules": modules, "tied": tied}
    (directory / CONFIG_NAME).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def load_quantized(directory: str | os.PathLike, device: str | torch.device = "cpu", model_class=None
                   ) -> nn.Module:
    """Load a folder written by :func:`save_quantized` without materialising float weights.

    The model is built on the meta device from ``config.json``, its quantized modules are rebuilt from the
    k-bit tensors, and every other parameter and buffer is assigned from the file (read onto ``device``).

    model_class : the transformers class to build (default: the one recorded in ``kbit_config.json``).
    Returns the model in eval mode on ``device``.
    """
    import transformers  # transformers is optional (kbit[hf]): needed only to load a checkpoint

    directory = Path(directory)
    meta_path = directory / CONFIG_NAME
    if not meta_path.exists():
        raise ValueError(f"{directory}: not a kbit checkpoint (no {CONFIG_NAME})")
    meta = json.loads(meta_path.read_text())
    if meta.get("kbit_checkpoint_version") != CHECKPOINT_VERSION:
        raise ValueError(f"{meta_path}: expected kbit_checkpoint_version {CHECKPOINT_VERSION}, "
                         f"got {meta.get('kbit_checkpoint_version')!r}")
    if model_class is None:
        model_class = getattr(transformers, meta["class"], None)
        if model_class is None:
            raise ValueError(f"{meta_path}: transformers has no class {meta['class']!r}; pass model_class=")
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = model_class(config)
    state = load_file(directory / WEIGHTS_NAME, device=device)

    for mname, info in meta["modules"].items():
        prefix = f"{mname}." if mname else ""
        dtype = getattr(torch, info["dtype"])
        old = model.get_submodule(mname)
        if info["kind"] == "linear":
            new = KbitLinear.from_weight(state.pop(f"{prefix}weight"), state.pop(f"{prefix}bias", None), dtype)
        elif info["kind"] == "experts":
            gu, down = (state.pop(f"{prefix}{w}") for w in EXPERT_WEIGHTS)
            new = KbitExperts(gu, down, act_fn=old.act_fn, dtype=dtype)
        else:
            raise ValueError(f"{meta_path}: module {mname!r} has unknown kind {info['kind']!r}")
        model.set_submodule(mname, new)

    for name, t in state.items():
        _assign(model, name, t)
    for alias, target in meta.get("tied", {}).items():
        _assign(model, alias, _lookup(model, target))
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{directory}: the checkpoint does not fill {len(left)} tensors of "
                         f"{type(model).__name__}, e.g. {left[:5]}")
    return model.eval()


def _lookup(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    return module._parameters.get(attr, module._buffers.get(attr))


def _assign(model: nn.Module, name: str, tensor) -> None:
    owner, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name!r}: the model has no module {owner!r}") from None
    if isinstance(tensor, nn.Parameter) or attr in module._parameters:
        module._parameters[attr] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(
            tensor, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise ValueError(f"checkpoint tensor {name!r}: {type(module).__name__} has no parameter or buffer {attr!r}")

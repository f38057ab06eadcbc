"""Quantized checkpoint folders: ``save_quantized`` / ``load_quantized``.

The folder is a Hugging Face one, the same that ``model.save_pretrained`` writes for a model quantized through
:class:`kbit.KbitConfig`, so ``AutoModelForCausalLM.from_pretrained(folder)`` (after ``import kbit``) reads it:

- ``config.json``: the model's config with ``quantization_config`` = ``{"quant_method": "kbit", ...,
  "modules": {name: {"kind", "k", "blocksize", "scale_format", "codebook", "shape", "dtype", "bias"}}}``, the
  format of every quantized module, enough to build an empty model before any tensor is read (and ``"rotation":
  {"kind", "seed", "block"}`` for a rotated one: the weights hold ``W R``, ``docs/format.md``);
- ``model.safetensors`` (``kbit.save_file``; or shards with ``model.safetensors.index.json`` when transformers
  wrote them): the model's state dict names. A quantized Linear ``P`` holds ``P.codes``, ``P.scales``,
  ``P.tensor_scale``, ``P.codebook`` (and ``P.bias``), which is what ``kbit.save_file`` writes for a
  :class:`~kbit.format.KbitWeight` named ``P``; fused experts hold ``P.gate_up.*`` and ``P.down.*``.

The older folders (``kbit_config.json`` beside the config) keep loading.

Loading checks before it allocates: the config's sizes against the checkpoint's tensor headers (layer count,
embedding shape, absurd values), then every tensor's name, shape and dtype against the empty model; a mismatch
is a ValueError naming the file and the tensor. ``save_quantized`` writes a temporary sibling folder and renames
it into place, so a failure leaves the old folder (or none).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kbit.format.schema import dtype_name
from kbit.format.serialize import VERSION_KEY, load_file, save_file
from kbit.format.spec import KbitWeight, Rotation
from kbit.hf.config import QUANT_METHOD, quantization_config_for
from kbit.hf.experts import CHILDREN, KbitExperts, KbitStack, empty_weight
from kbit.hf.experts import WEIGHTS as EXPERT_WEIGHTS
from kbit.nn import KbitLinear
from kbit.ops.dequant import dequantize
from kbit.ops.quantize import unrotate_weight
from kbit.utils.checks import fail

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
LEGACY_CONFIG_NAME = "kbit_config.json"
#: config sizes above these are refused before anything is built (the largest open models are far below)
LIMITS = {"num_hidden_layers": 4096, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
          "moe_intermediate_size": 1 << 20, "num_attention_heads": 4096, "num_key_value_heads": 4096,
          "vocab_size": 1 << 22, "num_experts": 1 << 14, "num_local_experts": 1 << 14, "head_dim": 1 << 14}
PARTS = ("codes", "scales", "tensor_scale", "codebook")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


# ------------------------------------------------------------------------------------------------ module table


def module_table(model: nn.Module) -> dict[str, dict]:
    """``{name: format}`` of every :class:`~kbit.nn.KbitLinear` / :class:`~kbit.hf.experts.KbitExperts` of
    ``model``: what ``quantization_config["modules"]`` records."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, KbitLinear):
            out[name] = {"kind": "linear", "k": m.k, "blocksize": m.blocksize, "scale_format": m.scale_format,
                         "codebook": m.codebook_name, "shape": [m.out_features, m.in_features],
                         "dtype": dtype_name(m.dtype), "bias": m.bias is not None}
            if m.rotation is not None:
                out[name]["rotation"] = m.rotation.metadata()
        elif isinstance(m, KbitExperts):
            gu, dn = m.weight("gate_up_proj"), m.weight("down_proj")
            out[name] = {"kind": "experts", "k": gu.k, "blocksize": gu.blocksize, "scale_format": gu.scale_format,
                         "codebook": gu.codebook_name, "shape": list(gu.shape), "down_shape": list(dn.shape),
                         "down_k": dn.k, "down_blocksize": dn.blocksize, "down_scale_format": dn.scale_format,
                         "down_codebook": dn.codebook_name, "dtype": dtype_name(m.dtype),
                         "bias": m.down_bias is not None}
            if m.transposed:
                out[name]["transposed"] = True
    return out


def _dtype(info: dict, where: str) -> torch.dtype:
    dt = getattr(torch, str(info.get("dtype")), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        fail(ValueError, where, "a float dtype name", info.get("dtype"))
    return dt


def _shape(v, n: int, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) != n or not all(isinstance(s, int) and s >= 1 for s in v):
        fail(ValueError, where, f"a list of {n} positive ints", v)
    return tuple(v)


def _rotation(info: dict, K: int, where: str) -> Rotation | None:
    r = info.get("rotation")
    if r is None:
        return None
    if not isinstance(r, dict) or set(r) != {"kind", "seed", "block"}:
        fail(ValueError, where, 'None or {"kind": "hadamard", "seed": int, "block": int}', r)
    try:
        rot = Rotation(seed=r["seed"], block=r["block"], kind=r["kind"])
        rot.check_width(K, "shape[1] (K)")
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    return rot


def build_shells(model: nn.Module, modules: dict, where: str, device="meta") -> None:
    """Replace each module named in ``modules`` (a :func:`module_table`) by an empty k-bit module on ``device``,
    after checking it is a Linear / fused experts of the recorded shape. Nothing changes on an error."""
    if not isinstance(modules, dict):
        fail(ValueError, f"{where}: quantization_config.modules", "a dict {module name: format}", type(modules))
    new = {}
    for name, info in modules.items():
        at = f"{where}: quantization_config.modules[{name!r}]"
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{at}: the model ({type(model).__name__}) has no module {name!r}") from None
        kind = info.get("kind") if isinstance(info, dict) else None
        if kind == "linear":
            N, K = _shape(info.get("shape"), 2, f"{at}.shape")
            if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != (N, K):
                got = (old.out_features, old.in_features) if isinstance(old, nn.Linear) else type(old).__name__
                fail(ValueError, at, f"an nn.Linear [{N}, {K}] in the model built from config.json", got)
            new[name] = KbitLinear(K, N, bool(info.get("bias")), k=info.get("k"), blocksize=info.get("blocksize"),
                                   scale_format=info.get("scale_format", "log8"), dtype=_dtype(info, at),
                                   device=device, codebook_name=str(info.get("codebook", "custom")),
                                   rotation=_rotation(info, K, f"{at}.rotation"))
        elif kind == "experts":
            if info.get("rotation") is not None:
                fail(ValueError, f"{at}.rotation", "None (fused experts are not rotated)", info.get("rotation"))
            new[name] = _experts_shell(old, info, at, device)
        else:
            fail(ValueError, f"{at}.kind", "'linear' or 'experts'", kind)
    for name, m in new.items():
        model.set_submodule(name, m)


def _experts_shell(old: nn.Module, info: dict, at: str, device) -> KbitExperts:
    gu_shape = _shape(info.get("shape"), 3, f"{at}.shape")
    dn_shape = _shape(info.get("down_shape"), 3, f"{at}.down_shape")
    got = tuple(getattr(getattr(old, "gate_up_proj", None), "shape", ())), \
        tuple(getattr(getattr(old, "down_proj", None), "shape", ()))
    want = (gu_shape, dn_shape)
    if info.get("transposed"):  # the source module stores [E, H, 2I] / [E, I, H]
        want = tuple((s[0], s[2], s[1]) for s in want)
    if got != want:
        fail(ValueError, at, f"fused experts gate_up_proj {list(want[0])}, down_proj {list(want[1])} in the "
             "model built from config.json", f"{type(old).__name__} with {got}")
    gu = empty_weight(gu_shape, info.get("k"), info.get("blocksize"), info.get("scale_format", "log8"),
                      str(info.get("codebook", "custom")), device)
    dn = empty_weight(dn_shape, info.get("down_k", info.get("k")), info.get("down_blocksize", info.get("blocksize")),
                      info.get("down_scale_format", info.get("scale_format", "log8")),
                      str(info.get("down_codebook", info.get("codebook", "custom"))), device)
    dtype = _dtype(info, at)
    biases = [torch.empty(s, dtype=dtype, device=device) for s in (gu_shape[:2], dn_shape[:2])] \
        if info.get("bias") else [None, None]
    try:
        return KbitExperts.like(old, gu, dn, dtype, *biases)
    except ValueError as e:
        raise ValueError(f"{at}: {e}") from None


def quantized_state_dict(model: nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The state dict a quantized model saves: ``model.state_dict()`` without the modules' extra state (the
    formats live in ``quantization_config.modules``), codes and scales in the canonical layout."""
    return {n: t for n, t in model.state_dict(keep_vars=keep_vars).items() if not n.endswith("._extra_state")}


# ------------------------------------------------------------------------------------------------ save


def save_quantized(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write a model quantized by :func:`kbit.quantize_model` (or loaded with :class:`kbit.KbitConfig`) to
    ``directory``: ``config.json`` with ``quantization_config``, ``generation_config.json``, ``model.safetensors``
    (``kbit.save_file``: quantized weights as :class:`~kbit.format.KbitWeight`, the rest as is; tied tensors once).
    ``AutoModelForCausalLM.from_pretrained(directory)`` and :func:`load_quantized` read it back bit-exact.

    All or nothing: the files go to a temporary sibling folder renamed into place at the end; on an error the
    old ``directory`` is as it was (or there is none). Of an existing folder the files other than weights and
    configs (a tokenizer) are kept. Save the tokenizer yourself. A folder holding another model's weights is
    refused (:func:`check_save_target`): saving into the float model's own folder replaced its weights.
    """
    directory = Path(directory)
    check_save_target(directory)
    table = module_table(model)
    if not table:
        fail(ValueError, "model", "a model quantized by kbit.quantize_model (KbitLinear / KbitExperts modules)",
             f"{type(model).__name__} with none")
    state = _kbit_state(model, table)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        save_file(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        config = model.config
        old_qc, old_tie = getattr(config, "quantization_config", None), getattr(config, "tie_word_embeddings", None)
        config.quantization_config = quantization_config_for(model, table)
        config.architectures = [type(model).__name__]
        emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
        if _head_is_quantized(model) and getattr(emb, "weight", None) is not None:
            # an emptied embedding (kbit generate's checkpoints) can only come back from the k-bit head, which a
            # tied config tells the loader; a kept one is a second tensor now (quantize_model untied the config)
            config.tie_word_embeddings = emb.weight.numel() == 0
        try:
            config.save_pretrained(tmp)
        finally:
            config.quantization_config = old_qc
            if old_qc is None:
                del config.quantization_config
            if old_tie is not None:
                config.tie_word_embeddings = old_tie
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            with contextlib.suppress(Exception):  # a generation config that does not validate is not ours to fix
                gen.save_pretrained(tmp)
        _replace_folder(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_save_target(directory: str | os.PathLike) -> None:
    """Refuse a ``directory`` :func:`save_quantized` must not write: a file, or a folder holding weights
    (``*.safetensors``, ``*.bin``, a shard index) of a model that is not a kbit checkpoint (its ``config.json`` has
    no kbit ``quantization_config``), such as the float model being quantized. A new or empty folder, or a kbit
    checkpoint (replaced), is fine."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        fail(ValueError, "directory", "a folder path", f"the file {directory}")
    if not directory.is_dir() or (directory / LEGACY_CONFIG_NAME).is_file():
        return
    weights = [p.name for p in directory.iterdir() if p.name.endswith((".safetensors", ".bin", ".index.json"))]
    if not weights:
        return
    try:
        qc = _read_json(directory / "config.json").get("quantization_config")
    except ValueError:  # no config.json, or not a JSON object: not a kbit checkpoint
        qc = None
    if not (isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD):
        fail(ValueError, "directory", "a new folder, or a kbit checkpoint to replace",
             f"{directory}, which holds {weights[0]} of a model that is not a kbit checkpoint (its config.json has no "
             f"kbit quantization_config); nothing written, save to another folder")


def _head_is_quantized(model: nn.Module) -> bool:
    get_out = getattr(model, "get_output_embeddings", None)
    return callable(get_out) and isinstance(get_out(), KbitLinear)


def untie_quantized_head(model: nn.Module) -> None:
    """After ``lm_head`` of a model with tied embeddings was quantized: the two are separate tensors, so the config
    says so (transformers would otherwise tie them again on load, over the k-bit module). ``model._kbit_tied_head``
    remembers that they were tied: ``kbit.hf.generate.save_checkpoint`` then stores the embedding as the k-bit head."""
    if not _head_is_quantized(model):
        return
    for cfg in {id(c): c for c in (model.config, getattr(model.config, "get_text_config", lambda: None)())
                if c is not None}.values():
        if getattr(cfg, "tie_word_embeddings", False):
            model._kbit_tied_head = True
            cfg.tie_word_embeddings = False
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(tied, dict):
        head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
        model.all_tied_weights_keys = {a: b for a, b in tied.items()
                                       if not (a.startswith(head + ".") or b.startswith(head + "."))}


def _kbit_state(model: nn.Module, table: dict) -> dict:
    """``save_file``'s input: a KbitWeight per quantized weight, other tensors as they are; tied tensors once."""
    flat = quantized_state_dict(model, keep_vars=True)  # the tensors themselves: tied ones are one object
    state: dict = {}
    for name, info in table.items():
        m = model.get_submodule(name)
        weights = {name: m.weight()} if info["kind"] == "linear" else \
            {f"{name}.{CHILDREN[w]}": m.weight(w) for w in EXPERT_WEIGHTS}
        for wname, qw in weights.items():
            state[wname] = qw
            for p in PARTS:
                flat.pop(f"{wname}.{p}")
    seen: set[int] = set()
    for n, t in flat.items():
        if id(t) in seen:  # tied (lm_head.weight is embed_tokens.weight): transformers re-ties on load
            continue
        seen.add(id(t))
        state[n] = t
    return state


def _ours(name: str) -> bool:
    """Files a save writes or makes stale: weights, their index, the configs (the old layout's too)."""
    return name.endswith(".safetensors") or name in (INDEX_NAME, "config.json", "generation_config.json",
                                                    LEGACY_CONFIG_NAME)


def _replace_folder(tmp: Path, directory: Path) -> None:
    """Put ``tmp`` in the place of ``directory``, keeping the other files of an existing one (a tokenizer)."""
    if not directory.exists():
        tmp.rename(directory)
        return
    for entry in directory.iterdir():
        if not _ours(entry.name) and not (tmp / entry.name).exists():
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp / entry.name)
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    directory.rename(old)
    try:
        tmp.rename(directory)
    except BaseException:
        old.rename(directory)
        raise
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ load


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(out, dict):
        fail(ValueError, str(path), "a JSON object", type(out).__name__)
    return out


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a folder: ``model.safetensors`` or the shards its index names."""
    if (directory / WEIGHTS_NAME).is_file():
        return [directory / WEIGHTS_NAME]
    if (directory / INDEX_NAME).is_file():
        index = _read_json(directory / INDEX_NAME)
        names = sorted(set((index.get("weight_map") or {}).values()))
        if not names or not all(isinstance(n, str) and "/" not in n and "\\" not in n for n in names):
            fail(ValueError, str(directory / INDEX_NAME), "a weight_map of file names in the folder", names[:3])
        return [directory / n for n in names]
    raise ValueError(f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME}")


def read_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], torch.dtype]]:
    """``{tensor name: (file, shape, dtype)}`` from the safetensors headers only (no tensor data is read)."""
    out = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no iterator)
                    sl = f.get_slice(name)
                    dt = _DTYPES.get(sl.get_dtype())
                    if dt is None:
                        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {sl.get_dtype()}")
                    if name in out:
                        raise ValueError(f"{path}: tensor {name!r} is also in {out[name][0]}")
                    out[name] = (path, tuple(sl.get_shape()), dt)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: cannot read safetensors header (truncated or corrupt?): {e}") from e
    return out


def check_config_sizes(config: dict, headers: dict, where: str) -> None:
    """Refuse a config whose sizes are absurd or disagree with the checkpoint, before a model is built."""
    for cfg in (config, config.get("text_config")):
        if not isinstance(cfg, dict):
            continue
        for key, limit in LIMITS.items():
            v = cfg.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limit):
                fail(ValueError, f"{where}: {key}", f"an int in [1, {limit}]", v)
    layers = {int(m.group(1)) for n in headers for m in [re.search(r"(?:^|\.)layers?\.(\d+)\.", n)] if m}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n_layers = text.get("num_hidden_layers")
    if layers and n_layers is not None and n_layers != max(layers) + 1:
        fail(ValueError, f"{where}: num_hidden_layers", f"{max(layers) + 1} (the checkpoint has tensors of layers "
             f"0..{max(layers)})", n_layers)
    for name, (path, shape, _) in headers.items():
        if name.endswith("embed_tokens.weight") and len(shape) == 2:
            want = (text.get("vocab_size", shape[0]), text.get("hidden_size", shape[1]))
            if tuple(shape) != tuple(want):
                fail(ValueError, f"{where}: vocab_size, hidden_size", f"{tuple(shape)} as {name!r} in {path.name}",
                     tuple(want))


@contextlib.contextmanager
def _params_on_meta():
    """Build modules with their parameters on the meta device and their buffers for real (a rotary
    ``inv_freq`` is computed, not loaded): ``nn.Module.register_parameter`` moves each parameter to meta."""
    real = nn.Module.register_parameter

    def register(module, name, param):
        real(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = real


def load_quantized(directory: str | os.PathLike, device: str | torch.device = "cpu", model_class=None
                   ) -> nn.Module:
    """Load a folder written by :func:`save_quantized` or by ``model.save_pretrained`` of a model quantized
    with :class:`kbit.KbitConfig` (older ``kbit_config.json`` folders too), without building float weights.

    Before any allocation the config's sizes are checked against the tensor headers; the model is then built
    with its parameters on the meta device, its quantized modules replaced by empty k-bit ones, and every tensor
    of the files checked (name, shape, dtype) against it before it is read onto ``device`` and assigned.

    model_class : the transformers class to build (default: ``config.json``'s ``architectures[0]``).
    Returns the model in eval mode on ``device``. ValueError names the file and the tensor on any mismatch.
    """
    import transformers  # transformers is optional (kbit[hf]): needed only to load a checkpoint

    directory = Path(directory)
    if not directory.is_dir():
        fail(ValueError, "directory", "a checkpoint folder", f"{directory} (not a folder)")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory}: not a checkpoint folder (no config.json)")
    raw = _read_json(config_path)
    qc = raw.get("quantization_config")
    if qc is None and (directory / LEGACY_CONFIG_NAME).is_file():
        return _load_legacy(directory, device, model_class, raw)
    _check_quant_method(qc, config_path)
    files = weight_files(directory)
    headers = read_headers(files)
    check_config_sizes(raw, headers, str(config_path))
    model_class = model_class or _model_class(transformers, raw, config_path)
    if not all(_is_kbit_file(f) for f in files):
        # written by transformers' save_pretrained: its names may be the checkpoint's original ones (Mixtral's
        # block_sparse_moe), which transformers' loader maps back; it loads through kbit's quantizer
        model = model_class.from_pretrained(directory, device_map=str(device), local_files_only=True)
        return model.eval()
    model = _skeleton(transformers, directory, qc, model_class, str(config_path))
    _check_headers(model, headers)
    _fill(model, files, device)
    return model.eval()


def _check_quant_method(qc, config_path: Path) -> None:
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        fail(ValueError, f"{config_path}: quantization_config.quant_method", repr(QUANT_METHOD),
             repr(qc.get("quant_method")) if isinstance(qc, dict) else "no quantization_config")


def _skeleton(transformers, directory: Path, qc: dict, model_class, where: str) -> nn.Module:
    """The model of ``directory``'s config with its parameters on the meta device, its buffers computed and its
    quantized modules as empty k-bit shells."""
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    config.quantization_config = qc
    with _params_on_meta():
        model = model_class(config)
    build_shells(model, qc.get("modules"), where)
    return model


def empty_quantized(directory: str | os.PathLike, model_class=None) -> nn.Module:
    """The model of a quantized checkpoint folder (:func:`load_quantized`'s folders) with no weight read: its
    parameters on the meta device, its buffers computed (a rotary ``inv_freq``), its quantized modules as empty
    k-bit modules of the right shapes. A skeleton for loaders that fill the model themselves, e.g.
    ``kbit.parallel.load_sharded(shards, model=empty_quantized(folder))``, where each rank reads only its file.

    model_class : the transformers class to build (default: ``config.json``'s ``architectures[0]``).
    ValueError names the file on a folder that is not a kbit checkpoint."""
    import transformers  # transformers is optional (kbit[hf]): needed only for a transformers model

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        fail(ValueError, "directory", "a checkpoint folder with a config.json", os.fspath(directory))
    raw = _read_json(config_path)
    qc = raw.get("quantization_config")
    _check_quant_method(qc, config_path)
    model_class = model_class or _model_class(transformers, raw, config_path)
    return _skeleton(transformers, directory, qc, model_class, str(config_path)).eval()


def _is_kbit_file(path: Path) -> bool:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return VERSION_KEY in (f.metadata() or {})


def _model_class(transformers, raw: dict, where: Path):
    archs = raw.get("architectures")
    name = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        fail(ValueError, f"{where}: architectures", "a transformers model class (or pass model_class=)", archs)
    return cls


def _expected(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.state_dict(keep_vars=True).items() if not n.endswith("._extra_state")}


def _check_headers(model: nn.Module, headers: dict) -> None:
    """Every file tensor is a tensor of the model with its shape and dtype (float tensors: any float dtype,
    kept as stored); every model tensor is in the files or tied to one that is."""
    expected = _expected(model)
    kbit_parts = {f"{n}.{p}" for n, m in model.named_modules() for p in PARTS if isinstance(m, (KbitLinear, KbitStack))}
    from_head = _embedding_from_head(model)
    for name, (path, shape, dtype) in headers.items():
        want = expected.get(name)
        if name == from_head and shape == (0,):
            continue  # stored as the quantized lm_head it is tied to (kbit generate's checkpoints)
        if want is None:
            raise ValueError(f"{path}: tensor {name!r} is not a parameter or buffer of {type(model).__name__}")
        exact = name in kbit_parts or not want.dtype.is_floating_point
        ok_dtype = dtype == want.dtype if exact else dtype.is_floating_point
        if tuple(want.shape) != shape or not ok_dtype:
            raise ValueError(f"{path}: tensor {name!r}: expected shape {list(want.shape)} dtype "
                             f"{want.dtype if exact else 'float'}, got shape {list(shape)} dtype {dtype}")
    by_id: dict[int, list[str]] = {}
    for n, t in expected.items():
        by_id.setdefault(id(t), []).append(n)
    missing = [ns[0] for ns in by_id.values() if not any(n in headers for n in ns)
               and any(expected[n].is_meta for n in ns)]
    if missing:
        raise ValueError(f"{sorted({str(h[0]) for h in headers.values()})}: the checkpoint lacks {len(missing)} "
                         f"tensors of {type(model).__name__}, e.g. {missing[:5]}")


def _fill(model: nn.Module, files: list[Path], device) -> None:
    """Read each file (``kbit.load_file``: its own checks) and assign its tensors."""
    from_head = _embedding_from_head(model)
    for path in files:
        tensors = {}
        for name, v in load_file(path, device=device).items():
            if isinstance(v, KbitWeight):
                _check_rotation(model, name, v, path)
                tensors.update({f"{name}.{p}": t for p, t in v.tensors().items()})
            else:
                tensors[name] = v
        for name, t in tensors.items():
            _assign(model, name, t)
    emb = model.get_input_embeddings() if from_head else None
    if emb is not None and emb.weight.numel() == 0:
        head = model.get_output_embeddings()
        w = dequantize(head.weight(), head.dtype)
        if head.rotation is not None:  # the head holds W R; the embedding is W
            w = unrotate_weight(w, head.rotation).to(head.dtype)
        emb.weight = nn.Parameter(w, requires_grad=False)
    elif not _head_is_quantized(model):
        # a quantized lm_head is not tied to anything (transformers would put the embedding in its place)
        tie = getattr(model, "tie_weights", None)
        if callable(tie):
            tie()
    left = [n for n, t in _expected(model).items() if t.is_meta]
    if left:
        raise ValueError(f"the checkpoint does not fill {len(left)} tensors of {type(model).__name__}, "
                         f"e.g. {left[:5]}")
    for m in model.modules():  # the KbitWeight invariants of every loaded quantized module
        if isinstance(m, KbitLinear):
            m.weight()
        elif isinstance(m, KbitExperts):
            for w in EXPERT_WEIGHTS:
                m.weight(w)
    model.to(device)


def _check_rotation(model: nn.Module, name: str, qw: KbitWeight, path: Path) -> None:
    """The file's rotation of weight ``name`` is the one its module was built with (config.json's table)."""
    try:
        want = getattr(model.get_submodule(name), "rotation", None)
    except AttributeError:
        return  # no such module: the header check names it
    if qw.rotation != want:
        raise ValueError(f"{path}: weight {name!r}: expected rotation {want} (config.json's quantization_config."
                         f"modules), got {qw.rotation} in the file")


def _embedding_from_head(model: nn.Module) -> str | None:
    """The name of the input embedding's weight when it is tied to a quantized ``lm_head`` of its shape (it may
    then be stored empty and rebuilt by dequantizing ``lm_head``), else None."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_in) and callable(get_out)) or \
            not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return None
    emb, head = get_in(), get_out()
    if not isinstance(head, KbitLinear) or not isinstance(getattr(emb, "weight", None), torch.Tensor) or \
            tuple(emb.weight.shape) != (head.out_features, head.in_features):
        return None
    return next((n for n, t in model.named_parameters() if t is emb.weight), None)


def _assign(model: nn.Module, name: str, tensor) -> None:
    owner, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name!r}: the model has no module {owner!r}") from None
    if attr in module._parameters:
        module._parameters[attr] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(
            tensor, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise ValueError(f"checkpoint tensor {name!r}: {type(module).__name__} has no parameter or buffer {attr!r}")


def _load_legacy(directory: Path, device, model_class, raw: dict) -> nn.Module:
    """A folder of the first layout: ``kbit_config.json`` (class, modules, tied names) and ``model.safetensors``
    (``kbit.save_file``: ``P.weight`` / ``P.gate_up_proj`` / ``P.down_proj`` as KbitWeight, every other
    parameter and buffer as is)."""
    import transformers  # transformers is optional (kbit[hf]): needed only to load a checkpoint

    meta_path = directory / LEGACY_CONFIG_NAME
    meta = _read_json(meta_path)
    if meta.get("kbit_checkpoint_version") != 1:
        fail(ValueError, f"{meta_path}: kbit_checkpoint_version", 1, meta.get("kbit_checkpoint_version"))
    headers = read_headers([directory / WEIGHTS_NAME])
    check_config_sizes(raw, headers, str(directory / "config.json"))
    if model_class is None:
        model_class = _model_class(transformers, {"architectures": [meta.get("class")]}, meta_path)
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    with _params_on_meta():
        model = model_class(config)
    state = load_file(directory / WEIGHTS_NAME, device=device)
    for mname, info in (meta.get("modules") or {}).items():
        prefix = f"{mname}." if mname else ""
        dtype = _dtype(info, f"{meta_path}: modules[{mname!r}]")
        old = model.get_submodule(mname)
        if info.get("kind") == "linear":
            qw = state.pop(f"{prefix}weight", None)
            if not isinstance(qw, KbitWeight) or not isinstance(old, nn.Linear) or \
                    qw.shape != (old.out_features, old.in_features):
                raise ValueError(f"{directory / WEIGHTS_NAME}: tensor {prefix}weight: expected a quantized weight "
                                 f"of {type(old).__name__} {mname!r}, got {qw!r}")
            new = KbitLinear.from_weight(qw, state.pop(f"{prefix}bias", None), dtype)
        elif info.get("kind") == "experts":
            gu, dn = (state.pop(f"{prefix}{w}", None) for w in EXPERT_WEIGHTS)
            want = tuple(tuple(getattr(old, w).shape) for w in EXPERT_WEIGHTS)
            if not all(isinstance(q, KbitWeight) for q in (gu, dn)) or (gu.shape, dn.shape) != want:
                raise ValueError(f"{directory / WEIGHTS_NAME}: experts {mname!r}: expected quantized weights of "
                                 f"shapes {want}, got {gu!r}, {dn!r}")
            biases = [state.pop(f"{prefix}{b}", None) for b in ("gate_up_bias", "down_bias")]
            new = KbitExperts.like(old, gu, dn, dtype, *biases)
        else:
            raise ValueError(f"{meta_path}: module {mname!r} has unknown kind {info.get('kind')!r}")
        model.set_submodule(mname, new)
    expected = dict(model.state_dict(keep_vars=True)) | dict(model.named_buffers())
    for name, t in state.items():
        want = expected.get(name)
        if want is None or tuple(want.shape) != tuple(t.shape) or want.dtype.is_floating_point != \
                t.dtype.is_floating_point:
            got = f"shape {list(t.shape)} dtype {t.dtype}"
            raise ValueError(f"{directory / WEIGHTS_NAME}: tensor {name!r}: expected "
                             f"{'no such tensor' if want is None else f'shape {list(want.shape)}'}, got {got}")
        _assign(model, name, t)
    for alias, target in (meta.get("tied") or {}).items():
        owner, _, attr = target.rpartition(".")
        mod = model.get_submodule(owner)
        _assign(model, alias, mod._parameters.get(attr, mod._buffers.get(attr)))
    left = [n for n, t in _expected(model).items() if t.is_meta]
    if left:
        raise ValueError(f"{directory}: the checkpoint does not fill {len(left)} tensors of "
                         f"{type(model).__name__}, e.g. {left[:5]}")
    return model.to(device).eval()

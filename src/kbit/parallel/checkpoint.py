"""Sharded checkpoints: one file per rank holding exactly that rank's shards, so that a rank reads only its own bytes.

A directory holds

- ``kbit-sharded.json``, the index: ``format``/``version``, ``world``, the ``plan`` and its ``unit``, per planned
  module its description (class, sizes, format parameters, style) and every rank's ``ranges`` (rows, columns
  or experts), the replicated modules' extra states, and per rank file its name, size and metadata CRC-32 (which
  covers every tensor's CRC-32); ``index_crc32`` covers the rest of the index;
- ``rank-<r>-of-<world>.kbit.safetensors``: a kbit format 2 file (``kbit.load_file`` reads it) with this rank's
  shards of the planned modules (a column or row shard ``<module>.weight`` and its ``.bias``; an expert-parallel
  block's ``<module>.gate_up`` / ``.down`` for its experts and the whole ``.router_weight`` /
  ``.correction_bias``) and every tensor of the model that no plan entry shards (embeddings, norms, unplanned
  layers), under its state-dict name.

:func:`save_sharded` writes it from a whole model; :func:`shard_layout` + :class:`~kbit.parallel.ShardWriter`
let a rank write its file tensor by tensor from any source (``lab/parallel/big_model.py`` writes random codes);
:func:`load_sharded` builds a rank's modules from its file alone, one module at a time, on its device.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

from kbit.format.pack import words_per_row
from kbit.format.spec import KbitWeight, Rotation, padded_k
from kbit.nn.linear import KbitLinear
from kbit.nn.moe import KbitMoE
from kbit.parallel.linear import ColumnParallelKbitLinear
from kbit.parallel.moe import ExpertParallelKbitMoE, expert_range, shard_experts
from kbit.parallel.plan import STYLES, plan_unit, planned_modules
from kbit.parallel.shard import packed_ranges, shard_range, shard_weight
from kbit.parallel.shardfile import ShardReader, ShardWriter
from kbit.utils.checks import check_int, fail

__all__ = ["INDEX_NAME", "load_sharded", "rank_file", "read_index", "save_sharded", "shard_layout", "shard_specs",
           "shard_tensors", "write_index"]

INDEX_NAME = "kbit-sharded.json"
FORMAT = "kbit-sharded"
VERSION = 1


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank}-of-{world}.kbit.safetensors"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        fail(ValueError, "dtype", "a torch dtype name", repr(name))
    return dtype


def _fmt(m) -> dict:
    rot = m.rotation
    return {"k": m.k, "blocksize": m.blocksize, "scale_format": m.scale_format, "codebook": m.codebook_name,
            "rotation": None if rot is None else rot.metadata(), "dtype": str(m.dtype).removeprefix("torch.")}


def _describe(m: nn.Module, style: str, unit: int, world: int) -> dict:
    """The index entry of module ``m`` planned with ``style`` (every rank's ranges included)."""
    cls, kwargs = STYLES[style]
    if cls is ExpertParallelKbitMoE:
        return {"class": "KbitMoE", "style": style, "num_experts": m.num_experts, "hidden_size": m.hidden_size,
                "intermediate_size": m.intermediate_size, "top_k": m.top_k, "router": m.router,
                "norm_topk_prob": m.norm_topk_prob, "routed_scaling_factor": m.routed_scaling_factor,
                "n_group": m.n_group, "topk_group": m.topk_group, "router_weight": m.router_weight is not None,
                "correction_bias": m.correction_bias is not None, **_fmt(m),
                "ranges": [list(expert_range(m.num_experts, r, world)) for r in range(world)]}
    d = {"class": "KbitLinear", "style": style, "in_features": m.in_features, "out_features": m.out_features,
         "bias": m.bias is not None, "unit": unit, **_fmt(m), "parts": None}
    if cls is ColumnParallelKbitLinear:
        parts = kwargs.get("parts")
        if parts == "packed":
            n = m.out_features
            parts = tuple(getattr(m, "packed_parts", None) or (n // 2, n - n // 2))
        d["parts"] = None if parts is None else list(parts)
        d["ranges"] = [[list(ab) for ab in (packed_ranges(parts, r, world, unit) if parts else
                                            [shard_range(m.out_features, r, world, unit)])] for r in range(world)]
    else:
        d["ranges"] = [[list(shard_range(m.in_features, r, world, unit))] for r in range(world)]
    return d


def shard_layout(model: nn.Module, plan: dict[str, str], world: int, unit: int | None = None) -> dict:
    """The index of a sharded checkpoint of ``model`` (its ``files`` still empty): the planned modules' entries,
    the replicated tensors (state-dict name -> ``[dtype, shape]``) and extra states. ``model`` may live on the
    ``meta`` device: only shapes and format parameters are read."""
    check_int("world", world, minimum=1)
    found = planned_modules(model, plan)
    if not found:
        fail(ValueError, "plan", "patterns matching at least one module of the model", f"no match for {list(plan)}")
    if unit is None:
        unit = plan_unit([model.get_submodule(n) for n, s in found if STYLES[s][0] is not ExpertParallelKbitMoE])
    modules = {}
    for n, s in found:
        try:
            modules[n] = _describe(model.get_submodule(n), s, unit, world)
        except ValueError as e:  # a dimension too small to split over the ranks: say which module
            raise ValueError(f"module {n!r} (style {s!r}, world {world}): {e}") from e
    replicated, extra = {}, {}
    for key, v in model.state_dict(keep_vars=True).items():
        if key.rpartition(".")[0] in modules:  # a planned module's own tensors (a KbitMoE's shared expert: replicated)
            continue
        if isinstance(v, torch.Tensor):
            replicated[key] = [str(v.dtype).removeprefix("torch."), list(v.shape)]
        else:
            extra[key] = v
    return {"format": FORMAT, "version": VERSION, "world": world, "unit": unit, "plan": dict(plan),
            "modules": modules, "replicated": replicated, "extra_state": json.loads(json.dumps(extra)), "files": []}


def _weight_specs(prefix: str, shape, d: dict) -> tuple[dict, dict]:
    k, bs = d["k"], d["blocksize"]
    kp = padded_k(shape[-1], bs)
    lead = tuple(shape[:-1])
    specs = {f"{prefix}.codes": (torch.int32, (*lead, words_per_row(k, kp))),
             f"{prefix}.scales": (torch.uint8 if d["scale_format"] == "log8" else torch.float16, (*lead, kp // bs)),
             f"{prefix}.tensor_scale": (torch.float32, tuple(shape[:-2])),
             f"{prefix}.codebook": (torch.float32, (2**k,))}
    meta = {"k": k, "blocksize": bs, "shape": list(shape), "scale_format": d["scale_format"], "codebook": d["codebook"]}
    if d["rotation"] is not None and not prefix.endswith(".down"):  # a KbitMoE's rotation is its gate_up stack's
        meta["rotation"] = d["rotation"]
    return specs, meta


def _module_specs(name: str, d: dict, rank: int) -> tuple[dict, dict]:
    """(tensor specs, ``kbit.weights`` entries) of module ``name``'s shard on ``rank``."""
    dt, ranges = _dtype(d["dtype"]), d["ranges"][rank]
    if d["class"] == "KbitMoE":
        E, H, I = ranges[1] - ranges[0], d["hidden_size"], d["intermediate_size"]
        s1, m1 = _weight_specs(f"{name}.gate_up", (E, 2 * I, H), d)
        s2, m2 = _weight_specs(f"{name}.down", (E, H, I), d)
        specs = {**s1, **s2}
        if d["router_weight"]:
            specs[f"{name}.router_weight"] = (dt, (d["num_experts"], H))
        if d["correction_bias"]:
            specs[f"{name}.correction_bias"] = (torch.float32, (d["num_experts"],))
        return specs, {f"{name}.gate_up": m1, f"{name}.down": m2}
    width = sum(b - a for a, b in ranges)
    col = STYLES[d["style"]][0] is ColumnParallelKbitLinear
    shape = (width, d["in_features"]) if col else (d["out_features"], width)
    specs, meta = _weight_specs(f"{name}.weight", shape, d)
    if d["bias"]:
        specs[f"{name}.bias"] = (dt, (width if col else d["out_features"],))
    return specs, {f"{name}.weight": meta}


def shard_specs(layout: dict, rank: int) -> tuple[dict, dict]:
    """(tensor name -> (dtype, shape), ``kbit.weights`` entries) of rank ``rank``'s file: its shards, module by
    module in the model's order, then the replicated tensors."""
    check_int("rank", rank, minimum=0, maximum=layout["world"] - 1)
    specs, weights = {}, {}
    for name, d in layout["modules"].items():
        s, w = _module_specs(name, d, rank)
        specs.update(s)
        weights.update(w)
    for key, (dtype, shape) in layout["replicated"].items():
        specs[key] = (_dtype(dtype), tuple(shape))
    return specs, weights


def shard_tensors(module: nn.Module, d: dict, name: str, rank: int) -> dict[str, torch.Tensor]:
    """The tensors of ``module``'s shard on ``rank`` (names as :func:`shard_specs`), cut from its packed weights."""
    a, b = d["ranges"][rank][0] if d["class"] == "KbitLinear" else d["ranges"][rank]
    if d["class"] == "KbitMoE":
        out = {f"{name}.gate_up.{p}": t for p, t in shard_experts(module.gate_up_weight(), a, b).tensors().items()}
        out.update({f"{name}.down.{p}": t for p, t in shard_experts(module.down_weight(), a, b).tensors().items()})
        for key in ("router_weight", "correction_bias"):
            if getattr(module, key) is not None:
                out[f"{name}.{key}"] = getattr(module, key)
        return out
    world = len(d["ranges"])
    col = STYLES[d["style"]][0] is ColumnParallelKbitLinear
    parts = tuple(d["parts"]) if d["parts"] else None
    qw = shard_weight(module.weight(), 0 if col else 1, rank, world, d["unit"], parts=parts)
    out = {f"{name}.weight.{p}": t for p, t in qw.tensors().items()}
    if module.bias is not None:
        out[f"{name}.bias"] = torch.cat([module.bias[x:y] for x, y in d["ranges"][rank]]) if col else module.bias
    return out


def _crc(obj: dict) -> int:
    return zlib.crc32(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def write_index(directory, layout: dict, files: list[dict]) -> str:
    """Write ``kbit-sharded.json`` for ``layout`` with the rank files' records (``ShardWriter.close()``, rank
    order); returns its path."""
    if len(files) != layout["world"]:
        fail(ValueError, "files", f"one record a rank ({layout['world']})", len(files))
    index = dict(layout, files=list(files))
    index["index_crc32"] = _crc(index)
    path = os.path.join(os.fspath(directory), INDEX_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def read_index(directory) -> dict:
    """The index of a sharded checkpoint directory, checked (format, version, checksum)."""
    path = os.path.join(os.fspath(directory), INDEX_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"directory: expected a sharded kbit checkpoint (with {INDEX_NAME}), got "
                                f"{os.fspath(directory)!r}")
    try:
        with open(path) as f:
            index = json.load(f)
        if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ValueError(f"expected format {FORMAT!r} version {VERSION}")
        want = index.pop("index_crc32", None)
        if want != _crc(index):
            raise ValueError(f"index checksum mismatch: expected {want}, got {_crc(index)} (the index is damaged)")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    return index


def save_sharded(model: nn.Module, directory, plan: dict[str, str], world: int, unit: int | None = None) -> dict:
    """Write ``model`` (whole, on any device) as a sharded checkpoint for ``world`` ranks into ``directory``
    (module docstring): one file per rank, then the index. Returns the index.

    ``plan``: ``{pattern: style}`` as :func:`kbit.parallel.parallelize_kbit` (``"ep"`` for ``KbitMoE`` blocks);
    ``unit``: as there (default :func:`kbit.parallel.plan_unit`). Shards are cut from the packed weights
    (:func:`kbit.parallel.shard_weight`, bit-exact); each rank's file is written shard by shard.
    """
    layout = shard_layout(model, plan, world, unit)
    os.makedirs(os.fspath(directory), exist_ok=True)
    state = model.state_dict()
    files = []
    for rank in range(world):
        specs, weights = shard_specs(layout, rank)
        writer = ShardWriter(os.path.join(os.fspath(directory), rank_file(rank, world)), specs, weights,
                             {"kbit.shard": json.dumps({"rank": rank, "world": world})})
        try:
            for name, d in layout["modules"].items():
                for key, t in shard_tensors(model.get_submodule(name), d, name, rank).items():
                    writer.write(key, t)
            for key in layout["replicated"]:
                writer.write(key, state[key])
        except BaseException:
            writer.abort()
            raise
        files.append(writer.close())
    write_index(directory, layout, files)
    return dict(layout, files=files)


def _weight(reader_get, prefix: str, meta: dict) -> KbitWeight:
    r = meta.get("rotation")
    return KbitWeight(*(reader_get(f"{prefix}.{p}") for p in ("codes", "scales", "tensor_scale", "codebook")),
                      tuple(meta["shape"]), meta["k"], meta["blocksize"], meta["scale_format"], meta["codebook"],
                      None if r is None else Rotation(seed=r["seed"], block=r["block"], kind=r["kind"]))


def _build(name: str, d: dict, get, weights: dict, group, skeleton: nn.Module | None) -> nn.Module:
    """Rank's module ``name`` from its tensors (``get(tensor name)``, on the target device)."""
    dt = _dtype(d["dtype"])
    cls, kwargs = STYLES[d["style"]]
    if d["class"] == "KbitMoE":
        gu, dn = _weight(get, f"{name}.gate_up", weights[f"{name}.gate_up"]), \
            _weight(get, f"{name}.down", weights[f"{name}.down"])
        local = KbitMoE.from_weights(gu, dn, min(d["top_k"], gu.shape[0]), dtype=dt)
        shared = {k: getattr(skeleton, k, None) for k in ("shared_expert", "shared_expert_gate")}
        return ExpertParallelKbitMoE(
            local, d["num_experts"], d["top_k"], group=group, router=d["router"], norm_topk_prob=d["norm_topk_prob"],
            routed_scaling_factor=d["routed_scaling_factor"], n_group=d["n_group"], topk_group=d["topk_group"],
            router_weight=get(f"{name}.router_weight") if d["router_weight"] else None,
            correction_bias=get(f"{name}.correction_bias") if d["correction_bias"] else None, **shared)
    qw = _weight(get, f"{name}.weight", weights[f"{name}.weight"])
    bias = get(f"{name}.bias") if d["bias"] else None
    if cls is ColumnParallelKbitLinear:
        parts = tuple(d["parts"]) if d["parts"] else None
        return cls(KbitLinear.from_weight(qw, bias, dt), d["out_features"], group=group, unit=d["unit"], parts=parts,
                   gather_output=kwargs["gather_output"])
    return cls(KbitLinear.from_weight(qw, None, dt), d["in_features"], bias, group=group, unit=d["unit"],
               input_is_parallel=kwargs["input_is_parallel"])


def _open_rank_file(directory, index: dict, rank: int) -> ShardReader:
    rec = index["files"][rank]
    path = os.path.join(os.fspath(directory), rec["file"])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: rank {rank}'s file of the sharded checkpoint is missing")
    if os.path.getsize(path) != rec["bytes"]:
        raise ValueError(f"{path}: expected {rec['bytes']} bytes (as the index records), got "
                         f"{os.path.getsize(path)} (truncated or replaced)")
    reader = ShardReader(path)
    if reader.metadata_crc32 != rec["metadata_crc32"]:
        raise ValueError(f"{path}: metadata CRC-32 {reader.metadata_crc32}, the index records "
                         f"{rec['metadata_crc32']} (the file belongs to another checkpoint or is damaged)")
    specs, weights = shard_specs(index, rank)
    got = {n: (r["dtype"], r["shape"]) for n, r in reader.records.items()}
    want = {n: (str(dt).removeprefix("torch."), list(s)) for n, (dt, s) in specs.items()}
    if got != want or reader.weights != weights:
        diff = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))[:5] or "kbit.weights"
        raise ValueError(f"{path}: its tensors do not match the index's layout for rank {rank} (first: {diff})")
    return reader


def _replicated_names(index: dict) -> list[str]:
    """The tensors every rank's file holds whole: the unplanned ones, routers, row-parallel biases."""
    out = list(index["replicated"])
    for name, d in index["modules"].items():
        if d["class"] == "KbitMoE":
            out += [f"{name}.{k}" for k in ("router_weight", "correction_bias") if d[k]]
        elif d["bias"] and STYLES[d["style"]][0] is not ColumnParallelKbitLinear:
            out.append(f"{name}.bias")
    return out


def _check_replicated(index: dict, reader: ShardReader, group) -> None:
    """Every rank's file holds the same replicated tensors (their recorded CRC-32s agree; one small collective):
    ranks that routed or normalised with different weights would compute silently different models."""
    mine = {n: reader.records[n]["crc32"] for n in _replicated_names(index)}
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    bad = sorted(n for n in mine if any(e.get(n) != mine[n] for e in every))
    if bad:
        fail(ValueError, "directory", "the same replicated tensors in every rank's file",
             f"{len(bad)} that differ between ranks, first {bad[:5]}")


def _install(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def load_sharded(directory, rank: int | None = None, *, model: nn.Module | None = None, group=None,
                 device=None, verify: bool = True, check_replicated: bool = True):
    """Build this rank's part of a sharded checkpoint from its own file only (module docstring).

    Parameters
    ----------
    directory : written by :func:`save_sharded` (or :func:`write_index` + ``ShardWriter``).
    rank : this rank (default: its rank in ``group``; must equal it). The checkpoint's world size must be the
        group's (ValueError naming ``directory`` otherwise).
    model : a skeleton of the model (any device, ``meta`` too: nothing of it is read but its structure): its
        planned modules are replaced by the parallel modules built from the file (an expert-parallel block takes
        the skeleton's shared expert, loaded as a replicated module), every other tensor of its state dict is
        assigned from the file (on ``device``). None: returns the parts instead.
    device : where the modules go (default: the current CUDA device where CUDA is there, else the CPU). Each
        module is read (a memory-mapped view of the file), checked and moved on its own, so at most a few
        modules' tensors are in host memory at once.
    verify : check every tensor's CRC-32 (the metadata's is always checked).
    check_replicated : check that every rank's file holds the same replicated tensors (their recorded CRC-32s,
        one small all-gather: every rank must call ``load_sharded`` at once). False: no collective at all, so
        that ranks may load one after another.

    Returns ``model``, or ``{"modules": {name: parallel module}, "replicated": {name: tensor}}``.
    """
    index = read_index(directory)
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first "
                           "(or run under torchrun)")
    world, mine = dist.get_world_size(group), dist.get_rank(group)
    if index["world"] != world:
        fail(ValueError, "directory", f"a checkpoint for {world} ranks (the process group's size)",
             f"one for {index['world']} ranks ({os.fspath(directory)!r})")
    rank = mine if rank is None else check_int("rank", rank, minimum=0, maximum=world - 1)
    if rank != mine:
        fail(ValueError, "rank", f"this process's rank in the group ({mine})", rank)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    reader = _open_rank_file(directory, index, rank)
    if check_replicated:
        _check_replicated(index, reader, group)

    def fetch(names):  # a module's tensors, checked (threads: zlib releases the GIL)
        return {n: reader.get(n, verify) for n in names}

    def place(t):  # off the memory map: onto the device, or a CPU copy of its own
        return t.to(device) if device.type != "cpu" else t.clone()

    specs_of = {name: list(_module_specs(name, d, rank)[0]) for name, d in index["modules"].items()}
    modules, replicated = {}, {}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = {name: pool.submit(fetch, names) for name, names in specs_of.items()}
        rep = pool.submit(fetch, list(index["replicated"]))
        for name, d in index["modules"].items():
            tensors = {n: place(t) for n, t in futures.pop(name).result().items()}
            skeleton = model.get_submodule(name) if model is not None else None
            modules[name] = _build(name, d, tensors.__getitem__, reader.weights, group, skeleton)
            del tensors
            if model is not None:
                _install(model, name, modules[name])
        replicated = {n: place(t) for n, t in rep.result().items()}
    if model is None:
        return {"modules": modules, "replicated": replicated}
    _assign(model, replicated, index["extra_state"])
    return model


def _assign(model: nn.Module, replicated: dict[str, torch.Tensor], extra: dict) -> None:
    """Put the replicated tensors into the skeleton in place of its own (same dtype and shape), then its extra
    states (a module checks its format parameters there). By assignment, not ``load_state_dict``: that would also
    visit the parallel modules, whose tensors are in place already."""
    for key, t in replicated.items():
        owner, _, leaf = key.rpartition(".")
        mod = model.get_submodule(owner)
        old = mod._parameters.get(leaf) if leaf in mod._parameters else mod._buffers.get(leaf)
        if old is None or old.dtype != t.dtype or tuple(old.shape) != tuple(t.shape):
            got = "nothing" if old is None else f"{old.dtype} {tuple(old.shape)}"
            fail(ValueError, "model", f"a tensor {key!r} of {t.dtype} {tuple(t.shape)} (as the checkpoint)", got)
        if leaf in mod._parameters:
            mod._parameters[leaf] = nn.Parameter(t, requires_grad=old.requires_grad)
        else:
            mod._buffers[leaf] = t
    for key, state in extra.items():
        model.get_submodule(key.rpartition(".")[0]).set_extra_state(state)

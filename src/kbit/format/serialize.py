"""Save and load state dicts holding :class:`KbitWeight` values to/from safetensors files (format version 2).

A weight named ``P`` becomes the tensors ``P.codes``, ``P.scales``, ``P.tensor_scale``, ``P.codebook``. The file
metadata (docs/format.md, "Files") holds

- ``kbit.format_version``: ``"2"``;
- ``kbit.weights``: JSON, ``P`` -> ``{"k", "blocksize", "shape", "scale_format", "codebook"}``, plus
  ``"rotation": {"kind", "seed", "block"}`` for a rotated weight (absent: unrotated);
- ``kbit.tensors``: JSON, every tensor of the file (parts and plain tensors) -> ``{"dtype", "shape", "crc32"}``,
  the CRC-32 (``zlib.crc32``) of its bytes;
- ``kbit.metadata_crc32``: the CRC-32 of all the other metadata entries (:func:`metadata_crc32`), so an edited,
  added or deleted entry (a weight's shape, a checksum, the weights key itself) is caught like a damaged tensor.

Everything read is checked before anything is returned: the schema of the metadata, every tensor's name, dtype and
shape against ``kbit.tensors``, the checksums (``verify=False`` skips only the tensor-data checksums), and each
weight's parts against its parameters and its values (:meth:`KbitWeight.check_values`). Version 1 files (no
checksums) still load, with a warning.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as _save_file

from kbit.format import schema
from kbit.format.codebooks import midpoints
from kbit.format.pack import unpack
from kbit.format.spec import FORMAT_VERSION, KbitWeight, Rotation

VERSION_KEY = "kbit.format_version"
WEIGHTS_KEY = "kbit.weights"
TENSORS_KEY = "kbit.tensors"
METADATA_CRC_KEY = "kbit.metadata_crc32"
PARTS = ("codes", "scales", "tensor_scale", "codebook")
#: versions :func:`load_file` reads
READABLE_VERSIONS = ("1", "2")

_warned_v1: set[str] = set()


def tensor_crc32(t: torch.Tensor) -> int:
    """CRC-32 (``zlib.crc32``) of a CPU tensor's bytes in memory order (little-endian, as safetensors stores them)."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return zlib.crc32(b"")
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy())


def metadata_crc32(meta: dict[str, str]) -> int:
    """CRC-32 of every metadata entry but ``kbit.metadata_crc32`` itself (sorted, compact JSON, UTF-8)."""
    rest = {k: v for k, v in meta.items() if k != METADATA_CRC_KEY}
    return zlib.crc32(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def save_file(state_dict: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write ``state_dict`` (names -> KbitWeight or torch.Tensor) to a safetensors file at ``path`` (format 2).

    Raises TypeError for a value that is neither, ValueError where two entries would write the same tensor
    (``{"w": qw, "w.codes": t}``), where ``metadata`` uses a reserved ``kbit.`` key, and for a KbitWeight whose
    values are invalid (:meth:`KbitWeight.check_values`). The file is written to a new temporary beside ``path``
    and renamed over it, so a failed save leaves ``path`` as it was.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict: expected a dict, got {type(state_dict).__name__}")
    meta = _user_metadata(metadata)
    tensors, weights = _flatten(state_dict)
    meta[VERSION_KEY] = str(FORMAT_VERSION)
    meta[WEIGHTS_KEY] = json.dumps(weights, sort_keys=True)
    meta[TENSORS_KEY] = json.dumps({n: {"dtype": schema.dtype_name(t.dtype), "shape": list(t.shape),
                                        "crc32": tensor_crc32(t)} for n, t in tensors.items()}, sort_keys=True)
    meta[METADATA_CRC_KEY] = str(metadata_crc32(meta))
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: expected a file name, got a directory")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{path}: the folder {folder} does not exist")
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        _save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _user_metadata(metadata) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise TypeError(f"metadata: expected a dict of str -> str, got {metadata!r:.200}")
    reserved = sorted(k for k in metadata if k.startswith("kbit."))
    if reserved:
        raise ValueError(f"metadata: expected no key starting with 'kbit.' (kbit's own), got {reserved}")
    return dict(metadata)


def _flatten(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(tensor name -> CPU tensor, weight name -> parameters); a tensor name two entries would write is an error."""
    tensors: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # tensor name -> the state_dict entry that writes it
    weights: dict[str, dict] = {}
    storages: set[int] = set()
    for name, value in state_dict.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"state_dict: expected non-empty str names, got {name!r}")
        if isinstance(value, KbitWeight):
            weights[name] = value.metadata()
            items = {f"{name}.{part}": t for part, t in value.tensors().items()}
        elif isinstance(value, torch.Tensor):
            items = {name: value}
        else:
            raise TypeError(f"state_dict[{name!r}]: expected a KbitWeight or torch.Tensor, got {type(value).__name__}")
        for tname, t in items.items():
            if tname in source:
                raise ValueError(f"state_dict: entries {source[tname]!r} and {name!r} both write the tensor "
                                 f"{tname!r}; rename one of them")
            source[tname] = name
            tensors[tname] = _own_cpu_copy(t, storages)
        if isinstance(value, KbitWeight):
            try:  # on the CPU copies: a weight built on a GPU was not checked (no host sync there)
                KbitWeight(*(tensors[f"{name}.{p}"] for p in PARTS), **_params(weights[name]))
            except ValueError as e:
                raise ValueError(f"state_dict[{name!r}]: {e}") from e
    return tensors, weights


def _own_cpu_copy(t: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """``t`` contiguous on the CPU, copied where it shares storage with another tensor or is a view of a larger
    one (safetensors refuses to write shared storage: e.g. one codebook in several weights, ``qw[e]``)."""
    c = t.detach().contiguous().cpu()
    ptr = c.untyped_storage().data_ptr()
    if ptr in storages or c.untyped_storage().nbytes() != c.numel() * c.element_size():
        c = c.clone()
        ptr = c.untyped_storage().data_ptr()
    storages.add(ptr)
    return c


def _params(p: dict) -> dict:
    r = p.get("rotation")
    return {"shape": tuple(p["shape"]), "k": p["k"], "blocksize": p["blocksize"], "scale_format": p["scale_format"],
            "codebook_name": p["codebook"],
            "rotation": None if r is None else Rotation(seed=r["seed"], block=r["block"], kind=r["kind"])}


def load_file(path: str | os.PathLike, device: str | torch.device = "cpu", *, verify: bool = True) -> dict:
    """Read a file written by :func:`save_file`: names -> KbitWeight or torch.Tensor, on ``device``.

    Everything is read and checked on the CPU first, then moved. ``verify=False`` skips the CRC-32 of the tensor
    data (docs/format.md gives its cost); the metadata checksum, the schema and the values are always checked.

    Raises FileNotFoundError / IsADirectoryError naming ``path``, and ValueError naming the file (and the tensor
    or weight where one is at fault) for anything else: not a kbit file, an unknown version, a truncated or damaged
    file, metadata that breaks the schema, a checksum mismatch, tensors that do not match their parameters.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: expected a safetensors file, got a directory")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    meta, raw = _read(path)
    version = meta.get(VERSION_KEY)
    if version is None:
        raise ValueError(f"{path}: not a kbit file (metadata has no {VERSION_KEY!r})")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{path}: expected kbit format version 1 or 2, got {version!r}")
    try:
        if version == "1":
            _warn_v1(path)
        else:
            _verify_v2(meta, raw, verify)
        weights = schema.weights(meta, WEIGHTS_KEY)
        if version == "1":  # no checksum covers the weights entry: parts without one must not pass as plain tensors
            schema.no_orphan_parts(weights, raw, PARTS)
        out = _assemble(weights, raw)
        if version == "1":
            for name, v in out.items():
                if isinstance(v, KbitWeight):
                    _check_padding(name, v)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return {n: v.to(device) for n, v in out.items()} if torch.device(device).type != "cpu" else out


def _read(path: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, name -> CPU tensor) of a safetensors file; ValueError naming the file where it cannot be read."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            raw = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    except (SafetensorError, OSError, RuntimeError, ValueError, OverflowError) as e:
        raise ValueError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from e
    return meta, raw


def _warn_v1(path: str) -> None:
    if path not in _warned_v1:
        _warned_v1.add(path)
        warnings.warn(f"{path}: kbit format version 1 has no checksums, its data is not verified; save it again "
                      "(kbit.save_file) to write version 2", stacklevel=3)


def _verify_v2(meta: dict[str, str], raw: dict[str, torch.Tensor], verify: bool) -> None:
    for key in (WEIGHTS_KEY, TENSORS_KEY, METADATA_CRC_KEY):
        if key not in meta:
            raise ValueError(f"metadata lacks {key!r} (required in format version 2)")
    if meta[METADATA_CRC_KEY] != str(metadata_crc32(meta)):
        raise ValueError(f"metadata checksum mismatch: expected {meta[METADATA_CRC_KEY]}, got "
                         f"{metadata_crc32(meta)} (an entry was changed, added or deleted; the file is damaged)")
    records = schema.tensor_records(meta, TENSORS_KEY)
    extra, missing = sorted(set(raw) - set(records)), sorted(set(records) - set(raw))
    if extra or missing:
        raise ValueError(f"tensors differ from {TENSORS_KEY!r}: not listed {extra}, listed but absent {missing}")
    for name, t in raw.items():
        rec = records[name]
        got = {"dtype": schema.dtype_name(t.dtype), "shape": list(t.shape)}
        if got != {"dtype": rec["dtype"], "shape": rec["shape"]}:
            raise ValueError(f"tensor {name!r}: expected dtype {rec['dtype']}, shape {rec['shape']} (as recorded), "
                             f"got dtype {got['dtype']}, shape {got['shape']}")
    if verify:
        for name, crc in zip(raw, _crc32_all(list(raw.values())), strict=True):
            if crc != records[name]["crc32"]:
                raise ValueError(f"tensor {name!r}: checksum mismatch: expected CRC-32 {records[name]['crc32']}, "
                                 f"got {crc} (the data is damaged)")


#: files with less tensor data are checked on one thread (a pool costs more than it saves)
PARALLEL_CRC_BYTES = 64 * 2**20


def _crc32_all(tensors: list[torch.Tensor]) -> list[int]:
    """:func:`tensor_crc32` of each tensor, on several threads for a large file (zlib releases the GIL)."""
    workers = min(8, os.cpu_count() or 1)
    if workers == 1 or sum(t.numel() * t.element_size() for t in tensors) < PARALLEL_CRC_BYTES:
        return [tensor_crc32(t) for t in tensors]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(tensor_crc32, tensors))


def _assemble(weights: dict[str, dict], raw: dict[str, torch.Tensor]) -> dict:
    out: dict = {}
    for name, params in weights.items():
        missing = [p for p in PARTS if f"{name}.{p}" not in raw]
        if missing:
            raise ValueError(f"quantized weight {name!r} lacks tensors {missing}")
        parts = [raw.pop(f"{name}.{p}") for p in PARTS]
        try:
            out[name] = KbitWeight(*parts, **_params(params))
        except (TypeError, ValueError) as e:
            raise ValueError(f"quantized weight {name!r} does not match its metadata: {e}") from e
    out.update(raw)
    return out


def _check_padding(name: str, qw: KbitWeight) -> None:
    """Every padding column (K <= i < Kp) holds the code of 0.0, as the quantizer writes it: in a version 1 file
    (no metadata checksum) this catches a shape edited within the padding (``[8, 64] -> [8, 40]``)."""
    if qw.K == qw.padded_k:
        return
    pad = unpack(qw.codes, qw.k, qw.padded_k)[..., qw.K:]
    zero = int(torch.bucketize(torch.zeros(()), midpoints(qw.codebook), right=False))
    if bool((pad != zero).any()):
        raise ValueError(f"quantized weight {name!r}: the padding columns {qw.K}..{qw.padded_k - 1} hold codes other "
                         f"than that of 0.0 ({zero}): the recorded shape {list(qw.shape)} does not fit the data")

"""The schema of a kbit file's metadata (docs/format.md, "Files"): every entry's JSON types and ranges.

Each function raises ValueError saying which entry, what was expected and what came; :mod:`kbit.format.serialize`
adds the file's path.
"""

from __future__ import annotations

import json

import torch

from kbit.format.codebooks import NAMED
from kbit.format.spec import BLOCKSIZES, K_VALUES, MAX_ROTATION_BLOCK, MAX_ROTATION_SEED, ROTATION_KINDS, SCALE_FORMATS

#: the parameters of one quantized weight in ``kbit.weights``, all required
WEIGHT_FIELDS = ("blocksize", "codebook", "k", "scale_format", "shape")
#: a weight's optional parameters (absent: none; a weight without ``rotation`` is unrotated); no others
OPTIONAL_WEIGHT_FIELDS = ("rotation",)
#: a weight's ``rotation`` entry, all required
ROTATION_FIELDS = ("block", "kind", "seed")
#: codebook names a weight may record: the named codebooks and "custom" (values given by the user)
CODEBOOK_NAMES = (*NAMED, "custom")
#: one tensor's record in ``kbit.tensors``
TENSOR_FIELDS = ("crc32", "dtype", "shape")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def parse_json(meta: dict[str, str], key: str) -> dict:
    """The JSON object stored under ``key``; ValueError where it is missing, not JSON or not an object."""
    if key not in meta:
        raise ValueError(f"metadata lacks {key!r}")
    try:
        value = json.loads(meta[key])
    except json.JSONDecodeError as e:
        raise ValueError(f"metadata {key!r}: expected JSON, got a parse error: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"metadata {key!r}: expected a JSON object, got {type(value).__name__}")
    return value


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fields(where: str, entry, fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a JSON object, got {entry!r:.100}")
    if not set(fields) <= set(entry) <= set(fields) | set(optional):
        also = f" (optional fields: {list(optional)})" if optional else ""
        raise ValueError(f"{where}: expected the fields {list(fields)}, got {sorted(entry)}{also}")


def _shape(where: str, shape, minimum: int, min_dims: int) -> None:
    if not (isinstance(shape, list) and len(shape) >= min_dims and all(_int(s) and s >= minimum for s in shape)):
        raise ValueError(f"{where}: expected a list of at least {min_dims} ints >= {minimum}, got {shape!r:.100}")


def weights(meta: dict[str, str], key: str) -> dict[str, dict]:
    """``kbit.weights``: name -> {"k", "blocksize", "shape", "scale_format", "codebook"} and optionally
    "rotation" ({"kind", "seed", "block"}), every value checked."""
    out = parse_json(meta, key)
    for name, p in out.items():
        where = f"metadata {key!r}, weight {name!r}"
        if not name:
            raise ValueError(f"metadata {key!r}: expected non-empty weight names, got ''")
        _fields(where, p, WEIGHT_FIELDS, OPTIONAL_WEIGHT_FIELDS)
        if not _int(p["k"]) or p["k"] not in K_VALUES:
            raise ValueError(f"{where}: k: expected one of {K_VALUES}, got {p['k']!r}")
        if not _int(p["blocksize"]) or p["blocksize"] not in BLOCKSIZES:
            raise ValueError(f"{where}: blocksize: expected one of {BLOCKSIZES}, got {p['blocksize']!r}")
        if p["scale_format"] not in SCALE_FORMATS:
            raise ValueError(f"{where}: scale_format: expected one of {SCALE_FORMATS}, got {p['scale_format']!r}")
        if p["codebook"] not in CODEBOOK_NAMES:
            raise ValueError(f"{where}: codebook: expected one of {CODEBOOK_NAMES}, got {p['codebook']!r}")
        _shape(f"{where}: shape", p["shape"], 1, 2)
        if "rotation" in p:
            rotation(f"{where}: rotation", p["rotation"], p["shape"][-1])
    return out


def rotation(where: str, r, K: int) -> None:
    """A weight's ``rotation``: {"kind": "hadamard", "seed": int in [0, 2**63), "block": a power of two <=
    MAX_ROTATION_BLOCK dividing K}."""
    _fields(where, r, ROTATION_FIELDS)
    if r["kind"] not in ROTATION_KINDS:
        raise ValueError(f"{where}: kind: expected one of {ROTATION_KINDS}, got {r['kind']!r}")
    if not _int(r["seed"]) or not 0 <= r["seed"] <= MAX_ROTATION_SEED:
        raise ValueError(f"{where}: seed: expected an int in [0, 2**63), got {r['seed']!r}")
    b = r["block"]
    if not _int(b) or not 1 <= b <= MAX_ROTATION_BLOCK or b & (b - 1) or K % b:
        raise ValueError(f"{where}: block: expected a power of two <= {MAX_ROTATION_BLOCK} dividing K={K}, "
                         f"got {b!r}")


def tensor_records(meta: dict[str, str], key: str) -> dict[str, dict]:
    """``kbit.tensors``: name -> {"dtype", "shape", "crc32"}, every value checked."""
    out = parse_json(meta, key)
    for name, r in out.items():
        where = f"metadata {key!r}, tensor {name!r}"
        _fields(where, r, TENSOR_FIELDS)
        if not isinstance(r["dtype"], str):  # a torch dtype name; compared with the tensor's own
            raise ValueError(f"{where}: dtype: expected a dtype name, got {r['dtype']!r}")
        _shape(f"{where}: shape", r["shape"], 0, 0)
        if not _int(r["crc32"]) or not 0 <= r["crc32"] < 2**32:
            raise ValueError(f"{where}: crc32: expected an int in [0, 2**32), got {r['crc32']!r}")
    return out


def no_orphan_parts(weights: dict, tensors: dict, parts: tuple[str, ...]) -> None:
    """No prefix ``P`` has all of ``P.codes``, ``P.scales``, ... without an entry ``P`` in ``weights``: in a file
    without checksums (version 1) that is a deleted or damaged weights entry, not plain tensors."""
    first = f".{parts[0]}"
    for name in tensors:
        prefix = name[: -len(first)]
        if name.endswith(first) and prefix not in weights and all(f"{prefix}.{p}" in tensors for p in parts):
            raise ValueError(f"tensors {[f'{prefix}.{p}' for p in parts]} are the parts of a quantized weight "
                             f"{prefix!r} that the metadata's weights entry does not list (deleted or damaged)")

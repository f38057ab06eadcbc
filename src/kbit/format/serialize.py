"""Save and load state dicts holding :class:`KbitWeight` values to/from safetensors (format version 1).

A weight named ``P`` becomes the tensors ``P.codes``, ``P.scales``, ``P.tensor_scale``, ``P.codebook``;
the file metadata holds ``kbit.format_version`` and ``kbit.weights`` (JSON: ``P`` -> parameters).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as _save_file

from kbit.format.spec import FORMAT_VERSION, KbitWeight

VERSION_KEY = "kbit.format_version"
WEIGHTS_KEY = "kbit.weights"
PARTS = ("codes", "scales", "tensor_scale", "codebook")


def save_file(state_dict: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write ``state_dict`` (names -> KbitWeight or torch.Tensor) to a safetensors file at ``path``."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict: expected a dict, got {type(state_dict).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    weights: dict[str, dict] = {}
    for name, value in state_dict.items():
        if isinstance(value, KbitWeight):
            weights[name] = value.metadata()
            for part, t in value.tensors().items():
                tensors[f"{name}.{part}"] = t.detach().contiguous().cpu()
        elif isinstance(value, torch.Tensor):
            tensors[name] = value.detach().contiguous().cpu()
        else:
            raise TypeError(f"state_dict[{name!r}]: expected a KbitWeight or torch.Tensor, got {type(value).__name__}")
    clash = set(tensors).intersection(state_dict) - set(weights)
    if len(tensors) != len(set(tensors)) or any(k in weights for k in tensors):
        raise ValueError(f"state_dict: names collide with the parts of quantized weights: {sorted(clash)}")
    meta = dict(metadata or {})
    meta[VERSION_KEY] = str(FORMAT_VERSION)
    meta[WEIGHTS_KEY] = json.dumps(weights, sort_keys=True)
    _save_file(tensors, str(path), metadata=meta)


def load_file(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """Read a file written by :func:`save_file`: names -> KbitWeight or torch.Tensor, on ``device``.

    Raises ValueError for a missing/unknown format version, truncated or corrupt files, and tensors that do
    not match their recorded parameters.
    """
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            version = meta.get(VERSION_KEY)
            if version is None:
                raise ValueError(f"{path}: not a kbit file (metadata has no {VERSION_KEY!r})")
            if version != str(FORMAT_VERSION):
                raise ValueError(f"{path}: expected kbit format version {FORMAT_VERSION}, got {version!r}")
            weights = json.loads(meta.get(WEIGHTS_KEY, "{}"))
            raw = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    except SafetensorError as e:
        raise ValueError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from e
    out: dict = {}
    for name, params in weights.items():
        missing = [p for p in PARTS if f"{name}.{p}" not in raw]
        if missing:
            raise ValueError(f"{path}: quantized weight {name!r} lacks tensors {missing}")
        parts = {p: raw.pop(f"{name}.{p}") for p in PARTS}
        try:
            out[name] = KbitWeight(**parts, shape=tuple(params["shape"]), k=params["k"],
                                   blocksize=params["blocksize"], scale_format=params["scale_format"],
                                   codebook_name=params.get("codebook", "custom"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: quantized weight {name!r} does not match its metadata: {e}") from e
    out.update(raw)
    return out

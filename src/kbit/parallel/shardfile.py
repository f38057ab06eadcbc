"""One rank's file of a sharded checkpoint: a kbit format 2 safetensors file (``kbit.load_file`` reads it) written
tensor by tensor and read through a memory map, so that neither side ever holds the whole file.

Writing (:class:`ShardWriter`): the names, dtypes and shapes are known before any data (they follow from the plan),
so the file's offsets are laid out first (by alignment, then name: every tensor starts on a multiple of its element
size) and each tensor is written where it belongs when it is ready, its CRC-32 taken then. The header goes in last,
into space reserved for it: its checksums are known only at the end, and safetensors allows a header padded with
spaces. The file is written beside its name and renamed when complete.

Reading (:class:`ShardReader`): the header is parsed and checked (the coverage of the data, the kbit schema and the
metadata checksum, as ``kbit.format.serialize`` does); a tensor is a view of the memory-mapped file, its CRC-32
checked when it is read.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kbit.format import schema
from kbit.format.serialize import (
    METADATA_CRC_KEY,
    TENSORS_KEY,
    VERSION_KEY,
    WEIGHTS_KEY,
    metadata_crc32,
    tensor_crc32,
)
from kbit.format.spec import FORMAT_VERSION
from kbit.utils.checks import fail

__all__ = ["ShardReader", "ShardWriter"]

#: torch dtype <-> safetensors dtype name
_ST_DTYPES = {torch.int32: "I32", torch.uint8: "U8", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.float64: "F64", torch.int8: "I8", torch.int16: "I16",
              torch.bool: "BOOL"}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
#: the largest CRC-32, as a placeholder while the header's size is reserved
_MAX_CRC = 2**32 - 1


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = _itemsize(dtype)
    for s in shape:
        n *= s
    return n


class ShardWriter:
    """Write a kbit format 2 file at ``path`` whose tensors are ``specs`` (name -> (dtype, shape)), one
    :meth:`write` per tensor in any order, then :meth:`close` (returns the file's record for the index).

    ``weights``: the file's ``kbit.weights`` entries (a quantized weight ``P`` -> its parameters, its parts
    ``P.codes`` ... among ``specs``); ``metadata``: further metadata entries (str -> str). ``workers`` threads
    store the tensors and take their CRC-32 while the caller makes the next ones (zlib and ``os.pwrite`` release
    the GIL); at most ``2 * workers`` tensors wait in host memory. ``dry_run``: no file, only the checksums, so
    that :meth:`close` gives the record the file will have (for an index written before the file is).
    """

    def __init__(self, path, specs: dict[str, tuple[torch.dtype, tuple]], weights: dict[str, dict],
                 metadata: dict[str, str] | None = None, workers: int = 4, dry_run: bool = False):
        self.path = os.fspath(path)
        self.specs = {n: (d, tuple(int(s) for s in shape)) for n, (d, shape) in specs.items()}
        for n, (d, _) in self.specs.items():
            if d not in _ST_DTYPES:
                fail(TypeError, f"specs[{n!r}]", f"a dtype in {tuple(_ST_DTYPES)}", d)
        self.weights = weights
        self.extra = dict(metadata or {})
        order = sorted(self.specs, key=lambda n: (-_itemsize(self.specs[n][0]), n))
        self.offsets, end = {}, 0
        for n in order:
            size = _nbytes(*self.specs[n])
            self.offsets[n] = (end, end + size)
            end += size
        self.data_bytes = end
        self.crc: dict[str, int] = {}
        self.header_bytes = -(-len(self._header({n: _MAX_CRC for n in self.specs}, _MAX_CRC)) // 8) * 8
        folder = os.path.dirname(self.path) or "."
        self.tmp = os.path.join(folder, f".{os.path.basename(self.path)}.{uuid.uuid4().hex}.tmp")
        self.dry_run = bool(dry_run)
        self.file = None if self.dry_run else open(self.tmp, "wb")  # noqa: SIM115 (closed in close / abort)
        if self.file is not None:
            self.file.truncate(8 + self.header_bytes + self.data_bytes)
        self.workers = max(1, workers)
        self.pool = ThreadPoolExecutor(max_workers=self.workers)
        self.pending: deque = deque()

    def _metadata(self, crcs: dict[str, int]) -> dict[str, str]:
        meta = dict(self.extra)
        meta[VERSION_KEY] = str(FORMAT_VERSION)
        meta[WEIGHTS_KEY] = json.dumps(self.weights, sort_keys=True)
        meta[TENSORS_KEY] = json.dumps({n: {"dtype": schema.dtype_name(d), "shape": list(s), "crc32": crcs[n]}
                                        for n, (d, s) in self.specs.items()}, sort_keys=True)
        return meta

    def _header(self, crcs: dict[str, int], meta_crc: int | None = None) -> bytes:
        meta = self._metadata(crcs)
        meta[METADATA_CRC_KEY] = str(metadata_crc32(meta) if meta_crc is None else meta_crc)
        head = {"__metadata__": meta}
        for n, (d, s) in self.specs.items():
            head[n] = {"dtype": _ST_DTYPES[d], "shape": list(s), "data_offsets": list(self.offsets[n])}
        return json.dumps(head, separators=(",", ":")).encode()

    def write(self, name: str, t: torch.Tensor) -> None:
        """Write tensor ``name`` (any device; copied to the CPU here)."""
        if name not in self.specs:
            fail(KeyError, "name", f"one of the file's tensors ({len(self.specs)})", repr(name))
        if name in self.crc:
            fail(ValueError, "name", "a tensor not yet written", repr(name))
        dtype, shape = self.specs[name]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
            got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
            fail(ValueError, f"tensor {name!r}", f"dtype {dtype}, shape {shape}", got)
        self.crc[name] = None  # claimed; the CRC-32 comes with the store
        while len(self.pending) >= 2 * self.workers:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self._store, name, t.detach().contiguous().cpu()))

    def _store(self, name: str, t: torch.Tensor) -> None:
        if t.numel() and self.file is not None:
            data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            at, done = 8 + self.header_bytes + self.offsets[name][0], 0
            while done < len(data):
                done += os.pwrite(self.file.fileno(), data[done:], at + done)
        self.crc[name] = tensor_crc32(t)

    def _drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def close(self) -> dict:
        """Write the header, rename the file into place; returns ``{"file", "bytes", "metadata_crc32"}``."""
        try:
            self._drain()
        except BaseException:
            self.abort()
            raise
        missing = sorted(set(self.specs) - set(self.crc))
        if missing:
            self.abort()
            fail(ValueError, "ShardWriter", f"every tensor written before close ({len(missing)} missing)",
                 f"missing {missing[:5]}")
        meta = self._metadata(self.crc)
        meta_crc = metadata_crc32(meta)
        head = self._header(self.crc, meta_crc)
        head += b" " * (self.header_bytes - len(head))
        self.pool.shutdown()
        if self.file is not None:
            self.file.seek(0)
            self.file.write(self.header_bytes.to_bytes(8, "little"))
            self.file.write(head)
            self.file.close()
            os.replace(self.tmp, self.path)
        return {"file": os.path.basename(self.path), "bytes": 8 + self.header_bytes + self.data_bytes,
                "metadata_crc32": meta_crc}

    def abort(self) -> None:
        """Close and delete the unfinished file."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pending.clear()
        if self.file is not None and not self.file.closed:
            self.file.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


class ShardReader:
    """A file written by :class:`ShardWriter` (or any kbit format 2 file), memory-mapped: :meth:`get` returns a
    tensor viewing the file (CRC-32 checked), ``records`` the ``kbit.tensors`` entries, ``weights`` the
    ``kbit.weights`` ones, ``metadata`` the rest. ValueError naming the file for anything damaged."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 2 <= n <= size - 8:
                    raise ValueError(f"header length {n} does not fit the file's {size} bytes")
                head = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: cannot read the safetensors header (truncated or damaged?): {e}") from e
        if not isinstance(head, dict):
            raise ValueError(f"{self.path}: expected a JSON object header, got {type(head).__name__}")
        self.metadata = head.pop("__metadata__", None) or {}
        self.start = 8 + n
        self.entries = head
        self._check_layout(size)
        self._check_metadata()
        self._map = np.memmap(self.path, dtype=np.uint8, mode="c") if size > self.start else None

    def _check_layout(self, size: int) -> None:
        spans = []
        for name, e in self.entries.items():
            if not isinstance(e, dict) or e.get("dtype") not in _TORCH_DTYPES or \
                    not isinstance(e.get("data_offsets"), list) or len(e["data_offsets"]) != 2:
                raise ValueError(f"{self.path}: tensor {name!r}: malformed header entry {e!r:.200}")
            a, b = e["data_offsets"]
            if b - a != _nbytes(_TORCH_DTYPES[e["dtype"]], e["shape"]):
                raise ValueError(f"{self.path}: tensor {name!r}: {b - a} bytes for shape {e['shape']}")
            spans.append((a, b))
        end = 0
        for a, b in sorted(spans):
            if a != end:
                raise ValueError(f"{self.path}: the tensors' data has a hole or an overlap at byte {end}")
            end = b
        if self.start + end != size:
            raise ValueError(f"{self.path}: expected {self.start + end} bytes (header and data), got {size} "
                             "(truncated or extended)")

    def _check_metadata(self) -> None:
        meta = self.metadata
        try:
            if meta.get(VERSION_KEY) != str(FORMAT_VERSION):
                raise ValueError(f"expected kbit format version {FORMAT_VERSION}, got {meta.get(VERSION_KEY)!r}")
            if meta.get(METADATA_CRC_KEY) != str(metadata_crc32(meta)):
                raise ValueError(f"metadata checksum mismatch: expected {meta.get(METADATA_CRC_KEY)}, got "
                                 f"{metadata_crc32(meta)} (the file is damaged)")
            self.records = schema.tensor_records(meta, TENSORS_KEY)
            self.weights = schema.weights(meta, WEIGHTS_KEY)
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from e
        if set(self.records) != set(self.entries):
            raise ValueError(f"{self.path}: the header's tensors differ from {TENSORS_KEY!r}")
        for name, r in self.records.items():
            e = self.entries[name]
            if r["dtype"] != schema.dtype_name(_TORCH_DTYPES[e["dtype"]]) or r["shape"] != e["shape"]:
                raise ValueError(f"{self.path}: tensor {name!r}: recorded {r['dtype']} {r['shape']}, stored "
                                 f"{e['dtype']} {e['shape']}")

    @property
    def metadata_crc32(self) -> int:
        return int(self.metadata[METADATA_CRC_KEY])

    def get(self, name: str, verify: bool = True) -> torch.Tensor:
        """Tensor ``name`` as a view of the mapped file (copy it to keep it past the reader); with ``verify`` its
        CRC-32 is checked (ValueError naming the file and tensor where it differs)."""
        if name not in self.entries:
            fail(KeyError, "name", f"a tensor of {self.path}", repr(name))
        e = self.entries[name]
        dtype, (a, b) = _TORCH_DTYPES[e["dtype"]], e["data_offsets"]
        if a == b:
            t = torch.empty(e["shape"], dtype=dtype)
        else:
            t = torch.from_numpy(self._map[self.start + a: self.start + b]).view(dtype).view(e["shape"])
        if verify and tensor_crc32(t) != self.records[name]["crc32"]:
            raise ValueError(f"{self.path}: tensor {name!r}: checksum mismatch: expected CRC-32 "
                             f"{self.records[name]['crc32']}, got {tensor_crc32(t)} (the data is damaged)")
        return t

"""Which kernel code a tuned time was measured on: a digest per candidate family of the package files that time
depends on (the family's kernels, with the CUDA headers they include, and the Python that plans and launches them).

``kbit tune`` records the digests of the families it timed in each entry of a tuned table (``"code"``); an entry
whose digests no longer match this kbit's files, or that recorded none (tables tuned before the digests existed),
is *stale*: its times, and so its pick, may not hold for the kernels that now run (``kbit tune --retune-stale``
measures such entries again; ``kbit tune --fit`` counts them). The dispatcher still uses stale entries: a pick
measured on an older kernel is usually still a good one, and the built-in rules are no fresher.
"""
from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

__all__ = ["CODE_FILES", "code_digest", "code_files", "family_digests"]

#: the package (``src/kbit``) the paths below are relative to
PACKAGE = Path(__file__).resolve().parent.parent
#: per candidate family (``kbit.tuning.space.FAMILIES``): the files its time depends on (a CUDA source brings the
#: headers it includes)
CODE_FILES = {
    "mma": ("cuda/csrc/gemv_mma_split.cu", "cuda/csrc/gemv_mma_streamk.cu", "cuda/csrc/mma_pipe.cu",
            "tuning/mma_plan.py", "tuning/mma_units.py", "ops/gemv_mma.py", "ops/mma/common.py"),
    "large": ("cuda/csrc/wgmma.cu", "cuda/csrc/x_tiles.cu", "tuning/mma_plan.py", "ops/gemv_mma.py",
              "ops/mma/common.py"),
    "fused": ("kernels/gemm.py", "ops/gemm.py", "tuning/gemm.py"),
    "gemv": ("kernels/gemv.py", "kernels/gemv_ptx.py", "ops/gemv.py", "tuning/gemv.py"),
    "dequant_mm": ("cuda/csrc/dequant.cu", "kernels/dequant.py", "ops/dequant.py"),
}
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def code_files(family: str, root: Path | None = None) -> list[str]:
    """The files of ``family`` (:data:`CODE_FILES`) with the headers their CUDA sources include, sorted."""
    if family not in CODE_FILES:
        raise ValueError(f"family: expected one of {sorted(CODE_FILES)}, got {family!r}")
    root = PACKAGE if root is None else root
    out, todo = set(), list(CODE_FILES[family])
    while todo:
        rel = todo.pop()
        if rel in out:
            continue
        out.add(rel)
        if rel.endswith((".cu", ".cuh")):
            text = (root / rel).read_text()
            todo += [str(Path(rel).parent / h) for h in _INCLUDE.findall(text)]
    return sorted(out)


def code_digest(family: str, root: Path | None = None) -> str:
    """16 hex digits of SHA-256 over ``family``'s files (paths and bytes)."""
    root = PACKAGE if root is None else root
    h = hashlib.sha256()
    for rel in code_files(family, root):
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def _installed(family: str) -> str:
    return code_digest(family)


def family_digests(families) -> dict[str, str]:
    """``{family: digest}`` of this kbit's files for the given families (cached: the installed files do not change
    while a process runs)."""
    return {f: _installed(f) for f in sorted(set(families))}

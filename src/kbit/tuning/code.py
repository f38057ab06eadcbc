"""Which kernel code a tuned time was measured on: a digest per candidate family of the package files that time
depends on (the family's kernels, with the CUDA headers they include, and the Python that plans and launches them).

``kbit tune`` records the digests of the families it timed in each entry of a tuned table (``"code"``); an entry
whose digests no longer match this kbit's files, or that recorded none (tables tuned before the digests existed),
is *stale*: its times, and so its pick, may not hold for the kernels that now run (``kbit tune --retune-stale``
measures such entries again; ``kbit tune --fit`` counts them). The dispatcher still uses stale entries: a pick
measured on an older kernel is usually still a good one, and the built-in rules are no fresher.

The digest covers what the code does, not how it is written down, so that a comment, a docstring or a reformat
does not stale every entry of a family (with a digest of the raw bytes, any edit did: every entry of both shipped
tables read as stale, and ``--retune-stale`` meant retuning everything):

- CUDA sources (``.cu``, ``.cuh``): continued lines joined, ``//`` and ``/* */`` comments removed (not inside string
  or character literals, such as inline asm), each run of whitespace outside literals one space, except that a
  preprocessor line (``#define``, ``#if``) keeps its own line, since a line break ends it. Literals stay as
  written, whitespace included.
- Python: the parsed module (``ast``) without docstrings (a first string statement of a module, class or function
  body) and without line and column numbers, written out as ``ast.dump`` would without the fields a node leaves
  empty (:func:`_dump`).

Anything else still changes the digest, even where the compiled kernel would not change (a renamed local, an
added space between two tokens): the digest errs towards stale. Tables written before this scheme recorded digests
of the raw bytes, which never equal these: their entries read as stale, the conservative answer
(``lab/suite/redigest.py`` carries an entry over to this scheme where its old digest is that of a commit's files).
"""
from __future__ import annotations

import ast
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
    """16 hex digits of SHA-256 over ``family``'s files: their paths and what they do (:func:`_normalized`)."""
    root = PACKAGE if root is None else root
    h = hashlib.sha256()
    for rel in code_files(family, root):
        h.update(rel.encode() + b"\0" + _normalized(rel, (root / rel).read_bytes()) + b"\0")
    return h.hexdigest()[:16]


def _normalized(rel: str, data: bytes) -> bytes:
    """The part of the file ``rel`` (its bytes ``data``) the digest covers (see the module docstring): CUDA without
    comments and layout, Python as its syntax tree without docstrings, any other file as it is."""
    if rel.endswith((".cu", ".cuh")):
        return _cuda(data.decode()).encode()
    if rel.endswith(".py"):
        return _python(data.decode()).encode()
    return data


# A comment, or a string or character literal, whichever starts first: a literal is taken whole, so a "//" inside
# an asm string is no comment, and a comment whole, so a quote in it ("a warp's") opens no literal. A literal ends
# at its line's end where it is not closed (it cannot span lines), so a stray quote cannot swallow the file.
_CUDA_SKIP = re.compile(r'//[^\n]*|/\*.*?(?:\*/|\Z)|"(?:\\.|[^"\\\n])*"?|\'(?:\\.|[^\'\\\n])*\'?', re.S)


def _cuda(text: str) -> str:
    # Continued lines are joined before anything else, as the preprocessor does: a macro's line breaks move freely
    text = text.replace("\r\n", "\n").replace("\\\n", "")
    out, pos = [], 0
    for m in _CUDA_SKIP.finditer(text):
        out.append(re.sub(r"[^\S\n]+", " ", text[pos:m.start()]))
        # a comment is one space (it separates tokens, "a/**/b" is two); a literal is kept as written
        out.append(" " if m.group().startswith("/") else m.group())
        pos = m.end()
    out.append(re.sub(r"[^\S\n]+", " ", text[pos:]))
    # Literals hold no line break, so the breaks left are between code. A line break ends a preprocessor line
    # (#define, #if): those keep theirs; elsewhere it is one more space, so a statement wrapped anew counts the same.
    lines, run = [], []
    for line in "".join(out).split("\n"):
        line = line.strip()
        if line.startswith("#"):
            lines += [" ".join(run), line] if run else [line]
            run = []
        elif line:
            run.append(line)
    return "\n".join(lines + [" ".join(run)] if run else lines)


def _python(text: str) -> str:
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                node.body = node.body[1:]
    return _dump(tree)


def _dump(node) -> str:
    """``ast.dump(node)`` (no positions) without the fields a node leaves empty (None, []). ``ast.dump`` itself
    differs between Pythons (3.12 lists ``type_params=[]`` on every def, 3.13 leaves empty fields out), and a table
    tuned under one Python is read under others: a field a newer Python adds empty leaves this form as it was."""
    if isinstance(node, ast.AST):
        fields = ", ".join(f"{name}={_dump(v)}" for name, v in ast.iter_fields(node) if v is not None and v != [])
        return f"{type(node).__name__}({fields})"
    if isinstance(node, list):
        return "[" + ", ".join(_dump(v) for v in node) + "]"
    return repr(node)


@functools.cache
def _installed(family: str) -> str:
    return code_digest(family)


def family_digests(families) -> dict[str, str]:
    """``{family: digest}`` of this kbit's files for the given families (cached: the installed files do not change
    while a process runs)."""
    return {f: _installed(f) for f in sorted(set(families))}

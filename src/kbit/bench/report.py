"""Benchmark results: the JSON row schema, the results file, and the markdown table made from it.

A results file is ``benchmarks/results/<gpu-slug>/<name>-<date>.json``::

    {"header": {"gpu", "gpu_name", "date", "commit", "command", "torch", "triton", "l2_bytes",
                "ceiling_tbps", ...},
     "rows": [ROW, ...]}

Every ROW has the keys of ``ROW_FIELDS`` (types as listed; a missing measurement is ``null``); rows may
carry more keys (``REQUIRED`` is a floor, not a ceiling). ``kernel`` is the name of what was timed:
``bf16`` (cuBLAS ``F.linear`` / ``torch._grouped_mm`` on the dequantized weight), a kbit candidate
(``kbit.bench.registry``), or a peer (``humming``, ``tinygemm``, ``bitsandbytes``, ``gemlite``).

Render a table from a file with ``kbit bench --table FILE`` or ``python -m kbit.bench.report FILE``.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

# name -> allowed types; None is allowed for every measured quantity (a skipped or failed measurement)
ROW_FIELDS: dict[str, tuple[type, ...]] = {
    "gpu": (str,),
    "commit": (str,),
    "kernel": (str,),
    "k": (int,),             # bits per weight code; 16 for the bf16 baseline
    "blocksize": (int,),     # weights sharing one scale (the peer's group size for peers); 0 for bf16
    "dtype": (str,),         # activation dtype
    "N": (int,),
    "K": (int,),
    "M": (int,),             # activation rows (tokens for MoE)
    "E": (int,),             # experts in the weight stack; 1 for a dense layer
    "us": (float, type(None)),
    "bf16_us": (float, type(None)),
    "tbps": (float, type(None)),
    "ceiling_tbps": (float, type(None)),
    "bytes": (int,),         # bytes the call must read: weight (touched experts only) + activations
}
REQUIRED = tuple(ROW_FIELDS)
HEADER_FIELDS = ("gpu", "gpu_name", "date", "commit", "command", "torch", "triton")

_KNOWN_GPUS = ("gh200", "gb200", "h100", "h200", "h800", "h20", "b200", "b100", "a100", "a800", "a10g", "a10",
               "l40s", "l40", "l4", "t4", "v100")


def gpu_slug(name: str) -> str:
    """A short folder name for a GPU: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``.

    Known data-center parts map to their model name; anything else to its lowercased name with runs of
    other characters replaced by ``-`` (``"NVIDIA GeForce RTX 4090"`` -> ``"nvidia-geforce-rtx-4090"``).
    """
    low = name.lower()
    for part in _KNOWN_GPUS:
        if re.search(rf"(?<![a-z0-9]){part}(?![a-z0-9])", low):
            return part
    slug = re.sub(r"[^a-z0-9]+", "-", low).strip("-")
    return slug or "unknown-gpu"


def git_commit(repo: str | Path | None = None) -> str:
    """The short commit of ``repo`` (default: this file's checkout), ``+dirty`` if the tree has changes;
    ``"unknown"`` outside a git checkout (as on a machine that got a copy of the tree without .git)."""
    cwd = Path(repo) if repo else Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def validate_row(row: dict) -> None:
    """Raises ValueError naming the first key that is missing or has the wrong type."""
    for key, types in ROW_FIELDS.items():
        if key not in row:
            raise ValueError(f"result row lacks {key!r}: {row}")
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, types):
            want = " or ".join(t.__name__ for t in types)
            got = type(value).__name__
            raise ValueError(f"result row key {key!r}: expected {want}, got {got} ({value!r})")


def results_path(out_dir: str | Path, gpu: str, name: str = "bench", date: str | None = None) -> Path:
    """``out_dir/<gpu-slug>/<name>-<date>.json``; ``-2``, ``-3``... appended if that file exists."""
    date = date or _dt.date.today().isoformat()
    folder = Path(out_dir) / gpu_slug(gpu)
    path = folder / f"{name}-{date}.json"
    i = 2
    while path.exists():
        path = folder / f"{name}-{date}-{i}.json"
        i += 1
    return path


def write_results(path: str | Path, header: dict, rows: Sequence[dict]) -> Path:
    """Validates ``rows`` and writes ``{"header", "rows"}`` to ``path`` (folders created)."""
    for row in rows:
        validate_row(row)
    missing = [k for k in HEADER_FIELDS if k not in header]
    if missing:
        raise ValueError(f"results header lacks {missing}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _finite({"header": header, "rows": list(rows)})
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    return path


def _finite(obj):
    """NaN and infinities become null (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def read_results(path: str | Path) -> tuple[dict, list[dict]]:
    """Reads a results file; returns (header, rows). A file that is missing, not JSON or not a results object is a
    ``FileNotFoundError`` / ``ValueError`` naming it."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: expected a kbit bench results JSON file, got no such file")
    try:
        data = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: expected a kbit bench results JSON file, got unreadable JSON ({e})") from e
    if not isinstance(data, dict) or "rows" not in data:
        raise ValueError(f"{path}: expected an object with 'header' and 'rows'")
    return data.get("header", {}), data["rows"]


def _num(v, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def _ratio(a, b) -> float | None:
    return a / b if a and b else None


def _shape(row: dict) -> str:
    s = f"{row['N']}x{row['K']}"
    return s if row.get("E", 1) == 1 else f"{row['E']}x{s}"


def _order(row: dict):
    return (row.get("E", 1) != 1, row.get("E", 1), -row["N"] * row["K"], row["N"], row["K"], row["M"],
            row["kernel"] != "bf16", row["k"], row["kernel"], row["blocksize"])


def markdown_table(rows: Iterable[dict], header: dict | None = None) -> str:
    """Renders result rows as a markdown table, grouped by shape then M, bf16 first in each group.

    Columns: kernel, k, blocksize, shape (``N x K``, ``E x N x K`` for expert stacks), M, us, bf16 us,
    speed-up over bf16, TB/s, fraction of the read ceiling, roofline us (bytes / ceiling), MB read, error.
    """
    rows = sorted(rows, key=_order)
    lines = []
    if header:
        ceil = header.get("ceiling_tbps")
        gpu = header.get("gpu_name", header.get("gpu", "?"))
        lines.append(f"GPU: {gpu}; commit {header.get('commit', '?')}; "
                     f"{header.get('date', '?')}; torch {header.get('torch', '?')}, triton "
                     f"{header.get('triton', '?')}; read ceiling {_num(ceil, '.2f')} TB/s "
                     f"(sum over {_num((header.get('ceiling_bytes') or 0) / 1e9, '.1f')} GB); cold L2, "
                     f"CUDA-graph replay, median of {header.get('reps', '?')}.")
        lines.append("")
    lines.append("| kernel | k | B | N x K | M | us | bf16 us | x bf16 | TB/s | % ceiling | roofline us | MB "
                 "| err |")
    lines.append("|---|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        ceil = r.get("ceiling_tbps")
        frac = _ratio(r.get("tbps"), ceil)
        roof = r["bytes"] / (ceil * 1e12) * 1e6 if ceil else None
        mode = "" if r.get("mode", "graph") == "graph" else f" ({r['mode']})"
        lines.append(
            f"| {r['kernel']}{mode} | {r['k']} | {r['blocksize'] or '-'} | {_shape(r)} | {r['M']} | "
            f"{_num(r.get('us'), '.2f')} | {_num(r.get('bf16_us'), '.2f')} | "
            f"{_num(_ratio(r.get('bf16_us'), r.get('us')), '.2f')} | {_num(r.get('tbps'), '.2f')} | "
            f"{_num(frac * 100 if frac else None, '.0f')} | {_num(roof, '.2f')} | {r['bytes'] / 1e6:.2f} | "
            f"{_num(r.get('err'), '.1e')} |")
    skipped = header.get("skipped") if header else None
    if skipped:
        lines.append("")
        lines.append("Not measured: " + "; ".join(skipped))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kbit.bench.report FILE...``: prints the markdown table of each results file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m kbit.bench.report RESULTS.json [...]", file=sys.stderr)
        return 2
    for path in argv:
        header, rows = read_results(path)
        print(markdown_table(rows, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

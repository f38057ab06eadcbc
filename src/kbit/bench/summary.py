"""The per-family summary of a suite run (``kbit bench --suite models``), its CSV and its plot.

Every result row is attributed to each suite layer with its ``(E, N, K)`` (a shape several models share is timed
once and counts for each). Per (family, M, k) the summary gives, over the family's layers:

- ``kbit``: the dispatcher's time (row ``kbit-linear``); the fastest kbit candidate's only in rows that hold no
  dispatcher time at all (a run of chosen candidates). A point whose dispatcher row is missing from a run that timed
  the dispatcher elsewhere (a run cut short by ``--budget-s``) counts for nothing: the candidates timed before the
  cut are not the dispatcher's pick;
- ``x_humming``: humming's time at the same k / kbit's (above 1: kbit faster), median and worst (smallest);
- ``x_bf16``: bf16 cuBLAS time / kbit's, median and worst;
- ``disp_best``: the dispatcher's time / the fastest kbit candidate's (1.0: it picked the fastest), worst (largest).

Render it with ``kbit bench --summary RESULTS_JSON`` (no GPU needed).
"""
from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from kbit.bench.peers import PEERS
from kbit.bench.report import ROW_FIELDS
from kbit.bench.suite import Layer, split_of

__all__ = ["DISPATCHER", "kbit_times", "plot", "summarize", "summarize_times", "summary_markdown", "with_halves",
           "write_csv"]

DISPATCHER = "kbit-linear"
#: kernels that are not kbit candidates
_NOT_KBIT = {"bf16", "read", *PEERS}


def write_csv(path: str | Path, rows: Sequence[dict]) -> Path:
    """The rows as CSV: the schema's keys first (``kbit.bench.report.ROW_FIELDS``), then the others sorted; nested
    values (dicts, lists) are left out."""
    extra = sorted({k for r in rows for k, v in r.items() if k not in ROW_FIELDS and not isinstance(v, dict | list)})
    keys = list(ROW_FIELDS) + extra
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in keys})
    return path


def _key(r: dict) -> tuple:
    return r.get("E", 1), r["N"], r["K"], r["M"]


def kbit_times(rows: Iterable[dict]) -> dict[tuple, dict]:
    """(E, N, K, M, k) -> {"disp": us of the dispatcher or None, "best": the fastest kbit candidate's us, "best_name",
    "bf16": us, "humming": us at that k or None, "kbit": the time the summary calls kbit's (the dispatcher's; the
    fastest candidate's only where no row is the dispatcher's) or None}."""
    out: dict[tuple, dict] = defaultdict(lambda: dict(disp=None, best=None, best_name=None, bf16=None, humming=None))
    bf16: dict[tuple, float] = {}
    for r in rows:
        if r.get("us") is None:
            continue
        if r["kernel"] == "bf16":
            bf16[_key(r)] = r["us"]
            continue
        if r["kernel"] == "read":
            continue
        d = out[(*_key(r), r["k"])]
        if r["kernel"] == "humming":
            d["humming"] = r["us"]
        elif r["kernel"] not in _NOT_KBIT:
            if r["kernel"] == DISPATCHER:
                d["disp"] = r["us"]
            if d["best"] is None or r["us"] < d["best"]:
                d["best"], d["best_name"] = r["us"], r["kernel"]
    has_disp = any(d["disp"] is not None for d in out.values())
    for key, d in out.items():
        d["bf16"] = bf16.get(key[:4])
        d["kbit"] = d["disp"] if has_disp else d["best"]
    return dict(out)


def with_halves(layers: Sequence[Layer], models=None) -> list[Layer]:
    """``layers`` plus one layer per distinct shape of each half of the suite, under the family names ``[tune]`` and
    ``[held-out]`` (a shape of both halves counts for the tune half only), so that the summary has a row per half."""
    halves = split_of(models)
    out, seen = list(layers), set()
    for half in ("tune", "held-out"):
        for lay in layers:
            key = (lay.E, lay.N, lay.K)
            if halves.get(lay.family) == half and key not in seen:
                seen.add(key)
                out.append(Layer(lay.model, f"[{half}]", lay.name, lay.N, lay.K, lay.E, lay.topk))
    return out


def _stats(values: list[float], worst=min) -> tuple[float | None, float | None]:
    return (statistics.median(values), worst(values)) if values else (None, None)


def summarize(rows: Iterable[dict], layers: Sequence[Layer]) -> list[dict]:
    """One dict per (family, M, k) with the statistics of the module docstring and ``n`` (layers with a kbit time)."""
    return summarize_times(kbit_times(rows), layers)


def summarize_times(times: dict, layers: Sequence[Layer]) -> list[dict]:
    """:func:`summarize` of :func:`kbit_times` (e.g. merged from several runs, each point's times from one run)."""
    acc: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    by_shape: dict[tuple, list[Layer]] = defaultdict(list)
    for lay in layers:
        by_shape[(lay.E, lay.N, lay.K)].append(lay)
    for (E, N, K, M, k), d in times.items():
        kb = d["kbit"]
        if kb is None:
            continue
        for lay in by_shape.get((E, N, K), ()):
            a = acc[(lay.family, M, k)]
            a["n"].append(1)
            if d["humming"]:
                a["x_humming"].append(d["humming"] / kb)
            if d["bf16"]:
                a["x_bf16"].append(d["bf16"] / kb)
            if d["disp"] is not None and d["best"]:
                a["disp_best"].append(d["disp"] / d["best"])
    out = []
    for (fam, M, k), a in sorted(acc.items()):
        hm, hw = _stats(a["x_humming"])
        bm, bw = _stats(a["x_bf16"])
        _, dw = _stats(a["disp_best"], worst=max)
        out.append(dict(family=fam, M=M, k=k, n=len(a["n"]), x_humming_median=hm, x_humming_worst=hw,
                        x_bf16_median=bm, x_bf16_worst=bw, disp_best_worst=dw))
    return out


def _f(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _cell(med, worst) -> str:
    return "-" if med is None else f"{med:.2f} ({worst:.2f})"


def summary_markdown(summary: Sequence[dict], header: dict | None = None) -> str:
    """The summary as a markdown table, one row per (family, M): per k the ratio to humming and to bf16 as
    "median (worst)", the layers counted, and the dispatcher's worst ratio to the fastest kbit candidate."""
    ks = sorted({s["k"] for s in summary})
    rows: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for s in summary:
        rows[(s["family"], s["M"])][s["k"]] = s
    lines = []
    if header:
        lines += [f"GPU: {header.get('gpu_name', header.get('gpu', '?'))}; commit {header.get('commit', '?')}; "
                  f"{header.get('date', '?')}; `{header.get('command', '')}`", ""]
    lines += ["Ratios are time of the other / time of kbit (above 1: kbit faster), median (worst) over the family's "
              "layers; kbit is the dispatcher (`kbit-linear`).", ""]
    head = ["family", "M", "layers"] + [f"x humming k={k}" for k in ks] + [f"x bf16 k={k}" for k in ks]
    lines += ["| " + " | ".join(head + ["dispatcher / best kbit (worst)"]) + " |",
              "|---|" + "--:|" * (len(head) - 1 + 1)]
    for (fam, M), by_k in sorted(rows.items(), key=lambda kv: (kv[0][0].startswith("["), kv[0])):  # halves last
        n = max(s["n"] for s in by_k.values())
        hum = [_cell(by_k[k]["x_humming_median"], by_k[k]["x_humming_worst"]) if k in by_k else "-" for k in ks]
        bf = [_cell(by_k[k]["x_bf16_median"], by_k[k]["x_bf16_worst"]) if k in by_k else "-" for k in ks]
        disp = [s["disp_best_worst"] for s in by_k.values() if s["disp_best_worst"] is not None]
        lines.append("| " + " | ".join([fam, str(M), str(n)] + hum + bf + [_f(max(disp) if disp else None, ".3f")])
                     + " |")
    return "\n".join(lines) + "\n"


def plot(summary: Sequence[dict], path: str | Path, title: str = "") -> Path | None:
    """Speed-up over bf16 (median over the family's layers) against M, one line per family, one panel per k, as a
    PNG; None when matplotlib is missing."""
    try:  # matplotlib is optional: no plot without it
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ks = sorted({s["k"] for s in summary})
    if not ks:
        return None
    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 4), squeeze=False, sharey=True)
    for ax, k in zip(axes[0], ks, strict=True):
        for fam in sorted({s["family"] for s in summary}):
            pts = sorted((s["M"], s["x_bf16_median"]) for s in summary
                         if s["k"] == k and s["family"] == fam and s["x_bf16_median"] is not None)
            if pts:  # the rows of the suite's halves dashed, over the families
                style = dict(ls="--", color="k" if fam == "[tune]" else "0.5", lw=2) if fam.startswith("[") else {}
                ax.plot(*zip(*pts, strict=True), marker="o", label=fam, **style)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"k = {k}")
        ax.set_xlabel("M (rows)")
    axes[0][0].set_ylabel("speed-up over bf16 (median of layers)")
    axes[0][-1].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

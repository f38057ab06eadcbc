"""PNG plots for docs/analysis.md (needs the ``plot`` extra: matplotlib)."""

from __future__ import annotations

from pathlib import Path

from kbit.analyze.report import GEMV_KBIT_KERNELS, MMA_KERNEL, SWEEP_KBIT_KERNELS

COLORS = {MMA_KERNEL: "C5", "gemv": "C0", "gemm-fused": "C1", "dequant+cublas": "C2", "kbit-linear": "C3",
          "gemm-fused(cfg0)": "C1", "gemm-fused(cfg1)": "C4"}
STYLES = {2: "-", 3: ":", 4: "--", 5: "-."}
MARKERS = {2: "o", 3: "^", 4: "s", 5: "D"}


def _plt():
    # matplotlib is optional (the plot extra): imported only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _speedup_axis(ax, shape) -> None:
    """Log-log speedup-vs-M axes of one weight shape, with the parity line."""
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_title(f"{shape[0]}x{shape[1]} (N x K)", fontsize=9)
    ax.set_xlabel("M (tokens)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, which="major", alpha=0.3)


def _finish(plt, fig, axes, used: int, ylabel: str, title: str, path) -> Path:
    """Blank the unused panels, one de-duplicated legend, title, save as PNG."""
    for ax in axes.flat[used:]:
        ax.axis("off")
    axes[0][0].set_ylabel(ylabel, fontsize=8)
    handles: dict = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    labels = sorted(handles)
    fig.legend([handles[x] for x in labels], labels, loc="lower right", fontsize=6, ncol=2, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def speedup_series(gemv: dict | None, lab: dict | None, mma: list[dict] | None = None) -> dict:
    """-> {(N, K): {(kernel, k): {M: bf16_us / us}}} from the files (dense rows only); each ratio within one
    row of one run. ``mma``: mma lab files; only their ``kind == "mma"`` fp16 rows carry a bf16 time."""
    out: dict = {}
    for data in mma or ():
        for r in data.get("rows", []):
            if r.get("kind") != "mma" or r.get("dtype", "float16") != "float16" or not r.get("bf16_us"):
                continue
            out.setdefault((int(r["N"]), int(r["K"])), {}).setdefault((MMA_KERNEL, int(r["k"])), {})[
                int(r["M"])] = float(r["bf16_us"]) / float(r["us"])
    for data, is_lab in ((gemv, False), (lab, True)):
        if not data:
            continue
        for r in data["rows"]:
            if r.get("E", 1) != 1 or not r.get("us") or not r.get("bf16_us"):
                continue
            name = SWEEP_KBIT_KERNELS.get(r.get("what")) if is_lab else r.get("kernel")
            if not name or (not is_lab and name not in (*GEMV_KBIT_KERNELS, "kbit-linear")):
                continue
            out.setdefault((int(r["N"]), int(r["K"])), {}).setdefault((name, int(r["k"])), {})[int(r["M"])] = \
                float(r["bf16_us"]) / float(r["us"])
    return out


def plot_speedup(gemv: dict | None, lab: dict | None, path: str | Path, mma: list[dict] | None = None) -> Path:
    plt = _plt()
    series = speedup_series(gemv, lab, mma)
    shapes = sorted(series, key=lambda s: -s[0] * s[1])
    ncols = min(3, len(shapes)) or 1
    nrows = (len(shapes) + ncols - 1) // ncols or 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False, sharey=True)
    for ax, shape in zip(axes.flat, shapes, strict=False):
        for (name, k), pts in sorted(series[shape].items()):
            ms = sorted(pts)
            ax.plot(ms, [pts[m] for m in ms], color=COLORS.get(name, "k"), ls=STYLES.get(k, "-"),
                    marker=MARKERS.get(k, "."), ms=3, lw=1, label=f"{name} k={k}")
        _speedup_axis(ax, shape)
    return _finish(plt, fig, axes, len(shapes), "speedup vs bf16 cuBLAS",
                   "kbit kernels vs bf16 on H100, each vs its own run's bf16 (M <= 8: kbit bench; M >= 16: "
                   "gemm-lab; mma: mma lab sweep)", path)


def plot_best(rep: dict, path: str | Path) -> Path:
    """Best measured kbit option per (shape, k, M) vs the report's bf16 baseline (the ``best`` table)."""
    plt = _plt()
    by: dict = {}
    for r in rep["best"]:
        if r.get("speedup"):
            by.setdefault((r["N"], r["K"]), {}).setdefault(r["k"], {})[r["M"]] = (r["speedup"], r["kernel"])
    shapes = sorted(by, key=lambda s: -s[0] * s[1])
    ncols = min(3, len(shapes)) or 1
    nrows = (len(shapes) + ncols - 1) // ncols or 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False, sharey=True)
    for ax, shape in zip(axes.flat, shapes, strict=False):
        for k, pts in sorted(by[shape].items()):
            ms = sorted(pts)
            ax.plot(ms, [pts[m][0] for m in ms], color="grey", ls=STYLES.get(k, "-"), lw=0.8)
            for m in ms:
                ax.plot([m], [pts[m][0]], color=COLORS.get(pts[m][1], "k"), marker=MARKERS.get(k, "."), ms=4,
                        ls="none", label=f"{pts[m][1]} (k={k})")
        _speedup_axis(ax, shape)
    return _finish(plt, fig, axes, len(shapes), "best kbit speedup vs bf16",
                   "Best measured kbit option per (shape, k, M) on H100 (marker colour = option; "
                   "report's bf16 baseline)", path)


def plot_quality(quality: dict, path: str | Path) -> Path:
    plt = _plt()
    by: dict = {}
    for r in quality["rows"]:
        if r.get("loss") is not None:
            by.setdefault(r["method"], {})[float(r["bits"])] = float(r["loss"])
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for i, (method, pts) in enumerate(sorted(by.items())):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker="o", ms=3, lw=1, color=f"C{i % 10}",
                ls="-" if method.startswith("kbit/") else "--", label=method)
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (k + 0.25)", fontsize=8)
    ax.set_ylabel(f"mean 1 - cos ({quality.get('model', '')})", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, frameon=False)
    ax.set_title(f"Quality vs bits/weight ({quality.get('sentences', '?')} sentences, CPU)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path

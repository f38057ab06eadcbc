"""The decode-step profile as a short text table, a JSON document and a timeline plot (issue 36).

The table: how the step was timed, its totals (step time, kernel time, idle gaps, overlap, bytes, the byte roofline
at the read ceiling and the step's % of it), then the kernels grouped by kind, the top kernels by time, by the idle
time before them and by their time on the critical path (all summed over the layers: one row per module role and
kernel name).

A kernel's time on the critical path is how far its end lies past the end of every kernel that started before it.
Under programmatic dependent launch a kernel starts while its predecessor runs and waits inside, so its duration
overstates what it costs the step; these times add up to the timeline's span instead, and set against the kernel's
bytes at the read ceiling they say what each piece costs above its bytes.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict
from pathlib import Path

from kbit.bench.step_trace import KINDS, NO_RANGE, KernelRow, StepProfile, role

__all__ = ["by_kind", "critical_us", "format_kernels", "format_report", "from_dict", "plot_timeline", "short_name",
           "to_dict", "top_rows"]

#: a kind's colour on the timeline (matplotlib colour names)
COLOURS = {"k-bit GEMV": "tab:blue", "bf16 GEMV": "tab:cyan", "MoE routing": "tab:purple", "attention": "tab:green",
           "norm/glue": "tab:orange", "lm_head": "tab:red", "sampling": "tab:brown", "other": "tab:gray"}


def short_name(name: str, width: int = 40) -> str:
    """A kernel name without ``void``, template arguments, parameters and namespaces, at most ``width`` chars; a
    generic name (cutlass' ``Kernel2``, ``device_kernel``) keeps its first template argument, which names it."""
    s = name.strip().removeprefix("void ")
    base = s
    for stop in ("<", "("):
        base = base.split(stop, 1)[0]
    parts = base.strip().split("::")
    base = parts[-1] or name
    if len(base) < 8 or base.lower() in GENERIC:
        base = "::".join(parts[-2:])
        if "<" in s:
            arg = s.split("<", 1)[1]
            for stop in (",", "<", ">", "("):
                arg = arg.split(stop, 1)[0]
            base = f"{base}<{arg.strip().rsplit('::', 1)[-1]}>"
    return base if len(base) <= width else base[:width - 1] + "~"


_LAYER = re.compile(r"layers\.(\d+)\.")
#: kernel names that say nothing without their first template argument
GENERIC = ("kernel", "kernel2", "device_kernel", "generic_kernel")


def _tbps(nbytes: float, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12 if us > 0 else float("nan")


def critical_us(rows: tuple[KernelRow, ...] | list[KernelRow]) -> list[float]:
    """Each kernel's time on the critical path (rows in start order): its end minus the latest end of the kernels
    before it, or 0 when it ends earlier. They add up to the span of the rows."""
    out, latest = [], rows[0].start_us if rows else 0.0
    for r in rows:
        end = r.start_us + r.dur_us
        out.append(max(0.0, end - latest))
        latest = max(latest, end)
    return out


def by_kind(p: StepProfile) -> list[dict]:
    """Per kind (KINDS order, kinds with kernels only): kernels, time, positive gaps before them, time on the
    critical path, bytes."""
    out, crit = [], list(zip(p.rows, critical_us(p.rows), strict=True))
    for kind in KINDS:
        rows = [(r, c) for r, c in crit if r.kind == kind]
        if rows:
            out.append({"kind": kind, "kernels": len(rows), "us": sum(r.dur_us for r, _ in rows),
                        "gap_us": sum(max(r.gap_us, 0.0) for r, _ in rows), "crit_us": sum(c for _, c in rows),
                        "nbytes": sum(r.nbytes for r, _ in rows)})
    return out


def top_rows(p: StepProfile, key: str = "us", n: int = 12) -> list[dict]:
    """The kernels grouped by (module role, kernel name), summed over layers, the ``n`` largest by ``key``
    ("us": kernel time, "gap_us": positive idle time before them, "crit_us": time on the critical path)."""
    groups: dict = {}
    for r, crit in zip(p.rows, critical_us(p.rows), strict=True):
        g = groups.setdefault((role(r.label), r.name), {"role": role(r.label), "name": r.name, "kind": r.kind,
                                                         "calls": 0, "us": 0.0, "gap_us": 0.0, "max_gap_us": 0.0,
                                                         "crit_us": 0.0, "nbytes": 0.0})
        g["calls"] += 1
        g["us"] += r.dur_us
        g["crit_us"] += crit
        g["gap_us"] += max(r.gap_us, 0.0)
        g["max_gap_us"] = max(g["max_gap_us"], r.gap_us)
        g["nbytes"] += r.nbytes
    return sorted(groups.values(), key=lambda g: -g[key])[:n]


def _fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _header(p: StepProfile) -> list[str]:
    m = p.meta
    lines = [f"step profile: {m.get('title', '')}".rstrip()]
    if m.get("timeline"):
        lines.append(f"timeline: {m['timeline']}")
    times = [f"step {p.step_ms:.3f} ms ({m.get('step_source', 'profiled span')})"]
    if m.get("eager_ms"):
        times.append(f"eager step unprofiled {m['eager_ms']:.3f} ms")
    if m.get("eager_span_ms") is not None:
        times.append(f"eager profiled span {m['eager_span_ms']:.3f} ms")
    lines.append("; ".join(times) + ". Profiling and eager launches change timing: the roofline % uses the step "
                 "time above, the per-kernel times come from the profiled timeline.")
    lines.append(f"timeline span {p.span_us / 1e3:.3f} ms: {len(p.rows)} kernels {p.kernel_us / 1e3:.3f} ms, idle "
                 f"gaps {p.gap_us / 1e3:.3f} ms, overlap {p.overlap_us / 1e3:.3f} ms")
    loose = [r for r in p.rows if r.label == NO_RANGE]
    if loose:
        lines.append(f"kernels outside every range (kind other): {len(loose)}, "
                     f"{sum(r.dur_us for r in loose) / 1e3:.3f} ms")
    idle = sum(r.dur_us for r in p.rows if r.nbytes <= 0)
    layers = {hit.group(1) for r in p.rows if (hit := _LAYER.match(r.label))}
    per_layer = sum(1 for r in p.rows if _LAYER.match(r.label)) / len(layers) if layers else 0.0
    lines.append(f"what-if: no gaps {p.kernel_us / 1e3:.3f} ms; every byte-reading kernel at the ceiling and the "
                 f"others as now {(p.roofline_ms * 1e3 + idle) / 1e3:.3f} ms (kernels reading nothing: "
                 f"{idle / 1e3:.3f} ms); {per_layer:.1f} kernels a layer over {len(layers)} layers")
    lost = f" ({p.unassigned_bytes / 1e6:.1f} MB in calls that launched nothing)" if p.unassigned_bytes else ""
    lines.append(f"bytes {p.nbytes / 1e6:.1f} MB{lost}; roofline at {p.ceiling_tbps:.2f} TB/s "
                 f"({m.get('ceiling_source', 'read ceiling')}): {p.roofline_ms:.3f} ms = "
                 f"{_fmt(p.pct_roofline, '.1f')}% of the step")
    return lines


def _group_table(title: str, groups: list[dict], p: StepProfile) -> list[str]:
    lines = ["", title, f"{'role':34s} {'kernel':32s} {'kind':11s} {'n':>4s} {'us':>9s} {'gap us':>8s} "
             f"{'max gap':>8s} {'MB':>8s} {'TB/s':>6s} {'%ceil':>6s}"]
    for g in groups:
        bw = _tbps(g["nbytes"], g["us"])
        lines.append(f"{g['role'][:34]:34s} {short_name(g['name'], 32):32s} {g['kind'][:11]:11s} {g['calls']:4d} "
                     f"{g['us']:9.1f} {g['gap_us']:8.1f} {g['max_gap_us']:8.1f} {g['nbytes'] / 1e6:8.2f} "
                     f"{_fmt(bw, '6.2f'):>6s} {_fmt(100 * bw / p.ceiling_tbps, '6.1f'):>6s}")
    return lines


def _critical_table(title: str, groups: list[dict], p: StepProfile) -> list[str]:
    lines = ["", title, f"{'role':34s} {'kernel':32s} {'kind':11s} {'n':>4s} {'path us':>9s} {'bytes us':>9s} "
             f"{'above':>9s} {'path/n':>7s}"]
    for g in groups:
        roof = g["nbytes"] / (p.ceiling_tbps * 1e6)
        lines.append(f"{g['role'][:34]:34s} {short_name(g['name'], 32):32s} {g['kind'][:11]:11s} {g['calls']:4d} "
                     f"{g['crit_us']:9.1f} {roof:9.1f} {g['crit_us'] - roof:9.1f} {g['crit_us'] / g['calls']:7.2f}")
    return lines


def format_report(p: StepProfile, top: int = 12) -> str:
    """The text table of a step profile (see the module doc)."""
    lines = _header(p)
    lines += ["", f"{'kind':12s} {'kernels':>7s} {'us':>9s} {'%span':>6s} {'gap us':>8s} {'MB':>9s} {'TB/s':>6s} "
              f"{'roofline us':>11s} {'%roof':>6s} {'path us':>9s}"]
    for g in by_kind(p):
        roof = g["nbytes"] / (p.ceiling_tbps * 1e6)
        lines.append(f"{g['kind']:12s} {g['kernels']:7d} {g['us']:9.1f} "
                     f"{_fmt(100 * g['us'] / p.span_us if p.span_us else float('nan'), '6.1f'):>6s} "
                     f"{g['gap_us']:8.1f} {g['nbytes'] / 1e6:9.2f} {_fmt(_tbps(g['nbytes'], g['us']), '6.2f'):>6s} "
                     f"{roof:11.1f} {_fmt(100 * roof / g['us'] if g['us'] else float('nan'), '6.1f'):>6s} "
                     f"{g['crit_us']:9.1f}")
    lines += _group_table(f"top {top} by kernel time (summed over layers)", top_rows(p, "us", top), p)
    lines += _group_table(f"top {top} by idle gap before the kernel (summed over layers)",
                          top_rows(p, "gap_us", top), p)
    lines += _critical_table(f"top {top} on the critical path (summed over layers; bytes us: their bytes at the read "
                             "ceiling; above: the difference)", top_rows(p, "crit_us", top), p)
    lines += ["", "bytes of a module call are shared by its kernels in proportion to their time; gap = a kernel's "
              "start minus the latest end before it (overlap when negative); path = a kernel's end minus the latest "
              "end before it, 0 if earlier (the path times add up to the span)."]
    return "\n".join(lines)


def format_kernels(p: StepProfile) -> str:
    """Every kernel of the step in order: start, time, gap before it, bytes, TB/s, kind, module call, name."""
    lines = [f"{'#':>5s} {'start us':>9s} {'us':>8s} {'gap us':>7s} {'MB':>8s} {'TB/s':>6s} {'kind':11s} "
             f"{'module call':40s} kernel"]
    for r in p.rows:
        lines.append(f"{r.index:5d} {r.start_us:9.1f} {r.dur_us:8.2f} {r.gap_us:7.2f} {r.nbytes / 1e6:8.3f} "
                     f"{_fmt(_tbps(r.nbytes, r.dur_us) if r.nbytes else float('nan'), '6.2f'):>6s} {r.kind[:11]:11s} "
                     f"{r.label[:40]:40s} {short_name(r.name, 60)}")
    return "\n".join(lines)


def from_dict(d: dict) -> StepProfile:
    """The inverse of :func:`to_dict` (a profile's JSON file read back, e.g. to print it again)."""
    rows = tuple(KernelRow(**r) for r in d["kernels"])
    return StepProfile(rows=rows, span_us=d["span_us"], kernel_us=d["kernel_us"], gap_us=d["gap_us"],
                       overlap_us=d["overlap_us"], nbytes=d["nbytes"], unassigned_bytes=d["unassigned_bytes"],
                       ceiling_tbps=d["ceiling_tbps"], step_ms=d["step_ms"], meta=d.get("meta", {}))


def to_dict(p: StepProfile) -> dict:
    """The profile as JSON-ready data: totals, per kind, and every kernel."""
    return {"meta": p.meta, "step_ms": p.step_ms, "span_us": p.span_us, "kernel_us": p.kernel_us,
            "gap_us": p.gap_us, "overlap_us": p.overlap_us, "nbytes": p.nbytes,
            "unassigned_bytes": p.unassigned_bytes, "ceiling_tbps": p.ceiling_tbps, "roofline_ms": p.roofline_ms,
            "pct_roofline": p.pct_roofline, "by_kind": by_kind(p), "kernels": [asdict(r) for r in p.rows]}


def _lanes(rows: tuple[KernelRow, ...]) -> list[str]:
    return [k for k in KINDS if any(r.kind == k for r in rows)]


def plot_timeline(p: StepProfile, path: str | Path, min_gap_us: float = 2.0) -> Path:
    """One step's kernels as bars in lanes by kind (x: us from the first kernel), idle gaps of at least
    ``min_gap_us`` in a lane of their own, and below, each kernel's achieved TB/s against the read ceiling; written
    to ``path`` (PNG). Needs matplotlib."""
    # matplotlib is optional (the plot only); the Agg canvas, not pyplot: no global backend state is touched
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lanes = _lanes(p.rows) + ["idle gap"]
    fig = Figure(figsize=(14, 2.8 + 0.45 * len(lanes)))
    FigureCanvasAgg(fig)
    ax, bw = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [len(lanes), 4]})
    for y, kind in enumerate(lanes[:-1]):
        bars = [(r.start_us, max(r.dur_us, 0.05)) for r in p.rows if r.kind == kind]
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLOURS.get(kind, "tab:gray"), linewidth=0)
        read = [r for r in p.rows if r.kind == kind and r.nbytes > 0 and r.dur_us > 0]
        bw.bar([r.start_us for r in read], [_tbps(r.nbytes, r.dur_us) for r in read],
               width=[max(r.dur_us, 0.05) for r in read], align="edge", color=COLOURS.get(kind, "tab:gray"))
    gaps = [(r.start_us - r.gap_us, r.gap_us) for r in p.rows if r.gap_us >= min_gap_us]
    ax.broken_barh(gaps, (len(lanes) - 1.4, 0.8), facecolors="black", linewidth=0)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.invert_yaxis()
    bw.axhline(p.ceiling_tbps, color="black", linestyle="--", linewidth=0.8)
    bw.set_ylabel("TB/s")
    bw.set_xlabel("us from the first kernel")
    ax.set_title(f"{p.meta.get('title', '')}: step {p.step_ms:.3f} ms, kernels {p.kernel_us / 1e3:.3f} ms, gaps "
                 f"{p.gap_us / 1e3:.3f} ms, roofline {p.roofline_ms:.3f} ms ({_fmt(p.pct_roofline, '.0f')}%)",
                 fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path

"""``kbit analyze``: per-block and workload-weighted tables (and plots) from committed result files.

    kbit analyze                      # docs/analysis.md + benchmarks/results/h100/analysis-2026-11-21.json
    kbit analyze --plots              # also docs/plots/*.png (needs ``pip install 'kbit[plot]'``)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from kbit.analyze import plots as P
from kbit.analyze import report


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gemv", default=report.DEFAULT_GEMV, help="kbit bench result (M = 1..8)")
    p.add_argument("--gemm-lab", default=report.DEFAULT_LAB, help="gemm-lab result (M = 16..4096)")
    p.add_argument("--mma", nargs="*", default=list(report.DEFAULT_MMA),
                   help="small-M kernel (mma lab) results, newest first (M = 1..64)")
    p.add_argument("--moe", default=report.DEFAULT_MOE, help="whole-MoE-layer result (optional)")
    p.add_argument("--dequant", default=report.DEFAULT_DEQUANT, help="dequantize-kernel result (optional)")
    p.add_argument("--quality", default=report.DEFAULT_QUALITY, help="kbit eval result (for the quality plot)")
    p.add_argument("--tokens", default=None, help="token distributions JSON (default: the packaged one)")
    p.add_argument("--out-md", default="docs/analysis.md")
    p.add_argument("--out-json", default="benchmarks/results/h100/analysis-2026-11-21.json")
    p.add_argument("--plots", action="store_true", help="also write PNGs to --plots-dir")
    p.add_argument("--plots-dir", default="docs/plots")


def main(args: argparse.Namespace) -> int:
    rep = report.build(args.gemv, args.gemm_lab, args.moe, args.tokens, mma_paths=args.mma,
                       dequant_path=args.dequant)
    plots: list[str] = []
    if args.plots:
        if importlib.util.find_spec("matplotlib") is None:  # pragma: no cover
            print("kbit analyze --plots needs matplotlib: pip install 'kbit[plot]'", file=sys.stderr)
            return 2
        gemv = report.load_json(args.gemv) if Path(args.gemv).exists() else None
        lab = report.load_json(args.gemm_lab) if Path(args.gemm_lab).exists() else None
        mma = [report.load_json(p) for p in args.mma if Path(p).exists()]
        plots.append(str(P.plot_speedup(gemv, lab, Path(args.plots_dir) / "speedup-vs-m.png", mma=mma)))
        plots.append(str(P.plot_best(rep, Path(args.plots_dir) / "best-kbit-vs-m.png")))
        if args.quality and Path(args.quality).exists():
            plots.append(str(P.plot_quality(report.load_json(args.quality),
                                            Path(args.plots_dir) / "quality-vs-bits.png")))
    elif Path(args.out_md).parent.joinpath("plots").exists():
        plots = sorted(str(p) for p in Path(args.out_md).parent.joinpath("plots").glob("*.png"))
    md = report.render_markdown(rep, plots)
    for path, text in ((args.out_md, md), (args.out_json, json.dumps(report.to_jsonable(rep), indent=1) + "\n")):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            print(f"wrote {path}")
    if not args.out_md:
        print(md)
    return 0

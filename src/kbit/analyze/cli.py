"""``kbit analyze``: per-block and workload-weighted tables (and plots) from committed result files.

    kbit analyze                                        # in the kbit repository: print the markdown
    kbit analyze --out-md docs/analysis.md --plots-dir docs/plots   # regenerate the committed analysis
    kbit analyze --gemv FILE --gemm-lab FILE ...        # anywhere: your own result files

Inputs come from the arguments; their defaults are the committed H100 results, relative to the current
folder (the root of a kbit checkout). Nothing is written unless ``--out-md``, ``--out-json`` or ``--plots-dir``
names where (plots need ``pip install 'kbit[plot]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from kbit.analyze import plots as P
from kbit.analyze import report

#: The plots, in the order the markdown shows them.
PLOT_FILES = ("speedup-vs-m.png", "best-kbit-vs-m.png", "quality-vs-bits.png")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gemv", default=report.DEFAULT_GEMV, help="kbit bench result (M = 1..8)")
    p.add_argument("--gemm-lab", default=report.DEFAULT_LAB, help="gemm-lab result (M = 16..4096)")
    p.add_argument("--mma", nargs="*", default=list(report.DEFAULT_MMA),
                   help="small-M kernel (mma lab) results, newest first (M = 1..64)")
    p.add_argument("--moe", default=report.DEFAULT_MOE, help="whole-MoE-layer result (optional)")
    p.add_argument("--dequant", default=report.DEFAULT_DEQUANT, help="dequantize-kernel result (optional)")
    p.add_argument("--quality", default=report.DEFAULT_QUALITY, help="kbit eval result (for the quality plot)")
    p.add_argument("--tokens", default=None, help="token distributions JSON (default: the packaged one)")
    p.add_argument("--out-md", default=None, help="write the markdown here (default: print it)")
    p.add_argument("--out-json", default=None, help="also write the tables as JSON here")
    p.add_argument("--plots-dir", default=None, help="write PNG plots to this folder (needs matplotlib)")


#: optional inputs: (option, argument, default). A default that is not there is skipped (outside a checkout);
#: a file the user named is read or refused, never skipped
_OPTIONAL = (("--moe", "moe", report.DEFAULT_MOE), ("--dequant", "dequant", report.DEFAULT_DEQUANT),
             ("--quality", "quality", report.DEFAULT_QUALITY), ("--tokens", "tokens", None))


def check_inputs(args: argparse.Namespace) -> None:
    """One clear error when the two required result files are not there (e.g. run outside the repository), or
    when an optional file the user named (not its default; ``""`` is none) is not there."""
    for flag, path in (("--gemv", args.gemv), ("--gemm-lab", args.gemm_lab)):
        if not path or not Path(path).is_file():
            raise FileNotFoundError(
                f"{flag}: expected a results JSON file, got {path!r} (not found in {Path.cwd()}); run kbit analyze "
                f"in the root of a kbit checkout, or pass --gemv FILE --gemm-lab FILE (kbit bench results)")
    named = [(flag, getattr(args, name)) for flag, name, default in _OPTIONAL if getattr(args, name) != default]
    if list(args.mma) != list(report.DEFAULT_MMA):
        named += [("--mma", p) for p in args.mma]
    for flag, path in named:
        if path and not Path(path).is_file():
            none = "--mma alone" if flag == "--mma" else f"{flag} ''"
            raise FileNotFoundError(f"{flag}: expected a JSON file, got {path!r} (not found in {Path.cwd()}); pass "
                                    f"an existing file, or {none} for none")


def write_plots(args: argparse.Namespace, rep: dict) -> list[str]:
    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError("--plots-dir: plots need matplotlib, which is not installed; "
                                  "pip install -e '.[plot]'", name="matplotlib")
    out = Path(args.plots_dir)
    gemv = report.load_json(args.gemv)
    lab = report.load_json(args.gemm_lab)
    mma = [report.load_json(p) for p in args.mma if Path(p).exists()]
    plots = [str(P.plot_speedup(gemv, lab, out / PLOT_FILES[0], mma=mma)), str(P.plot_best(rep, out / PLOT_FILES[1]))]
    if args.quality and Path(args.quality).exists():
        plots.append(str(P.plot_quality(report.load_json(args.quality), out / PLOT_FILES[2])))
    return plots


def main(args: argparse.Namespace) -> int:
    check_inputs(args)
    rep = report.build(args.gemv, args.gemm_lab, args.moe, args.tokens, mma_paths=args.mma,
                       dequant_path=args.dequant)
    if args.plots_dir:
        plots = write_plots(args, rep)
    elif args.out_md:  # keep linking the plots already beside the markdown
        folder = Path(args.out_md).parent / "plots"
        plots = [str(folder / name) for name in PLOT_FILES if (folder / name).exists()]
    else:
        plots = []
    md = report.render_markdown(rep, plots)
    outputs = ((args.out_md, md), (args.out_json, json.dumps(report.to_jsonable(rep), indent=1) + "\n"))
    for path, text in outputs:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            print(f"wrote {path}")
    if not args.out_md:
        print(md)
    return 0

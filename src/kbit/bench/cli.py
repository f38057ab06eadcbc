"""``kbit bench``: run the benchmark and write results, or render a results file as a table.

    kbit bench --shapes 28672x4096,4096x14336 --m 1,2,4,8 --k 2,3,4,5 --peers humming,tinygemm \\
               --out benchmarks/results
    kbit bench --table benchmarks/results/h100/issue4-2026-11-23.json
    kbit bench --suite models --split tune --families llama3,qwen2.5 --m 1,16,256 --k 4 --peers humming
    kbit bench --summary benchmarks/results/h200/suite-part-2026-11-25.json

Shapes are ``NxK`` (the weight is [N, K], ``y = x @ W.T``) or ``llama`` (the five default shapes);
``--moe qwen3-30b-a3b`` (default) or ``none``. ``--suite models`` takes the shapes and the expert stacks from the
model-shape suite (``kbit.bench.suite``) instead, narrowed by ``--families``, ``--split``, ``--min-weights`` and
``--suite-parts``; such a run also writes a CSV, the per-family summary (``kbit.bench.summary``) and its plot.
"""
from __future__ import annotations

import argparse
import shlex
import sys

import torch

from kbit.bench import report, summary
from kbit.bench import suite as suite_mod
from kbit.bench.args import bits_list, count_list, name_list, positive_float, positive_int, shape_list, suite_name
from kbit.bench.moe import MOE_PRESETS
from kbit.bench.run import DENSE_SHAPES, BenchConfig, run_bench
from kbit.format.spec import BLOCKSIZES


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"llama"``, ``"none"``, or a comma list of ``NxK`` -> [(N, K), ...]."""
    text = text.strip().lower()
    if text in ("llama", "default", "all"):
        return list(DENSE_SHAPES)
    if text in ("none", ""):
        return []
    return shape_list(text)


def parse_moe(text: str):
    out = []
    for name in (n.strip().lower() for n in text.split(",") if n.strip()):
        if name == "none":
            continue
        if name not in MOE_PRESETS:
            raise argparse.ArgumentTypeError(f"unknown MoE preset {name!r}; known: {sorted(MOE_PRESETS)}")
        out.extend(MOE_PRESETS[name])
    return out


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", type=parse_shapes, default="llama",
                   help="NxK list, 'llama' (default) or 'none'")
    p.add_argument("--m", type=count_list, default="1,2,4,8", help="activation rows (default 1,2,4,8)")
    p.add_argument("--k", type=bits_list, default="2,3,4,5", help="bits per weight (default 2,3,4,5)")
    p.add_argument("--blocksize", type=int, default=32, choices=BLOCKSIZES)
    p.add_argument("--moe", type=parse_moe, default="qwen3-30b-a3b", help="MoE preset(s) or 'none'")
    p.add_argument("--tokens", type=count_list, default="1,4", help="tokens per MoE step (default 1,4)")
    p.add_argument("--candidates", default=None,
                   help="kbit kernels to time: comma list of registry names, 'all' (default: the defaults)")
    p.add_argument("--peers", default=None,
                   help="humming,tinygemm,bitsandbytes,gemlite or 'all' (default: none)")
    p.add_argument("--reps", type=int, default=15, help="graph replays timed (median; >= 15)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the read-ceiling measurement")
    p.add_argument("--floor", action="store_true",
                   help="add a 'read' row per dense (shape, k): the fastest plain read of the kbit weight's bytes")
    p.add_argument("--budget-s", type=positive_float, default=None,
                   help="soft wall-clock budget; later units skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse of this checkout)")
    p.add_argument("--out", default="benchmarks/results",
                   help="results folder (a <gpu>/ folder is made in it)")
    p.add_argument("--name", default="bench", help="results file stem: <out>/<gpu>/<name>-<date>.json")
    p.add_argument("--table", nargs="+", metavar="RESULTS_JSON",
                   help="only render these results files as markdown tables (no GPU needed)")
    g = p.add_argument_group("model-shape suite")
    g.add_argument("--suite", type=suite_name, default=None,
                   help="shapes from a suite of kbit/bench/suites (e.g. 'models'), instead of --shapes / --moe")
    g.add_argument("--families", type=name_list, default=None, help="suite: only these families (comma list)")
    g.add_argument("--split", choices=suite_mod.SPLITS, default=None, help="suite: only this half")
    g.add_argument("--min-weights", type=float, default=0, help="suite: only layers of >= this many weights")
    g.add_argument("--suite-parts", type=name_list, default="dense,moe", help="suite: 'dense', 'moe' or both")
    g.add_argument("--pick", type=parse_shapes, default=None,
                   help="suite: only these dense NxK shapes (each must be in the selection)")
    g.add_argument("--max-shapes", type=positive_int, default=None,
                   help="suite: at most this many dense shapes, evenly spaced over the sizes")
    g.add_argument("--summary", nargs="+", metavar="RESULTS_JSON",
                   help="only print the per-family summary of these suite results files (no GPU needed)")


def suite_selection(args: argparse.Namespace) -> tuple[list, list, list]:
    """(layers, dense shapes, MoE shapes) of the suite options."""
    for part in args.suite_parts:
        if part not in ("dense", "moe"):
            raise ValueError(f"--suite-parts: expected 'dense' and/or 'moe', got {part!r}")
    models = suite_mod.load_models(args.suite)
    sel = suite_mod.select(models, families_=args.families, split=args.split, min_weights=int(args.min_weights))
    shapes = suite_mod.dense_shapes(sel)
    if args.pick:
        missing = [s for s in args.pick if s not in shapes]
        if missing:
            raise ValueError(f"--pick: expected dense shapes of the selected suite layers, got {missing} that are not")
        shapes = [s for s in shapes if s in args.pick]
    shapes = suite_mod.spread(shapes, args.max_shapes) if "dense" in args.suite_parts else []
    moe = suite_mod.moe_shapes(sel) if "moe" in args.suite_parts else []
    return sel, shapes, moe


def print_summary(paths: list[str]) -> int:
    for path in paths:
        header, rows = report.read_results(path)
        models = suite_mod.load_models(header.get("suite") or "models")
        layers = summary.with_halves(suite_mod.layers(models), models)
        print(summary.summary_markdown(summary.summarize(rows, layers), header))
    return 0


def write_suite_outputs(path, header: dict, rows: list[dict], layers: list) -> str:
    """The CSV, the summary (markdown) and the plot beside the results file ``path``; returns the summary."""
    summary.write_csv(path.with_suffix(".csv"), rows)
    summ = summary.summarize(rows, summary.with_halves(layers))
    text = summary.summary_markdown(summ, header)
    path.with_name(path.stem + "-summary.md").write_text(text)
    summary.plot(summ, path.with_suffix(".png"), title=f"{header.get('gpu_name', '')} {header.get('commit', '')}")
    return text


def main(args: argparse.Namespace) -> int:
    if args.table:
        return report.main(args.table)
    if args.summary:
        return print_summary(args.summary)
    if not torch.cuda.is_available():
        raise RuntimeError("kbit bench times CUDA kernels: expected an NVIDIA GPU, got torch.cuda.is_available() "
                           "False; on a CPU run `kbit generate --compare`, or `kbit bench --table FILE.json` to "
                           "render results")
    layers, extra = None, {}
    if args.suite:
        layers, args.shapes, args.moe = suite_selection(args)
        extra = dict(suite=args.suite, families=args.families, split=args.split, suite_parts=args.suite_parts)
        print(f"suite {args.suite}: {len(layers)} layers, {len(args.shapes)} dense shapes, {len(args.moe)} expert "
              f"stacks", file=sys.stderr)
    if args.reps < 15:
        print(f"note: --reps {args.reps} is below the 15 replays the method asks for", file=sys.stderr)
    cfg = BenchConfig(shapes=args.shapes, ms=args.m, ks=args.k, blocksize=args.blocksize,
                      candidates=args.candidates, peers=args.peers, moe=args.moe, tokens=args.tokens,
                      reps=args.reps, ceiling=not args.no_ceiling, floor=args.floor, budget_s=args.budget_s,
                      seed=args.seed, peers_with_shape=bool(args.suite), extra_header=extra,
                      commit=args.commit, command="kbit bench " + shlex.join(sys.argv[2:]))
    path = None

    def save(header: dict, rows: list[dict]):
        nonlocal path
        if path is None:
            path = report.results_path(args.out, header["gpu"], args.name)
        return report.write_results(path, header, rows)
    header, rows = run_bench(cfg, checkpoint=save)
    save(header, rows)
    table = report.markdown_table(rows, header)
    path.with_suffix(".md").write_text(table)
    print(table)
    if layers is not None:  # the short per-family table last, where a bounded GPU call's log ends
        print(write_suite_outputs(path, header, rows, layers))
    print(f"wrote {path} and {path.with_suffix('.md')}", file=sys.stderr)
    return 0

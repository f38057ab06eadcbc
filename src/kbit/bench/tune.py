"""``kbit tune``: search each kernel family's configs for (GPU, k, N, K, M bucket) and store the winners.

    kbit tune --suite models --split tune --k 4 --m 1,16,256 --budget-s 500 --out tuned-h100.json
    kbit tune --model path/to/hf_model --k 4              # a model's own shapes, into the cache directory
    kbit tune --fit tuned-h100.json --evaluate held-out-h100.json   # no GPU: fit the rule, report it held out
    kbit tune --fit tuned-h100.json --package src/kbit/tuning/configs/tuned-h100.json   # the table kbit ships

Each candidate of :func:`kbit.tuning.space.search_space` is timed as ``kbit bench`` times (cold L2: weight copies
exceeding 8 x L2, one CUDA graph over them, median of the replays), after its first output was checked against the
dispatcher's; the dispatcher's own choice is timed in the same run (``current_us``). Entries go into a
:class:`kbit.tuning.tuned.TunedTable` (default ``<cache_dir>/tuned/<gpu>.json``), written after each entry, so a run
cut short keeps what it finished; a later run skips entries already there (``--retune``: measure them again;
``--retune-stale``: those measured on other kernel code, :mod:`kbit.tuning.code`).
``--order bands`` takes the shapes so that a run cut short still covers every N x K band of the fitted rule and the
model families (``kbit.bench.suite.by_bands``); the CUDA kernels are compiled ahead by a pool of CPU processes
(``kbit.bench.tune_build``), as compiling, not timing, bounds a run. The last lines printed are a short table: per
entry the best candidate, its time, and the dispatcher's (before tuning where no table was installed), then the
dispatcher / best line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kbit.bench import suite as suite_mod
from kbit.bench.args import (
    bits_list,
    count_list,
    name_list,
    nonneg_int,
    positive_float,
    positive_int,
    shape_list,
    suite_name,
)
from kbit.bench.report import git_commit, gpu_slug
from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls
from kbit.bench.tune_build import Prebuilder
from kbit.bench.weights import clone_weight, kbit_api, kbit_bytes
from kbit.dispatch import linear as dispatch_linear
from kbit.ops import gemm, gemv, gemv_mma
from kbit.ops.mma.common import kernels_available
from kbit.ops.mma.layout import repacked
from kbit.tuning.mma import MAX_M, default_config, large_config, large_ok, uses_large
from kbit.tuning.space import FAMILIES, Candidate, candidate_from_dict, search_space
from kbit.tuning.tables import gpu_key, m_bucket
from kbit.tuning.tuned import NK_EDGES, Trial, TunedTable, default_path, evaluate, fit_rules, tuned_candidate
from kbit.utils.device import sm_count

BF16 = torch.bfloat16
#: a candidate whose first output differs from the dispatcher's by more than this (relative Frobenius) is refused
MAX_REL_ERR = 2e-2
#: the M buckets the shipped H100 table was tuned at: with them a table serves every M up to 1024 but 17..32 and
#: 257..512, which the built-in rules keep (``kbit.tuning.tuned.serving_bucket``)
DEFAULT_MS = "1,4,8,16,64,128,256,1024"


def _log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def candidate_call(cand: Candidate | None, qw) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ W.T`` on one weight copy ``qw`` through ``cand`` (None: the dispatcher, as a user calls it)."""
    kw = dict(k=qw.k, blocksize=qw.blocksize, scale_format=qw.scale_format, N=qw.shape[-2], K=qw.shape[-1])
    t = (qw.codes, qw.scales, qw.tensor_scale, qw.codebook)
    if cand is None:
        return lambda x: dispatch_linear.linear(x, *t, **kw)
    if cand.family in ("mma", "large"):  # the CUDA kernels themselves, never a fallback under their name
        rc, rs = repacked(qw.codes, qw.scales, **kw)
        return lambda x: gemv_mma.run_repacked(x, rc, rs, qw.tensor_scale, qw.codebook, **kw, config=cand.config)
    if cand.family == "fused":
        return lambda x: gemm.gemm_fused(x, *t, **kw, config=cand.config)
    if cand.family == "gemv":
        return lambda x: gemv.gemv(x, *t, **kw, config=cand.config)
    return lambda x: dispatch_linear.dequant_mm(x, *t, **kw)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.float(), ref.float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


class Measure:
    """Times candidates on one quantized weight (its cold-L2 copies made once) for one activation ``x``."""

    def __init__(self, qw, reps: int, l2: int):
        self.copies = [qw] + [clone_weight(qw) for _ in range(copies_for_cold_l2(kbit_bytes(qw), l2) - 1)]
        self.reps = reps
        self.x: torch.Tensor | None = None
        self.ref: torch.Tensor | None = None

    def set_m(self, M: int, seed: int) -> float:
        """New activations of ``M`` rows; returns the dispatcher's time on them (also the reference output)."""
        K = self.copies[0].shape[-1]
        g = torch.Generator(device=self.copies[0].codes.device).manual_seed(seed + M)
        self.x = torch.randn(M, K, generator=g, device=self.copies[0].codes.device).to(BF16)
        self.ref = None
        self.ref = candidate_call(None, self.copies[0])(self.x).float()
        return self(None)

    def __call__(self, cand: Candidate | None) -> float:
        fns = [candidate_call(cand, c) for c in self.copies]
        x = self.x
        y = fns[0](x)
        torch.cuda.synchronize()
        if self.ref is not None and cand is not None:
            err = _rel_err(y, self.ref)
            if not err <= MAX_REL_ERR:
                raise RuntimeError(f"output differs from the dispatcher's by {err:.1e}")
        return time_calls([lambda f=f: f(x) for f in fns], reps=self.reps).us


def tune_entry(k: int, N: int, K: int, M: int, cands: Sequence[Candidate],
               measure: Callable[[Candidate], float], deadline: float | None = None) -> list[Trial] | None:
    """Times every candidate (a failing one gets ``us`` None, with the reason logged); None when ``deadline``
    (``time.time()``) passes first (the entry is then left out, not stored half measured)."""
    trials = []
    for cand in cands:
        if deadline is not None and time.time() > deadline:
            return None
        try:
            us = float(measure(cand))
        except Exception as e:  # noqa: BLE001 - one config failing (shared memory, unsupported) ends only itself
            _log(f"    {cand.family} {cand.config}: {type(e).__name__}: {str(e)[:160]}")
            us = None
        trials.append(Trial(cand, us))
    return trials


def confirm(trials: list[Trial], measure: Callable[[Candidate | None], float], top: int = 3,
            deadline: float | None = None) -> tuple[list[Trial], float | None]:
    """The ``top`` fastest trials timed again back to back, then the dispatcher (``measure(None)``): their new times
    replace the first ones, so that the finalists and the dispatcher are compared in one stretch of the run. A GPU
    that slows as it heats (compute-bound M, H200, ``tune-suite`` run of 2026-11-26: the dispatcher timed first took
    0.84-1.07x the time of the same config timed later) would otherwise favour whatever was timed first. Returns
    (trials, the dispatcher's new time, or None where ``deadline`` passed first)."""
    timed = sorted((t for t in trials if t.us is not None), key=lambda t: t.us)[:top]
    again: dict[str, float] = {}
    for t in timed:
        if deadline is not None and time.time() > deadline:
            return trials, None
        try:
            again[t.candidate.key] = float(measure(t.candidate))
        except Exception as e:  # noqa: BLE001 - it ran once; keep its first time if it fails now
            _log(f"    confirm {t.candidate.family}: {type(e).__name__}: {str(e)[:120]}")
    cur = float(measure(None)) if deadline is None or time.time() <= deadline else None
    return [Trial(t.candidate, again.get(t.candidate.key, t.us)) for t in trials], cur


def builtin_candidate(k: int, M: int, N: int, K: int, device) -> Candidate | None:
    """The kernel and config the dispatcher's built-in rules choose (no tuned table) as a candidate, so that a tuned
    entry can keep it: a table then never picks slower than the rules it replaces. None where that is the Triton
    GEMV (not in the CUDA spaces)."""
    mma = kernels_available(device)
    large = mma and large_ok(device)
    ch = dispatch_linear.pick(M, N, K, k, device, mma=mma, large=large)
    if ch.kernel != "gemv":
        return Candidate("dequant_mm") if ch.kernel == "dequant_mm" else Candidate("fused", ch.config)
    if not mma:
        return None
    if uses_large(M, N, K, device):
        return Candidate("large", large_config(k, M, N, K))
    return Candidate("mma", default_config(k, min(M, MAX_M), N, K, sm90=large, sms=sm_count(device),
                                           gpu=gpu_key(device)))


def _short(d: dict) -> str:
    cfg = d.get("config") or {}
    return d["family"] + ("(" + ",".join(f"{k}={v}" for k, v in cfg.items()) + ")" if cfg else "")


def quantized_weight(N: int, K: int, k: int, seed: int = 0, device="cuda", scale_format: str = "log8"):
    """A seeded random bf16 weight [N, K] quantized to k bits (``kbit.quantize``) with ``scale_format`` block scales;
    the same seed gives the same float weight for every k and scale format."""
    g = torch.Generator(device=device).manual_seed(seed + N * 7 + K)
    W = (torch.randn(N, K, generator=g, device=device) * 0.02).to(BF16)
    return kbit_api()[0](W, k=k, scale_format=scale_format)


def _wanted(table: TunedTable, key: tuple, retune: bool, retune_stale: bool) -> bool:
    return retune or key not in table.entries or (retune_stale and table.stale(key))


def tune_shapes(table: TunedTable, shapes: Sequence[tuple[int, int]], ks: Sequence[int], ms: Sequence[int], *,
                families: tuple[str, ...] | None = None, quick: bool = False, reps: int = 15,
                budget_s: float | None = None, retune: bool = False, retune_stale: bool = False, seed: int = 0,
                save: Callable[[TunedTable], object] | None = None,
                measure_for: Callable[[int, int, int], Measure] | None = None,
                builtin_for: Callable[[int, int, int, int], Candidate | None] | None = None,
                current_for: Callable[[int, int, int, int], Candidate | None] | None = None,
                cuda: bool | None = None, sm90: bool | None = None, confirm_top: int = 3) -> list[tuple]:
    """Tunes every (shape, k, M) not yet in ``table`` (all with ``retune``; with ``retune_stale`` also those whose
    entry was measured on other kernel code, :meth:`TunedTable.stale`); returns the keys tuned.

    ``measure_for(N, K, k)``: the :class:`Measure` of a weight (default: a quantized random weight on the GPU);
    ``builtin_for(k, M, N, K)``: the built-in rules' choice, added to the candidates (default:
    :func:`builtin_candidate` on the GPU); ``current_for(k, M, N, K)``: the tuned table's answer, which the
    dispatcher runs where there is one (else it runs the built-in rules' choice), recorded beside the dispatcher's
    time (default: :func:`kbit.tuning.tuned.tuned_candidate` on the GPU); ``cuda`` / ``sm90``: whether the CUDA
    kernels / kernel 7 run (default: asked of the GPU); ``confirm_top``: finalists timed again beside the
    dispatcher (:func:`confirm`; 0: none)."""
    if measure_for is None:
        dev = torch.device("cuda")
        l2 = l2_bytes(dev)
        cuda, sm90 = kernels_available(dev), large_ok(dev)

        def measure_for(N, K, k):
            return Measure(quantized_weight(N, K, k, seed, dev), reps, l2)

        def builtin_for(k, M, N, K):
            return builtin_candidate(k, M, N, K, dev)

        def current_for(k, M, N, K):
            return tuned_candidate(k, M, N, K, gpu_key(dev))
    deadline = None if budget_s is None else time.time() + budget_s
    done = []
    for N, K in shapes:
        for k in ks:
            todo = [M for M in ms if _wanted(table, (k, N, K, m_bucket(M)), retune, retune_stale)]
            if not todo:
                continue
            if deadline is not None and time.time() > deadline:
                _log(f"budget: {N}x{K} k={k} not tuned")
                continue
            meas = measure_for(N, K, k)
            for M in todo:
                if deadline is not None and time.time() > deadline:
                    break
                cur = meas.set_m(M, seed)
                cands = search_space(k, M, N, K, cuda=bool(cuda), sm90=bool(sm90), families=families, quick=quick)
                own = builtin_for(k, M, N, K) if builtin_for is not None else None
                if own is not None and own not in cands:
                    cands.append(own)
                t0 = time.time()
                trials = tune_entry(k, N, K, M, cands, meas, deadline)
                if trials is not None and confirm_top and any(t.us is not None for t in trials):
                    trials, cur2 = confirm(trials, meas, confirm_top, deadline)
                    trials = None if cur2 is None else trials
                    cur = cur if cur2 is None else cur2
                if trials is None or not any(t.us is not None for t in trials):
                    _log(f"{N}x{K} k={k} M={M}: not stored ({'budget' if trials is None else 'nothing ran'})")
                    continue
                now = (current_for(k, M, N, K) if current_for is not None else None) or own  # what `cur` timed
                e = table.add(k, N, K, M, trials, current_us=cur, builtin=own, current=now)
                done.append((k, N, K, m_bucket(M)))
                _log(f"{N}x{K} k={k} M={M}: {len(cands)} candidates in {time.time() - t0:.0f} s; best "
                     f"{e['best']['us']:.2f} us {_short(e['best'])}; dispatcher {cur:.2f} us")
                if save is not None:
                    save(table)
            del meas
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return done


def summary_lines(table: TunedTable, keys: Sequence[tuple] | None = None) -> list[str]:
    """A markdown table: per entry the best candidate, its time, the dispatcher's and their ratio."""
    lines = ["| k | N x K | M | best us | dispatcher us | gain | best |", "|--:|---|--:|--:|--:|--:|---|"]
    for key in keys if keys is not None else sorted(table.entries):
        k, N, K, b = key
        e = table.entries[key]
        cur, best = e.get("current_us"), e["best"]["us"]
        gain = f"{cur / best:.2f}x" if cur else "-"
        lines.append(f"| {k} | {N}x{K} | {b} | {best:.2f} | {cur or 0:.2f} | {gain} | {_short(e['best'])} |")
    return lines


def dispatcher_line(table: TunedTable, keys: Sequence[tuple]) -> str:
    """How the dispatcher (as it chose when the entry was measured) did against the best candidate on ``keys``.
    Where the dispatcher's choice is the best candidate itself (``current``), the ratio is the run's spread between
    two timings of one config, not a worse pick: the line says how many such entries there are and their worst."""
    es = [e for e in (table.entries[key] for key in keys) if e.get("current_us")]
    if not es:
        return "dispatcher / best: no entry"
    r = sorted(e["current_us"] / e["best"]["us"] for e in es)
    line = (f"dispatcher / best candidate over {len(r)} entries: median {statistics.median(r):.3f}, worst "
            f"{r[-1]:.3f}; within 5% on {sum(v <= 1.05 for v in r)} of {len(r)}")
    same = [e["current_us"] / e["best"]["us"] for e in es if _same_config(e)]
    if same:
        other = [e["current_us"] / e["best"]["us"] for e in es if not _same_config(e)]
        line += (f"; on {len(same)} the dispatcher ran the best config itself (timed twice: worst {max(same):.3f}), "
                 f"worst where it ran another: {max(other):.3f}" if other else
                 f"; on all {len(same)} the dispatcher ran the best config itself (timed twice)")
    return line


def _same_config(e: dict) -> bool:
    cur = e.get("current")
    return cur is not None and candidate_from_dict(cur) == candidate_from_dict(e["best"])


def evaluation_lines(ev: dict, what: str, how: str = "fitted rule") -> list[str]:
    def f(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)
    return [f"{how} on {what}: {ev['covered']} of {ev['entries']} entries covered; time / best: median "
            f"{f(ev['median'])}, worst {f(ev['worst'])}; within 5% of the best on {f(ev['within_5pct'], '.0%')}; "
            f"dispatcher before / rule: median {f(ev['vs_current_median'])}"]


# ------------------------------------------------------------------------------------------------ CLI


def _kernel_families(text: str) -> tuple[str, ...]:
    out = tuple(name_list(text))
    bad = [f for f in out if f not in FAMILIES]
    if bad:
        raise argparse.ArgumentTypeError(f"expected a subset of {','.join(FAMILIES)}, got {bad}")
    return out


def configure(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("shapes (one of)")
    src.add_argument("--shapes", type=shape_list, default=None, help="NxK list")
    src.add_argument("--model", default=None, help="a Hugging Face model directory: its config.json's dense layers")
    src.add_argument("--suite", type=suite_name, default=None,
                     help="a suite of kbit/bench/suites (e.g. 'models'): its dense layers")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse of this checkout)")
    p.add_argument("--families", type=name_list, default=None,
                   help="suite: only these model families (comma list)")
    p.add_argument("--split", choices=suite_mod.SPLITS, default=None, help="suite: only this half")
    p.add_argument("--max-shapes", type=positive_int, default=None,
                   help="at most this many shapes (--order says which)")
    p.add_argument("--order", choices=("size", "bands"), default="size",
                   help="size: largest first (--max-shapes: evenly over the sizes); bands: every N x K band of the "
                        "fitted rule and model family in turn, so that a run cut short by --budget-s covers them")
    p.add_argument("--k", type=bits_list, default="4", help="bits per weight (default 4)")
    p.add_argument("--m", type=count_list, default=DEFAULT_MS, help=f"rows, one per M bucket (default {DEFAULT_MS})")
    p.add_argument("--kernels", type=_kernel_families, default=None,
                   help=f"kernel families to search, a subset of {','.join(FAMILIES)}")
    p.add_argument("--quick", action="store_true", help="a handful of configs a family instead of the full space")
    p.add_argument("--reps", type=positive_int, default=15)
    p.add_argument("--build-workers", type=nonneg_int, default=None,
                   help="CPU processes compiling the CUDA kernels ahead of the timing (default: CPUs - 2; 0: none)")
    p.add_argument("--budget-s", type=positive_float, default=None,
                   help="stop starting entries after this many seconds")
    p.add_argument("--retune", action="store_true", help="measure entries already in the table again")
    p.add_argument("--retune-stale", action="store_true",
                   help="measure again the entries timed on other kernel code than this kbit's (or on unrecorded)")
    p.add_argument("--out", default=None, help="the tuned table (default <cache_dir>/tuned/<gpu>.json)")
    p.add_argument("--fit", default=None, metavar="TABLE_JSON",
                   help="no GPU: fit the default rule on this table and store it there")
    p.add_argument("--evaluate", nargs="*", default=None, metavar="TABLE_JSON",
                   help="with --fit: report the rule on these tables (e.g. the held-out half)")
    p.add_argument("--package", default=None, metavar="OUT_JSON",
                   help="with --fit: also write the packaged table (entries' best and times, the rules), the form "
                        "shipped as kbit/tuning/configs/tuned-<gpu>.json")


def shapes_from_args(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The dense (N, K) to tune: --shapes, --model DIR (its config.json) or --suite (with --families / --split;
    the held-out half without the shapes the tune half has too)."""
    given = [n for n in ("shapes", "model", "suite") if getattr(args, n)]
    if len(given) != 1:
        raise ValueError(f"shapes: expected exactly one of --shapes, --model, --suite, got {given or 'none'}")
    family: dict = {}
    if args.shapes:
        shapes = list(args.shapes)
    elif args.model:
        cfg_path = Path(args.model) / "config.json"
        if not cfg_path.exists():
            raise ValueError(f"model: expected a directory with a config.json, got {args.model!r}")
        model = suite_mod.model_from_config(Path(args.model).name, json.loads(cfg_path.read_text()))
        shapes = suite_mod.dense_shapes(suite_mod.model_layers(model))
    else:
        fams = list(args.families) if args.families else None
        models = suite_mod.load_models(args.suite)
        sel = suite_mod.select(models, families_=fams, split=args.split)
        family = suite_mod.shape_families(sel)
        if args.split == "held-out":  # judged on shapes the tune half does not have
            shapes = suite_mod.unseen_shapes(models, families_=fams)
        else:
            shapes = suite_mod.dense_shapes(sel)
    if getattr(args, "order", "size") == "bands":
        return suite_mod.by_bands(shapes, NK_EDGES, family)[:args.max_shapes]
    return suite_mod.spread(shapes, args.max_shapes)


def _table_arg(option: str, path: str) -> TunedTable:
    """The tuned table a ``--fit`` / ``--evaluate`` argument names; a missing file is a ``ValueError`` naming the
    option (an unreadable one names the path: :meth:`TunedTable.load`)."""
    if not Path(path).is_file():
        raise ValueError(f"{option}: expected a tuned table JSON file (kbit tune --out), got {path!r} (no such file)")
    return TunedTable.load(path)


def fit_main(args: argparse.Namespace) -> int:
    # every table read before the fitted rule is written back: a bad --evaluate leaves --fit's file as it was
    table = _table_arg("--fit", args.fit)
    held_out = [(path, _table_arg("--evaluate", path)) for path in args.evaluate or ()]
    rules = fit_rules(table)
    table.save(args.fit)
    print(f"{len(rules)} rules fitted on {len(table.entries)} entries of {args.fit} (stored there)")
    stale = sum(table.stale(key) for key in table.entries)
    if stale:
        print(f"{stale} of {len(table.entries)} entries were timed on other kernel code than this kbit's, or on "
              f"unrecorded code (kbit tune --retune-stale measures them again)")
    lines = evaluation_lines(evaluate(rules, table), f"{args.fit} itself")
    for path, held in held_out:
        lines += evaluation_lines(evaluate(rules, held), path)
        lines += evaluation_lines(evaluate(rules, held, fitted=table), path, "the table's lookup (nearest shapes)")
    if getattr(args, "package", None):
        out = table.packaged().save(args.package, indent=None)
        lines.append(f"packaged table (best, times): {out} ({out.stat().st_size} bytes); ship it as "
                     f"src/kbit/tuning/configs/tuned-{table.gpu}.json")
    print("\n".join(lines))
    return 0


def main(args: argparse.Namespace) -> int:
    if args.fit:
        return fit_main(args)
    for name in ("evaluate", "package"):
        if getattr(args, name, None) is not None:
            raise ValueError(f"--{name}: only with --fit TABLE_JSON (it reports on / packages the table fitted), "
                             f"got --{name} without --fit")
    shapes = shapes_from_args(args)
    families = tuple(args.kernels) if args.kernels else None
    if not torch.cuda.is_available():
        raise RuntimeError("kbit tune needs a CUDA GPU (torch.cuda.is_available() is False); --fit does not")
    dev = torch.device("cuda")
    gpu = gpu_key(dev)
    if gpu == "generic":
        gpu = gpu_slug(torch.cuda.get_device_name(dev))
    path = Path(args.out) if args.out else default_path(gpu)
    table = TunedTable.load(path) if path.exists() else TunedTable(gpu)
    if table.gpu != gpu:
        raise ValueError(f"out: expected a tuned table of this GPU ({gpu!r}), got {path} of {table.gpu!r}")
    table.meta.update(gpu_name=torch.cuda.get_device_name(dev), sms=sm_count(dev), commit=args.commit or git_commit(),
                      torch=torch.__version__, reps=args.reps, method="cold L2, CUDA-graph replay, median")
    _log(f"kbit tune on {table.meta['gpu_name']}: {len(shapes)} shapes x k {args.k} x M {args.m} -> {path}")
    workers = args.build_workers if args.build_workers is not None else max(0, (os.cpu_count() or 2) - 2)
    prebuild = None
    if workers > 0 and kernels_available(dev):
        prebuild = Prebuilder(dev, sm_count(dev), large_ok(dev), workers)
        todo = [s for s in shapes if any(_wanted(table, (k, *s, m_bucket(M)), args.retune, args.retune_stale)
                                         for k in args.k for M in args.m)]
        _log(f"prebuild: {prebuild.submit(todo, args.k, args.m, families=families, quick=args.quick)} builds "
             f"queued on {workers} CPU processes")
    try:
        done = tune_shapes(table, shapes, args.k, args.m, families=families, quick=args.quick, reps=args.reps,
                           budget_s=args.budget_s, retune=args.retune, retune_stale=args.retune_stale,
                           save=lambda t: t.save(path))
    finally:
        if prebuild is not None:
            _log(f"prebuild: {prebuild.done()} of {len(prebuild.futures)} builds done ahead")
            prebuild.close()
    # a file resumed by later runs keeps each run's commit and what it added (meta["commit"] is the last run's)
    table.meta.setdefault("runs", []).append({"commit": table.meta["commit"], "entries": len(done), "k": list(args.k),
                                              "m": list(args.m)})
    table.save(path)
    print("\n".join(summary_lines(table, done)))
    print(dispatcher_line(table, done))
    print(f"{len(done)} entries tuned; {len(table.entries)} in {path}")
    return 0


if __name__ == "__main__":  # ``python -m kbit.bench.tune``: the same as ``kbit tune``
    _parser = argparse.ArgumentParser(prog="kbit tune", description=__doc__.splitlines()[0])
    configure(_parser)
    sys.exit(main(_parser.parse_args()))

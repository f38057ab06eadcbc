"""Benchmark and GPU check of kbit.ops.sampling.sample against the sort-based torch reference.

One script for the device machine: it (1) runs the GPU tests of tests/test_sampling.py (about a
million draws per case, chi-square and total variation against the reference distribution),
(2) checks the headline cases' draws against the reference support, (3) times the kernel and
``sample_reference`` under CUDA graphs (several calls per graph, inputs rotated, median of many
replays), for the default config and a sweep of configs, and (4) writes JSON + markdown to
``$OUT`` (or benchmarks/results/h100/ without $OUT) and prints a short table last.

    PYTHONUNBUFFERED=1 python benchmarks/bench_sampling.py [--skip-tests] [--quick]

Logits are standard normal (scaled by ``scale``), fp32 unless stated; V = 151936 (Qwen2 vocabulary).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# this checkout's kbit, unless PYTHONPATH names another tree that has one (an A/B of two trees runs this file with
# PYTHONPATH at each)
if not any((Path(p) / "kbit").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(ROOT / "src"))

from kbit.ops.sampling import SamplingConfig, filtered_probs_reference, sampling_config, sample, sample_reference  # noqa: E402, I001

V = 151936
HEADLINE = dict(temperature=0.7, top_k=50, top_p=0.9)
# (name, B, dtype, logit scale, sampling args, extra): timed with the default config
CASES = [
    ("B128 T+top-k50+top-p0.9", 128, torch.float32, 1.0, HEADLINE, {}),
    ("B1 T+top-k50+top-p0.9", 1, torch.float32, 1.0, HEADLINE, {}),
    ("B8 T+top-k50+top-p0.9", 8, torch.float32, 1.0, HEADLINE, {}),
    ("B32 T+top-k50+top-p0.9", 32, torch.float32, 1.0, HEADLINE, {}),
    ("B256 T+top-k50+top-p0.9", 256, torch.float32, 1.0, HEADLINE, {}),
    ("B128 bf16 T+top-k50+top-p0.9", 128, torch.bfloat16, 1.0, HEADLINE, {}),
    ("B128 T only (chunk pick)", 128, torch.float32, 1.0, dict(temperature=0.7), {}),
    ("B128 greedy", 128, torch.float32, 1.0, dict(temperature=0.0), {}),
    ("B128 min-p0.1 peaked", 128, torch.float32, 4.0, dict(min_p=0.1), {}),
    ("B128 top-p0.9 peaked", 128, torch.float32, 4.0, dict(top_p=0.9), {}),
    ("B128 top-p0.9 flat (fallback)", 128, torch.float32, 1.0, dict(top_p=0.9), {}),
    ("B128 penalties L=512 +top-k50+top-p0.9", 128, torch.float32, 1.0, dict(
        HEADLINE, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1), {"history": 512}),
]
SWEEP = [  # (chunk, candidate vectors, warps_chunk, warps_select)
    (1024, 32, 1, 8), (1024, 32, 1, 16), (2048, 32, 2, 8), (2048, 32, 2, 16), (4096, 32, 4, 16),
    (2048, 32, 1, 16),
]
QUICK_SWEEP = {128: [(4096, 32, 4, 8), (2048, 32, 2, 16), (8192, 32, 8, 16)],
               1: [(4096, 32, 4, 8), (2048, 32, 2, 16), (8192, 32, 8, 16)]}


def git_commit() -> str:
    """KBIT_COMMIT if set (the device copy of the tree may hold no usable .git), else git."""
    if os.environ.get("KBIT_COMMIT"):
        return os.environ["KBIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src/kbit/kernels/sampling.py",
                                "src/kbit/ops/sampling.py", "benchmarks/bench_sampling.py"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def graph_time_us(fn, n_inputs, calls_per_graph=20, replays=60, warmup=5):
    """Median over replays of (graph time / calls): one graph holds `calls_per_graph` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i % n_inputs)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls_per_graph):
            fn(i % n_inputs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(warmup + replays):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        if r >= warmup:
            times.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    return statistics.median(times), min(times), max(times)


def eager_time_us(fn, n_inputs, calls=100):
    for i in range(5):
        fn(i % n_inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i % n_inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def make_inputs(B, dtype, scale, extra):
    per = B * V * torch.tensor([], dtype=dtype).element_size()
    n = max(2, min(20, -(-100 * 2**20 // per)))  # rotate over >= 100 MiB (2x the L2) or 20 buffers
    g = torch.Generator(device="cuda").manual_seed(B)
    xs = [(torch.randn(B, V, device="cuda", generator=g) * scale).to(dtype) for _ in range(n)]
    hist = None
    if extra.get("history"):
        hist = torch.randint(0, V, (B, extra["history"]), device="cuda", generator=g)
        hist[:, -17:] = -1
    return xs, hist


def check_support(x, kw, hist, config):
    seed = torch.tensor([3], device="cuda")
    tokens, logprobs = sample(x, seed=seed, offset=0, token_history=hist, config=config,
                              return_logprobs=True, **kw)
    probs = filtered_probs_reference(x, token_history=hist, **kw)
    p = probs.gather(1, tokens[:, None])[:, 0]
    in_support = bool((p > 0).all())
    err = (logprobs.double() - p.log()).abs().max().item() if in_support else float("inf")
    return in_support, err


def time_case(name, B, dtype, scale, kw, extra, config=None, with_ref=True):
    xs, hist = make_inputs(B, dtype, scale, extra)
    config = config or sampling_config(B, V)
    seed = torch.tensor([1234], device="cuda")
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    ok, lp_err = check_support(xs[0], kw, hist, config)

    def kernel(i):
        return sample(xs[i], seed=seed, offset=offset, token_history=hist, config=config, **kw)

    def reference(i):
        return sample_reference(xs[i], token_history=hist, **kw)

    med, lo, hi = graph_time_us(kernel, len(xs))
    row = dict(case=name, B=B, V=V, dtype=str(dtype).replace("torch.", ""), logit_scale=scale,
               args={k: v for k, v in kw.items()}, config=config.__dict__, support_ok=ok,
               logprob_max_abs_err=lp_err, kbit_us=med, kbit_us_min=lo, kbit_us_max=hi,
               buffers=len(xs))
    if with_ref:
        try:
            ref_med, _, _ = graph_time_us(reference, len(xs), calls_per_graph=5, replays=20)
            row["ref_timing"] = "cuda graph"
        except RuntimeError as e:  # pragma: no cover - capture failure is reported, not fatal
            torch.cuda.synchronize()
            ref_med = eager_time_us(reference, len(xs), calls=20)
            row["ref_timing"] = f"eager ({type(e).__name__})"
        row["ref_us"] = ref_med
        row["speedup"] = ref_med / med
        row["kbit_eager_us"] = eager_time_us(kernel, len(xs))
    return row


def time_passes(B):
    """Pass 1 and pass 2 of the headline case alone, each in its own CUDA graph (default config), and
    the number of rows whose certificate F lies at or above the top-k threshold (whole-row fallback)."""
    from kbit.kernels import sampling as kern
    from kbit.kernels import sampling_chunks as kern_chunks
    from kbit.ops.sampling import _FAST_ENTRIES, _PASS1_CAP_BATCH, _PASS1_MAXNREG, _STREAM_VECTORS, _next_pow2, _tile

    xs, _ = make_inputs(B, torch.float32, 1.0, {})
    cfg = sampling_config(B, V)
    S, KC, P = -(-V // cfg.chunk), cfg.candidates, cfg.select_slots
    NVP = _next_pow2(S * KC)
    G, T = _tile(cfg.chunk, cfg.warps_chunk)
    dev = "cuda"
    cand = torch.empty(B, S * KC, dtype=torch.int32, device=dev)
    cand_val = torch.empty(B, S * KC, dtype=torch.float32, device=dev)
    stats = torch.empty(6, B, S, dtype=torch.float32, device=dev)
    PE = _FAST_ENTRIES
    fscr = torch.empty(B, PE, dtype=torch.int64, device=dev)
    scr_v = torch.empty(B, P, dtype=torch.float32, device=dev)
    scr_i = torch.empty(B, P, dtype=torch.int32, device=dev)
    tok = torch.empty(B, dtype=torch.int64, device=dev)
    lp = torch.empty(B, dtype=torch.float32, device=dev)
    seed = torch.tensor([1234], device=dev)
    offset = torch.zeros(1, dtype=torch.int64, device=dev)
    temp, top_k, top_p = HEADLINE["temperature"], HEADLINE["top_k"], HEADLINE["top_p"]

    def pass1(i):
        kern_chunks.chunk_summary_kernel[(B, S)](
            xs[i], V, V, lp, temp, lp, top_k, cand, cand_val, stats, B, S, TEMP_PER_ROW=False, TOPK_PER_ROW=False,
            CHUNK=cfg.chunk, KC=KC, G=G, T=T, MAX_ITERS=24, num_warps=cfg.warps_chunk,
            **({"maxnreg": _PASS1_MAXNREG} if B >= _PASS1_CAP_BATCH else {}))

    def pass2(i):
        kern.select_sample_kernel[(B,)](
            xs[0], V, V, cand, cand_val, stats, B, S, scr_v, scr_i, fscr, lp, temp, lp, top_k, lp, top_p,
            lp, 0.0,
            seed, 0, offset, 0, tok, lp, TEMP_PER_ROW=False, TOPK_PER_ROW=False, TOPP_PER_ROW=False,
            MINP_PER_ROW=False, SEED_MODE=1, OFFSET_MODE=1, CHUNK=cfg.chunk, KC=KC, SP=_next_pow2(S),
            NVP=NVP, P=P, VB=min(NVP, _STREAM_VECTORS), BLOCK=min(1024, _next_pow2(V)), NPIV=16,
            PE=PE, EVEN4=V % 4 == 0, FUSED=True, num_warps=cfg.warps_select)

    t1 = graph_time_us(pass1, len(xs))[0]
    pass1(0)
    t2 = graph_time_us(pass2, 1)[0]
    pass1(0)
    z = xs[0] * (1.0 / temp)
    t_k = torch.topk(z, top_k, dim=1).values[:, -1]
    F = stats[2].max(1).values
    # fast path: entries above F and at or above the k-th largest of the chunks' two top row maxima
    L = torch.topk(torch.cat([stats[0], stats[5]], 1), top_k, dim=1).values[:, -1]
    fast = ((z > F[:, None]) & (z >= L[:, None])).sum(1)
    return dict(B=B, config=cfg.__dict__, pass1_us=t1, pass2_us=t2,
                rows_uncertified=int((F >= t_k).sum()), survivors_mean=float((z > F[:, None]).sum(1).float().mean()),
                fast_survivors_mean=float(fast.float().mean()), fast_survivors_max=int(fast.max()))


def run_tests(out_dir: Path):
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests/test_sampling.py"), "-m", "gpu", "-q",
           "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    log = proc.stdout + proc.stderr
    (out_dir / "sampling_gpu_tests.log").write_text(log)
    summary = [line for line in log.splitlines() if " passed" in line or " failed" in line]
    print(log[-3000:], flush=True)
    return dict(command=" ".join(cmd[1:]), returncode=proc.returncode,
                summary=summary[-1] if summary else "", seconds=round(time.time() - t0, 1))


def markdown(meta, rows, sweep):
    lines = [f"# Sampling on {meta['gpu']} ({meta['date']}, commit {meta['commit'][:12]})", "",
             f"`{meta['command']}`; torch {meta['torch']}, triton {meta['triton']}. "
             "CUDA-graph replay, median over replays of graph time / calls; logits N(0,1) x scale, "
             f"V = {V}. GPU tests: {meta['tests'].get('summary', 'skipped')}.", "",
             "| case | config (chunk/cand/warps) | kbit us | torch ref us | speedup | eager us | support |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        c = r["config"]
        lines.append(f"| {r['case']} | {c['chunk']}/{c['candidates']}/{c['warps_chunk']},{c['warps_select']} "
                     f"| {r['kbit_us']:.1f} | {r.get('ref_us', float('nan')):.1f} "
                     f"| {r.get('speedup', float('nan')):.1f}x | {r.get('kbit_eager_us', float('nan')):.1f} "
                     f"| {'ok' if r['support_ok'] else 'FAIL'} |")
    if meta.get("passes"):
        lines += ["", "Each pass alone (headline arguments, default config, own CUDA graph):", "",
                  "| B | pass 1 us | pass 2 us | rows with F >= t_k (fallback) | survivors a row (> F) "
                  "| fast-path entries a row (mean / max) |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['B']} | {r['pass1_us']:.1f} | {r['pass2_us']:.1f} | {r['rows_uncertified']} "
                  f"| {r['survivors_mean']:.0f} | {r.get('fast_survivors_mean', float('nan')):.1f} / "
                  f"{r.get('fast_survivors_max', -1)} |" for r in meta["passes"]]
    lines += ["", "Config sweep (headline arguments):", "", "| B | chunk | cand | warps | kbit us |",
              "|---:|---:|---:|---|---:|"]
    for r in sweep:
        c = r["config"]
        lines.append(f"| {r['B']} | {c['chunk']} | {c['candidates']} | {c['warps_chunk']},{c['warps_select']} "
                     f"| {r['kbit_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--quick", action="store_true", help="headline cases and a short sweep")
    ap.add_argument("--tag", default="", help="suffix of the result files (sampling_<tag>.json/.md)")
    ap.add_argument("--passes", action="store_true", help="also time pass 1 and pass 2 alone (headline)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT") or ROOT / "benchmarks/results/h100")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                commit=git_commit(), command="python benchmarks/bench_sampling.py " + " ".join(sys.argv[1:]),
                torch=torch.__version__, triton=__import__("triton").__version__,
                sms=torch.cuda.get_device_properties(0).multi_processor_count)
    meta["tests"] = {} if args.skip_tests else run_tests(out_dir)

    rows, sweep = [], []
    if args.passes:
        meta["passes"] = [time_passes(B) for B in (128, 1)]
        for r in meta["passes"]:
            print(f"passes B{r['B']}: pass 1 {r['pass1_us']:.1f} us, pass 2 {r['pass2_us']:.1f} us, "
                  f"uncertified rows {r['rows_uncertified']}, survivors {r['survivors_mean']:.0f}", flush=True)
    name = "sampling" + (f"_{args.tag}" if args.tag else "")

    def save():  # after every case, so that a run cut short still leaves its results
        (out_dir / f"{name}.json").write_text(json.dumps(dict(meta=meta, cases=rows, sweep=sweep), indent=1))
        (out_dir / f"{name}.md").write_text(markdown(meta, rows, sweep))

    for case in CASES[:2] if args.quick else CASES:
        rows.append(time_case(*case))
        save()
        print(f"{rows[-1]['case']}: {rows[-1]['kbit_us']:.1f} us vs {rows[-1].get('ref_us', 0):.1f}", flush=True)
    for B in (128, 1):
        for cfg in QUICK_SWEEP[B] if args.quick else SWEEP:
            r = time_case(f"sweep B{B}", B, torch.float32, 1.0, HEADLINE, {}, SamplingConfig(*cfg),
                          with_ref=False)
            sweep.append(r)
            save()
            print(f"sweep B{B} {cfg}: {r['kbit_us']:.1f} us support_ok={r['support_ok']}", flush=True)

    print()
    print(f"{meta['gpu']} | {meta['commit'][:12]} | tests: {meta['tests'].get('summary', 'skipped')}")
    print(f"{'case':42s} {'kbit us':>9s} {'ref us':>9s} {'speedup':>8s} support")
    for r in rows:
        print(f"{r['case']:42s} {r['kbit_us']:9.1f} {r.get('ref_us', float('nan')):9.1f} "
              f"{r.get('speedup', float('nan')):7.1f}x {'ok' if r['support_ok'] else 'FAIL'}")


if __name__ == "__main__":
    main()

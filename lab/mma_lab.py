"""GPU lab for the tensor-core small-M kernel (kbit.ops.gemv_mma): correctness against float64, a config sweep,
then cold-L2 timings of every k on the issue's shapes at M = 1..64 next to bf16 F.linear, in one call.

    PYTHONUNBUFFERED=1 python lab/mma_lab.py [--budget SECONDS] [--out DIR] [--sweep] [--tag TAG]

Writes ``mma.json``, ``mma.md`` and ``mma.log`` under ``--out`` (default ``$OUT`` or ``.``), prints a short table
last. Timing: ``kbit.bench.timing.time_calls`` (CUDA graph over weight copies that together exceed 8x L2,
median of 15 replays). Bytes counted: canonical codes + scales + codebook + tensor_scale (the repacked layout
reads the same bytes plus tile padding). TB/s and % are against the read ceiling measured in the same run
(``x.sum()`` over 2 GB).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.ops import gemv as G  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402

SHAPES = [(28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672), (4096, 4096)]
MS = (1, 2, 4, 8, 16, 32, 64)
T0 = time.time()
LOG = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def rand_canonical(N, K, k, B=32, sf="log8", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Kp = -(-K // B) * B
    codes = torch.randint(-(2**31), 2**31 - 1, (N, Kp * k // 32), generator=g, dtype=torch.int32, device="cuda")
    if sf == "log8":
        scales = torch.randint(0, 64, (N, Kp // B), generator=g, dtype=torch.uint8, device="cuda")
        if N > 3:
            scales[:, 0] = 255
        ts = torch.rand((), generator=g, device="cuda") + 0.5
    else:
        scales = (torch.rand(N, Kp // B, generator=g, device="cuda") + 0.05).half()
        ts = torch.ones((), device="cuda")
    cb = torch.sort(torch.rand(2**k, generator=g, device="cuda") * 2 - 1).values
    return codes, scales, ts, cb


def rand_repacked(N, K, k, seed):
    """Random weights directly in the repacked layout (timing only: random codes are random in any layout)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nt, s = -(-N // 16), -(-K // 256)
    rc = torch.randint(-(2**31), 2**31 - 1, (nt, s, k, 32, 4), generator=g, dtype=torch.int32, device="cuda")
    rs = torch.randint(0, 64, (nt, s, 8, 16), generator=g, dtype=torch.uint8, device="cuda")
    ts = torch.rand((), generator=g, device="cuda") + 0.5
    cb = torch.sort(torch.rand(2**k, generator=g, device="cuda") * 2 - 1).values
    return rc, rs, ts, cb


def canonical_bytes(N, K, k):
    return N * K * k // 8 + N * (K // 32) + 4 + 4 * 2**k


def rel_err(y, ref):
    if torch.isnan(y).any():
        return float("nan")
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------ correctness
def correctness(full, prewarm_first=False):
    cases = []
    for k in (2, 3, 4, 5):
        for dt in (torch.float16, torch.bfloat16):
            for M in ((1, 3, 8, 9, 17, 33, 64) if full else (1, 8, 33)):
                cases.append((2880, 5120, k, M, dt, 32, "log8", False))
    cases += [(5120, 2880, k, 4, torch.bfloat16, 32, "log8", True) for k in (2, 3, 4, 5)]
    cases += [(18944, 1, 4, 1, torch.float16, 32, "log8", False), (1, 18944, 3, 2, torch.bfloat16, 32, "log8", True),
              (17, 300, 5, 7, torch.float16, 64, "fp16", True), (1000, 4000, 2, 5, torch.float16, 128, "log8", True),
              (1000, 4000, 4, 16, torch.bfloat16, 64, "fp16", False), (64, 8192, 4, 2, torch.float16, 32, "log8", True),
              (2048, 768, 3, 1, torch.bfloat16, 32, "log8", False),
              (4096, 4096, 4, 1, torch.float16, 32, "log8", False)]
    if prewarm_first:
        cfg = tuple(int(v) for v in os.environ["KBIT_MMA_CFG"].split(","))
        prewarm(sorted({(k, M, N, -(-K // 256) * 256, sf, cfg) for N, K, k, M, dt, B, sf, bias in cases}))
    return run_cases(cases)


def run_cases(cases, config=None, log_every=8):
    """``linear_small_m`` (twice: the split-K workspace must be left clean) against float64 on each
    (N, K, k, M, dtype, blocksize, scale format, bias) case; returns the failures."""
    fails, n = [], 0
    for N, K, k, M, dt, B, sf, bias in cases:
        w = rand_canonical(N, K, k, B, sf, seed=N + K + k + M)
        x = torch.randn(M, K, dtype=dt, device="cuda")
        b = torch.randn(N, dtype=dt, device="cuda") if bias else None
        kw = dict(k=k, blocksize=B, scale_format=sf, N=N, K=K, bias=b)
        torch.full((M, N), float("nan"), dtype=dt, device="cuda")  # poison the allocator's next block
        name = f"N={N} K={K} k={k} M={M} {str(dt)[6:]} B={B} {sf} bias={bias}"
        if config is not None:
            name = f"cfg={config} {name}"
        n += 1
        try:
            ys = [MM.linear_small_m(x, *w, **kw, config=config) for _ in range(2)]
            ref = G.gemv_reference(x, *w, **kw)
            e = max(rel_err(y, ref) for y in ys)
        except Exception as ex:  # noqa: BLE001
            log(f"check {name}: FAILED {repr(ex)[:600]}")
            fails.append((name, "exception", repr(ex)[:200]))
            continue
        ok = e < (2e-3 if dt == torch.float16 else 1.2e-2)
        if not ok or n % log_every == 0:
            log(f"check {name}: rel err {e:.2e} {'ok' if ok else 'FAIL'}")
        if not ok:
            fails.append((name, e))
    log(f"correctness: {n} cases, {len(fails)} failures ({time.time() - T0:.0f}s)")
    return fails


# ------------------------------------------------------------------------------------------ timing
_COPIES = {}


def copies(N, K, k):
    key = (N, K, k)
    if key not in _COPIES:
        _COPIES.clear()
        torch.cuda.empty_cache()
        nb = canonical_bytes(N, K, k)
        n = copies_for_cold_l2(nb, l2_bytes())
        _COPIES[key] = [rand_repacked(N, K, k, seed=i) for i in range(n)]
    return _COPIES[key]


def time_mma(N, K, k, M, dtype, config):
    ws = copies(N, K, k)
    x = torch.randn(M, K, dtype=dtype, device="cuda")
    y = torch.empty(M, N, dtype=dtype, device="cuda")
    kw = dict(k=k, scale_format="log8", N=N, K=K, M=M, Kp=K, config=config)
    calls = [(lambda w=w: MM._launch(x, w[0], w[1], w[2], w[3], None, y, **kw)) for w in ws]
    t = time_calls(calls)
    return t.us, canonical_bytes(N, K, k)


def time_bf16(N, K, M):
    nb = N * K * 2
    n = copies_for_cold_l2(nb, l2_bytes())
    ws = [torch.randn(N, K, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    t = time_calls([(lambda w=w: F.linear(x, w)) for w in ws])
    del ws
    torch.cuda.empty_cache()
    return t.us


def time_triton(N, K, k, M):
    one = rand_canonical(N, K, k)
    n = copies_for_cold_l2(canonical_bytes(N, K, k), l2_bytes())
    ws = [one] + [rand_canonical(N, K, k, seed=i + 1) for i in range(n - 1)]
    x = torch.randn(M, K, dtype=torch.float16, device="cuda")
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K)
    os.environ["KBIT_GEMV_BACKEND"] = "triton"
    try:
        t = time_calls([(lambda w=w: G.gemv(x, *w, **kw)) for w in ws])
    finally:
        os.environ.pop("KBIT_GEMV_BACKEND")
    del ws
    torch.cuda.empty_cache()
    return t.us


def kernel_info(k, M, dtype, config):
    p = MM.plan(k, M, 28672, 4096, "log8", config)
    return dict(regs=p["regs"], ctas_per_sm=p["ctas_per_sm"], D=p["defines"]["D"])


# ------------------------------------------------------------------------------------------ variants (issue 3)
def variant_cfgs(k, N, K):
    """The default, kernel 1 at its old default, kernel 3 at PIPE[k] without / with x in shared memory."""
    k1 = (1, 4, 4) if N * K >= MM.BIG else (1, 8, 2)
    out = [MM.default_config(k, 1, N, K), k1, (3, 8, 2, MM.PIPE[k]), (3, 8, 2, MM.PIPE[k], 1)]
    return [c for i, c in enumerate(out) if c not in out[:i]]


def prewarm(jobs):
    """Compile (k, M, N, K, scale_format, config) plans for both activation dtypes in parallel (NVRTC releases
    the GIL; the runtime's compile lock is lifted for this)."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import nullcontext

    from kbit.cuda.gemv_mma_src import SOURCE

    from kbit.cuda import compile_kernel, runtime

    def one(j):
        k, M, N, K, sf, cfg = j
        runtime._libcuda().cuCtxSetCurrent(ctx)
        try:
            p = MM.plan(k, M, N, K, sf, cfg)
            compile_kernel(SOURCE, "kbit_gemv_mma", {**p["defines"], "BF16": 1}, torch.device("cuda"))
        except Exception as e:  # noqa: BLE001
            log(f"prewarm {j}: {repr(e)[:200]}")

    import ctypes

    torch.cuda.current_stream()
    ctx = ctypes.c_void_p()
    runtime._libcuda().cuCtxGetCurrent(ctypes.byref(ctx))
    lock, runtime._LOCK = runtime._LOCK, nullcontext()
    try:
        with ThreadPoolExecutor(16) as ex:
            list(ex.map(one, jobs))
    finally:
        runtime._LOCK = lock
    log(f"prewarm: {len(jobs)} plans ({time.time() - T0:.0f}s)")


def variants(ks, ceiling, rows, left):
    """M = 1 timings of the kernel 1 default and the kernel 3 candidates on SHAPES."""
    prewarm([(k, M, N, K, "log8", c) for k in ks for N, K in SHAPES for c in variant_cfgs(k, N, K) for M in (1, 8)])
    for k in ks:
        for N, K in SHAPES:
            for M in ((1, 8) if N >= MM.TALL else (1,)):
                line = []
                for cfg in variant_cfgs(k, N, K):
                    if left() < 10:
                        break
                    try:
                        us, nb = time_mma(N, K, k, M, torch.float16, cfg)
                    except Exception as e:  # noqa: BLE001
                        log(f"variant {N}x{K} k={k} M={M} {cfg}: FAILED {repr(e)[:300]}")
                        continue
                    tb = nb / us / 1e6
                    rows.append(dict(kind="variant", N=N, K=K, k=k, M=M, cfg=cfg, us=us, tbps=tb,
                                     pct=100 * tb / ceiling))
                    line.append(f"{cfg}: {us:.2f} us {100 * tb / ceiling:.0f}%")
                log(f"variants k={k} {N}x{K} M={M}: " + " | ".join(line))


def ncu_launches():
    """One launch each of kernel 1 (default) and kernel 3 at 28672x4096, k = 2 and 4 (for ncu)."""
    N, K = 28672, 4096
    for k in (2, 4):
        for cfg in (None, (3, 8, 2, 3)):
            rc, rs, ts, cb = rand_repacked(N, K, k, 0)
            x = torch.randn(1, K, dtype=torch.float16, device="cuda")
            y = torch.empty(1, N, dtype=torch.float16, device="cuda")
            MM._launch(x, rc, rs, ts, cb, None, y, k=k, scale_format="log8", N=N, K=K, M=1, Kp=K, config=cfg)
            torch.cuda.synchronize()
            print(f"ncu launch k={k} cfg={cfg or MM.default_config(k, 1, N, K)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", action="store_true", help="kernel 3 candidates vs kernel 1 at M = 1 only")
    ap.add_argument("--ncu", action="store_true", help="only the launches to profile (run under ncu)")
    ap.add_argument("--check-cfg", default="", help="KBIT_MMA_CFG for the correctness pass")
    ap.add_argument("--budget", type=float, default=270)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="config sweep at M = 1 first")
    ap.add_argument("--full-checks", action="store_true")
    ap.add_argument("--tag", default="lab")
    ap.add_argument("--ks", default="4,2,3,5")
    ap.add_argument("--triton", action="store_true", help="also time the Triton GEMV at M = 1")
    args = ap.parse_args()
    if args.ncu:
        ncu_launches()
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": str(datetime.date.today()),
           "commit": os.environ.get("KBIT_COMMIT", "?"), "command": " ".join(sys.argv), "tag": args.tag}
    log("device", res)

    def left():
        return args.budget - (time.time() - T0)

    from kbit.bench.ceiling import measure_read_ceiling

    ceiling = measure_read_ceiling().read_tbps
    res["ceiling_tbps"] = ceiling
    log(f"read ceiling {ceiling:.3f} TB/s ({time.time() - T0:.0f}s)")
    if args.check_cfg:
        os.environ["KBIT_MMA_CFG"] = args.check_cfg
    res["fails"] = correctness(args.full_checks, prewarm_first=bool(args.check_cfg))
    os.environ.pop("KBIT_MMA_CFG", None)
    MM._PLANS.clear()
    rows = []
    res["rows"] = rows
    ks = [int(v) for v in args.ks.split(",")]
    if args.variants:
        variants(ks, ceiling, rows, left)
        (out / "mma.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "mma.log").write_text("\n".join(LOG))
        print(f"fails: {res['fails']}  elapsed {time.time() - T0:.0f}s")
        return

    def dump():
        (out / "mma.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "mma.log").write_text("\n".join(LOG))

    dump()
    best = {}
    if args.sweep:
        for k in ks:
            d = MM.DEPTH[k]
            cands = [(1, 8, 2), (1, 8, 3), (1, 4, 4), (1, 16, 1), (2, 16, d), (2, 16, 2), (2, 8, 2 * d)]
            tot = {}
            for N, K in SHAPES:
                for cfg in cands:
                    if left() < 0.55 * args.budget:
                        break
                    try:
                        us, nb = time_mma(N, K, k, 1, torch.float16, cfg)
                    except Exception as e:  # noqa: BLE001
                        log(f"sweep {N}x{K} k={k} {cfg}: FAILED {repr(e)[:300]}")
                        continue
                    tb = nb / us / 1e6
                    info = kernel_info(k, 1, torch.float16, cfg)
                    rows.append(dict(kind="sweep", N=N, K=K, k=k, M=1, cfg=cfg, us=us, tbps=tb, **info))
                    log(f"sweep {N}x{K} k={k} cfg={cfg} {info}: {us:.2f} us {tb:.3f} TB/s {100 * tb / ceiling:.0f}%")
                    cls = N * K >= MM.BIG
                    tot.setdefault(cls, {})
                    tot[cls][cfg] = tot[cls].get(cfg, 0) + us
            for cls, t in tot.items():
                best[(k, cls)] = min(t, key=t.get)
        log("best configs:", best)
        res["best"] = {f"k={k} big={cls}": v for (k, cls), v in best.items()}
        dump()
    bf = {}
    for k in ks:
        for N, K in SHAPES:
            for M in MS:
                if left() < 25:
                    break
                cfg = best.get((k, N * K >= MM.BIG))
                if cfg is not None and M > 16:
                    cfg = (1, 8, 1) if cfg[0] == 1 else (2, 8, cfg[2])
                try:
                    us, nb = time_mma(N, K, k, M, torch.float16, cfg)
                except Exception as e:  # noqa: BLE001
                    log(f"mma {N}x{K} k={k} M={M}: FAILED {repr(e)[:300]}")
                    continue
                if (N, K, M) not in bf and left() > 40:
                    bf[(N, K, M)] = time_bf16(N, K, M)
                b = bf.get((N, K, M))
                tb = nb / us / 1e6
                rows.append(dict(kind="mma", N=N, K=K, k=k, M=M, dtype="float16",
                                 cfg=cfg or MM.default_config(k, M, N, K), us=us, tbps=tb, pct=100 * tb / ceiling,
                                 bf16_us=b))
                log(f"mma {N}x{K} k={k} M={M}: {us:.2f} us {tb:.3f} TB/s {100 * tb / ceiling:.0f}% "
                    f"bf16 {b if b is None else round(b, 2)} us")
            dump()
    # bf16 activations, k = 4, M = 1
    for N, K in SHAPES:
        if left() < 15 or 4 not in ks:
            break
        us, nb = time_mma(N, K, 4, 1, torch.bfloat16, best.get((4, N * K >= MM.BIG)))
        tb = nb / us / 1e6
        rows.append(dict(kind="mma", N=N, K=K, k=4, M=1, dtype="bfloat16", us=us, tbps=tb, pct=100 * tb / ceiling,
                         bf16_us=bf.get((N, K, 1))))
        log(f"mma bf16-act {N}x{K} k=4 M=1: {us:.2f} us {100 * tb / ceiling:.0f}%")
    if args.triton:
        for N, K in SHAPES:
            if left() < 15:
                break
            us = time_triton(N, K, 4, 1)
            rows.append(dict(kind="triton", N=N, K=K, k=4, M=1, us=us))
            log(f"triton gemv {N}x{K} k=4 M=1: {us:.2f} us")
    _COPIES.clear()
    dump()
    md = table(res, ceiling)
    (out / "mma.md").write_text(md)
    print(md)
    print(f"fails: {res['fails']}  elapsed {time.time() - T0:.0f}s")


def table(res, ceiling):
    rows = [r for r in res["rows"] if r["kind"] == "mma" and r["dtype"] == "float16"]
    lines = [f"# mma small-M kernel ({res['device']}, {res['date']}, commit {res['commit']}, tag {res['tag']})", "",
             f"Command: `{res['command']}`. Read ceiling {ceiling:.3f} TB/s. Cells: us / TB/s / % of ceiling / "
             "speedup vs bf16 F.linear / time ratio to M = 1 (fp16 activations, log8 B = 32).", ""]
    for k in sorted({r["k"] for r in rows}):
        lines += [f"## k = {k}", "", "| shape | " + " | ".join(f"M={m}" for m in MS) + " |",
                  "|---|" + "---|" * len(MS)]
        for N, K in SHAPES:
            r1 = [r for r in rows if r["k"] == k and r["N"] == N and r["K"] == K and r["M"] == 1]
            cells = []
            for M in MS:
                r = [r for r in rows if r["k"] == k and r["N"] == N and r["K"] == K and r["M"] == M]
                if not r:
                    cells.append("-")
                    continue
                r = r[0]
                sp = f"{r['bf16_us'] / r['us']:.2f}x" if r.get("bf16_us") else "-"
                ratio = f"{r['us'] / r1[0]['us']:.2f}" if r1 else "-"
                cells.append(f"{r['us']:.1f} / {r['tbps']:.2f} / {r['pct']:.0f}% / {sp} / {ratio}")
            lines.append(f"| {N}x{K} | " + " | ".join(cells) + " |")
        lines.append("")
    sw = [r for r in res["rows"] if r["kind"] == "sweep"]
    if sw:
        lines += ["## config sweep (M = 1, fp16; cfg = (warps a CTA, pipeline stages))", ""]
        for r in sw:
            lines.append(f"- {r['N']}x{r['K']} k={r['k']} cfg={tuple(r['cfg'])} regs={r['regs']} "
                         f"ctas/SM={r['ctas_per_sm']}: {r['us']:.2f} us, {100 * r['tbps'] / ceiling:.0f}%")
        lines.append("")
    other = [r for r in res["rows"] if r["kind"] in ("triton",) or (r["kind"] == "mma" and r["dtype"] != "float16")]
    for r in other:
        lines.append(f"- {r['kind']} {r.get('dtype', '')} {r['N']}x{r['K']} k={r['k']} M=1: {r['us']:.2f} us")
    lines.append(f"\nCorrectness failures: {res['fails']}")
    return "\n".join(lines) + "\n"


_ = statistics
if __name__ == "__main__":
    main()

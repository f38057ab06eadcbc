"""GPU lab: programmatic dependent launch (PDL) for the tensor-core kernels (kbit.ops.gemv_mma), on and off.

    PYTHONUNBUFFERED=1 python lab/pdl_lab.py [--ks 4,2,3,5] [--ms 1,4,8,16,32,64,128] [--budget S] [--out DIR]

1. Correctness of chained calls: y1 = lin_a(x), y2 = lin_b(y1), y3 = lin_a'(y2 * 2) (a torch kernel between),
   eager and in a CUDA graph, PDL on, each against float64 references built from the same chain.
2. Cold-L2 timing (``kbit.bench.timing.time_calls``: one graph over weight copies > 8x L2, median of 15 replays)
   of the default kernel per (k, shape, M), PDL off then on, bf16 activations; bf16 ``F.linear`` in the same run.
   Consecutive calls in the graph are independent (each reads its own weight copy, writes its own y): with
   PDL a call's weight prologue overlaps the previous call's tail, as it would after another kbit layer.

Writes ``pdl.json`` / ``pdl.log`` under ``--out`` (default ``$OUT``), prints a table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "lab"))

import mma_lab as L  # noqa: E402
import torch  # noqa: E402

from kbit.bench.timing import time_calls  # noqa: E402
from kbit.cuda import runtime  # noqa: E402
from kbit.ops import gemv as G  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402

T0 = time.time()


def chain_check():
    """Chained dependent calls, eager and graph-replayed with PDL on, against float64."""
    fails = 0
    for k, M, (N1, K1), dt in [(4, 1, (4096, 4096), torch.bfloat16), (2, 1, (2880, 5120), torch.float16),
                               (3, 8, (5120, 2880), torch.bfloat16), (5, 3, (1024, 4096), torch.float16),
                               (4, 16, (4096, 2048), torch.bfloat16), (4, 64, (2048, 4096), torch.bfloat16),
                               (4, 200, (2048, 4096), torch.bfloat16), (2, 40, (4096, 1024), torch.float16)]:
        wa = L.rand_canonical(N1, K1, k, seed=1)
        wb = L.rand_canonical(K1, N1, k, seed=2)
        ka = dict(k=k, blocksize=32, scale_format="log8", N=N1, K=K1)
        kb = dict(k=k, blocksize=32, scale_format="log8", N=K1, K=N1)
        x = torch.randn(M, K1, dtype=dt, device="cuda")

        def chain(x=x, wa=wa, wb=wb, ka=ka, kb=kb):
            y1 = MM.linear_small_m(x, *wa, **ka)
            y2 = MM.linear_small_m(y1, *wb, **kb)
            return y1, y2, MM.linear_small_m(y2 * 2, *wa, **ka)

        eager = chain()
        r1 = G.gemv_reference(x, *wa, **ka)
        r2 = G.gemv_reference(eager[0], *wb, **kb)
        r3 = G.gemv_reference(eager[1] * 2, *wa, **ka)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chain()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            out = chain()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        tol = 2e-3 if dt == torch.float16 else 1.2e-2
        errs = [L.rel_err(a, r) for a, r in zip(eager, (r1, r2, r3), strict=True)]
        errs += [L.rel_err(a, r) for a, r in zip(out, (r1, r2, r3), strict=True)]
        ok = all(e < tol for e in errs)
        fails += not ok
        L.log(f"chain k={k} M={M} {N1}x{K1} {str(dt)[6:]}: max rel err {max(errs):.2e} {'ok' if ok else 'FAIL'}")
    return fails


def time_one(N, K, k, M, dtype=torch.bfloat16):
    ws = L.copies(N, K, k)
    x = torch.randn(M, K, dtype=dtype, device="cuda")
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K, config=None)
    calls = [(lambda w=w: MM._run(x, w[0], w[1], w[2], w[3], None, **kw)) for w in ws]
    return time_calls(calls).us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="4,2,3,5")
    ap.add_argument("--ms", default="1,4,8,16,32,64,128")
    ap.add_argument("--shapes", default="28672x4096,4096x14336,57344x8192,8192x28672,4096x4096")
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ks = [int(v) for v in args.ks.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": str(datetime.date.today()),
           "commit": os.environ.get("KBIT_COMMIT", "?"), "command": " ".join(sys.argv), "rows": []}
    L.log("device", res)
    from kbit.bench.ceiling import measure_read_ceiling

    ceiling = res["ceiling_tbps"] = measure_read_ceiling().read_tbps
    L.log(f"read ceiling {ceiling:.3f} TB/s")
    jobs = sorted({(k, M, N, -(-K // 256) * 256, "log8", None) for k in ks for N, K in shapes for M in ms
                   if not MM.uses_large(M, N, K, torch.device("cuda"), None)})
    L.prewarm(jobs)
    if not args.no_check:
        res["chain_fails"] = chain_check()
        res["case_fails"] = L.run_cases([(2880, 5120, k, M, dt, 32, "log8", b) for k in (2, 3, 4, 5)
                                         for M, dt, b in ((1, torch.bfloat16, False), (5, torch.float16, True),
                                                          (24, torch.bfloat16, True), (100, torch.bfloat16, False))],
                                        log_every=1)

    def dump():
        (out / "pdl.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "pdl.log").write_text("\n".join(L.LOG))

    bf = {}
    for k in ks:
        for N, K in shapes:
            for M in ms:
                if time.time() - T0 > args.budget:
                    break
                t = {}
                for pdl in (False, True):
                    runtime.set_pdl(pdl)
                    try:
                        t[pdl] = time_one(N, K, k, M)
                    except Exception as e:  # noqa: BLE001
                        L.log(f"{N}x{K} k={k} M={M} pdl={pdl}: FAILED {repr(e)[:300]}")
                runtime.set_pdl(True)
                if len(t) < 2:
                    continue
                if (N, K, M) not in bf:
                    bf[(N, K, M)] = L.time_bf16(N, K, M)
                nb = L.canonical_bytes(N, K, k)
                cfg = MM.large_config(k, M, N, K) if MM.uses_large(M, N, K, torch.device("cuda"), None) \
                    else MM.default_config(k, M, N, K)
                row = dict(N=N, K=K, k=k, M=M, cfg=cfg, us_off=t[False], us_on=t[True], bf16_us=bf[(N, K, M)],
                           pct_off=100 * nb / t[False] / 1e6 / ceiling, pct_on=100 * nb / t[True] / 1e6 / ceiling)
                res["rows"].append(row)
                L.log(f"{N}x{K} k={k} M={M} cfg={cfg}: off {t[False]:.2f} us ({row['pct_off']:.0f}%) on {t[True]:.2f} "
                      f"us ({row['pct_on']:.0f}%) bf16 {bf[(N, K, M)]:.2f} us -> x{bf[(N, K, M)] / t[True]:.2f}")
            dump()
    dump()
    print("\n| k | shape | M | PDL off us | PDL on us | % ceiling on | x bf16 on |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['k']} | {r['N']}x{r['K']} | {r['M']} | {r['us_off']:.2f} | {r['us_on']:.2f} | {r['pct_on']:.0f} | "
              f"{r['bf16_us'] / r['us_on']:.2f} |")
    print(f"chain fails {res.get('chain_fails')} case fails {res.get('case_fails')} elapsed {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()

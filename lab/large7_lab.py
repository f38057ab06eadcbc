"""GPU lab for kernel 7 of ``kbit.ops.gemv_mma`` (large M, sm_90a wgmma: looked-up weights as the register A
operand, x chunks read by the tensor cores from shared memory) against bf16 ``F.linear`` and dequantize + cuBLAS
(the large-M default before it), in one call.

    PYTHONUNBUFFERED=1 python lab/large7_lab.py [--cfgs "7,8,16,4;7,8,32,4"] [--ms 128,256,1024,4096]
        [--ks 4] [--shapes 28672x4096,...] [--no-check] [--budget S]

Correctness first (float64 reference: every k, both dtypes, M 65..1000, odd N, bias, fp16 scales, blocksizes,
split K), then cold-L2 CUDA-graph timings (``kbit.bench.timing.time_calls``: weight copies > 8x L2, median of
15). x is permuted on every call (timed). Writes ``large7.json`` / ``large7.log`` under ``$OUT``; prints a short
table last.
"""

from __future__ import annotations

import argparse
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
import torch.nn.functional as F  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402
from kbit.ops.dequant import dequantize_tensors  # noqa: E402

SHAPES = [(28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]


def check(cfgs, quick=False):
    cases = []
    for k in (2, 3, 4, 5):
        for dt in (torch.float16, torch.bfloat16):
            if not quick or (k, dt) in ((4, torch.bfloat16), (3, torch.float16)):
                cases.append((2880, 5120, k, 100 if dt == torch.float16 else 300, dt, 32, "log8", False))
    cases += [(1000, 4000, 4, 65, torch.bfloat16, 64, "fp16", True),
              (17, 300, 5, 129, torch.float16, 128, "log8", True),
              (256, 8192, 4, 128, torch.bfloat16, 32, "log8", False),  # 1 row block: split K
              (4096, 1024, 3, 1000, torch.float16, 32, "fp16", False),
              (8192, 1024, 4, 2000, torch.bfloat16, 32, "log8", False),
              (5120, 2880, 2, 257, torch.bfloat16, 32, "log8", True)]
    fails = []
    for M, Kw, bt in [(1, 256, 128), (100, 512, 128), (300, 4096, 256), (256, 768, 256)]:
        for dt in (torch.float16, torch.bfloat16):
            x = torch.randn(M, Kw, dtype=dt, device="cuda")
            ok = torch.equal(MM._x_tiles(x, bt, Kw // 256), MM._x_tiles_reference(x, bt, Kw // 256))
            L.log(f"check x tiles M={M} Kw={Kw} bt={bt} {dt}: {'ok' if ok else 'FAIL'}")
            if not ok:
                fails.append((f"x tiles {M} {Kw} {bt} {dt}", "mismatch"))
    return fails + [f for cfg in cfgs for f in L.run_cases(cases, config=cfg, log_every=1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfgs", default="7,8,16,4;7,8,32,4")
    ap.add_argument("--check-cfgs", default="7,8,16,4;7,8,32,3")
    ap.add_argument("--ms", default="128,256,1024,4096")
    ap.add_argument("--ks", default="4")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--quick-check", action="store_true")
    ap.add_argument("--no-deq", action="store_true")
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--ncu", default="", help="NxKxM: one launch of each --cfgs there (run under ncu), nothing else")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.ncu:
        N, K, M = (int(v) for v in a.ncu.split("x"))
        for cfg in [tuple(int(v) for v in c.split(",")) for c in a.cfgs.split(";") if c]:
            rc, rs, ts, cb = L.rand_repacked(N, K, 4, 0)
            x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
            y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
            MM._launch(x, rc, rs, ts, cb, None, y, k=4, scale_format="log8", N=N, K=K, M=M, Kp=K, config=cfg)
            torch.cuda.synchronize()
            print(f"ncu launch cfg={cfg}", flush=True)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cfgs = [None if c == "default" else tuple(int(v) for v in c.split(",")) for c in a.cfgs.split(";") if c]
    rows, fails = [], []

    def dump():
        (out / "large7.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get(
            "KBIT_COMMIT", "?"), rows=rows, fails=[list(map(str, f)) for f in fails]), indent=1))
        (out / "large7.log").write_text("\n".join(L.LOG))

    if not a.no_check:
        fails = check([tuple(int(v) for v in c.split(",")) for c in a.check_cfgs.split(";") if c], a.quick_check)
        dump()
    shapes = SHAPES if not a.shapes else [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    for k in [int(v) for v in a.ks.split(",")]:
        for N, K in shapes:
            deq_w = None
            for M in [int(v) for v in a.ms.split(",")]:
                if time.time() - t0 > a.budget:
                    L.log("budget reached")
                    break
                bf = L.time_bf16(N, K, M)
                r = dict(k=k, N=N, K=K, M=M, bf16_us=bf)
                for cfg in cfgs:
                    name = ",".join(map(str, cfg)) if cfg else "default"
                    if cfg is None and M > MM.MAX_M:
                        continue
                    try:
                        us, nb = L.time_mma(N, K, k, M, torch.bfloat16, cfg)
                        r[name] = us
                    except Exception as ex:  # noqa: BLE001
                        L.log(f"  {name} failed: {repr(ex)[:300]}")
                        r[name] = None
                if not a.no_deq:
                    if deq_w is None:
                        L._COPIES.clear()
                        torch.cuda.empty_cache()
                        nb = L.canonical_bytes(N, K, k)
                        deq_w = [L.rand_canonical(N, K, k, seed=i) for i in range(copies_for_cold_l2(nb, l2_bytes()))]
                    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")

                    def deq(w, x=x, N=N, K=K, k=k):
                        wd = dequantize_tensors(*w, k=k, blocksize=32, scale_format="log8", shape=(N, K),
                                                dtype=x.dtype)
                        return F.linear(x, wd)
                    r["deq+cublas"] = time_calls([(lambda w=w: deq(w)) for w in deq_w]).us
                rows.append(r)
                L.log(f"k={k} {N}x{K} M={M} bf16 {bf:.1f} " + " ".join(
                    f"{n}={v:.1f}({bf / v:.2f}x)" for n, v in r.items() if n not in ("k", "N", "K", "M", "bf16_us")
                    and v))
                dump()
            del deq_w
            L._COPIES.clear()
            torch.cuda.empty_cache()
    L.log(f"\ncorrectness failures: {len(fails)}")
    for f in fails[:20]:
        L.log(f"  {f}")
    names = [",".join(map(str, c)) if c else "default" for c in cfgs] + ([] if a.no_deq else ["deq+cublas"])
    L.log("| k | shape | M | bf16 us | " + " | ".join(names) + " |")
    for r in rows:
        L.log(f"| {r['k']} | {r['N']}x{r['K']} | {r['M']} | {r['bf16_us']:.1f} | " + " | ".join(
            (f"{r[n]:.1f} ({r['bf16_us'] / r[n]:.2f}x)" if r.get(n) else "-") for n in names) + " |")
    dump()


if __name__ == "__main__":
    main()

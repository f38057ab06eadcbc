"""GPU lab for mid M (9..64 tokens) dense k-bit GEMM: kernel 4 of ``kbit.ops.gemv_mma`` (staged x, RT row tiles
a warp, scales folded into the A fragments) against the current default and bf16 ``F.linear``, in one call.

    PYTHONUNBUFFERED=1 python scripts/mid_lab.py [--cfgs "4,4,1,3;4,4,2,3"] [--ms 16,32,64] [--ks 4] [--budget S]

Correctness first (float64 reference, every k, both dtypes, odd shapes, fp16 scales, bias, split K), then
cold-L2 CUDA-graph timings (``kbit.bench.timing.time_calls``, weight copies > 8x L2, median of 15). Writes
``mid.json`` and ``mid.log`` under ``$OUT`` and prints a short table last.
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
sys.path.insert(0, str(ROOT / "scripts"))

import mma_lab as L  # noqa: E402
import torch  # noqa: E402

from kbit.ops import gemv_mma as MM  # noqa: E402

SHAPES = [(28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfgs", default="4,4,1,3;4,4,2,3;4,8,1,3;4,8,2,2")
    ap.add_argument("--check-cfgs", default="4,4,2,3;4,8,1,2")
    ap.add_argument("--ms", default="16,32,64")
    ap.add_argument("--ks", default="4")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--no-default", action="store_true", help="do not time the default config (M > 64)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cfgs = [tuple(int(v) for v in c.split(",")) for c in a.cfgs.split(";") if c]
    rows, fails = [], []

    def dump():
        (out / "mid.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get(
            "KBIT_COMMIT", "?"), rows=rows, fails=[list(map(str, f)) for f in fails]), indent=1))
        (out / "mid.log").write_text("\n".join(L.LOG))

    for c in a.check_cfgs.split(";"):
        if not c:
            continue
        os.environ["KBIT_MMA_CFG"] = c
        MM._PLANS.clear()
        L.log(f"== correctness with KBIT_MMA_CFG={c}")
        fails += [(c, *f) for f in L.correctness(False)]
        os.environ.pop("KBIT_MMA_CFG")
        MM._PLANS.clear()
        dump()
    shapes = SHAPES if not a.shapes else [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    for k in [int(v) for v in a.ks.split(",")]:
        for N, K in shapes:
            for M in [int(v) for v in a.ms.split(",")]:
                if time.time() - t0 > a.budget:
                    L.log("budget reached")
                    break
                bf = L.time_bf16(N, K, M)
                r = dict(k=k, N=N, K=K, M=M, bf16_us=bf)
                for cfg in ([] if a.no_default else [None]) + cfgs:
                    name = "default" if cfg is None else ",".join(map(str, cfg))
                    try:
                        us, nb = L.time_mma(N, K, k, M, torch.bfloat16, cfg)
                        r[name] = us
                    except Exception as ex:  # noqa: BLE001
                        L.log(f"  {name} failed: {repr(ex)[:300]}")
                        r[name] = None
                rows.append(r)
                L.log(f"k={k} {N}x{K} M={M} bf16 {bf:.1f} " + " ".join(
                    f"{n}={v:.1f}({bf / v:.2f}x)" for n, v in r.items() if n not in ("k", "N", "K", "M", "bf16_us")
                    and v))
                dump()
    L.log(f"\ncorrectness failures: {len(fails)}")
    for f in fails[:20]:
        L.log(f"  {f}")
    names = ([] if a.no_default else ["default"]) + [",".join(map(str, c)) for c in cfgs]
    L.log("| k | shape | M | bf16 us | " + " | ".join(names) + " |")
    for r in rows:
        L.log(f"| {r['k']} | {r['N']}x{r['K']} | {r['M']} | {r['bf16_us']:.1f} | " + " | ".join(
            (f"{r[n]:.1f} ({r['bf16_us'] / r[n]:.2f}x)" if r.get(n) else "-") for n in names) + " |")
    dump()


if __name__ == "__main__":
    main()

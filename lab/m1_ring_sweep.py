"""GPU lab: kernel 3 at M = 1 with deeper register rings and fewer warps an SM, on the large suite shapes where kbit
trails humming (issue 32). The tuner's space holds rings 2 and 3 at (4 warps x 4 CTAs, 8 x 2, 16 x 1); this times
rings up to 8 (``PD``, segments in flight + 1) at fewer warps, against the dispatcher's pick, as ``kbit tune`` times
(``kbit.bench.tune.Measure``: cold L2, graphs, output checked against the dispatcher's).

    PYTHONUNBUFFERED=1 python lab/m1_ring_sweep.py --k 4 --out $OUT/ring.json
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

from kbit.bench.timing import l2_bytes  # noqa: E402
from kbit.bench.tune import Measure, quantized_weight  # noqa: E402
from kbit.bench.tune_build import _compile, candidate_builds  # noqa: E402
from kbit.cuda import runtime, sources  # noqa: E402
from kbit.ops import gemv_mma  # noqa: E402
from kbit.tuning.mma import MmaConfig  # noqa: E402
from kbit.tuning.mma_plan import KERNELS  # noqa: E402
from kbit.tuning.space import Candidate, infeasible  # noqa: E402
from kbit.utils.device import sm_count  # noqa: E402

SHAPES = [(16384, 53248), (100352, 5120), (128256, 16384), (8192, 29568), (128256, 8192), (16384, 16384),
          (57344, 8192), (28672, 4096), (4096, 14336)]


def configs() -> list[MmaConfig]:
    out = []
    for w, c, rings in ((8, 2, (2, 3, 4)), (16, 1, (2, 3, 4, 6)), (8, 1, (4, 6, 8)), (4, 2, (6, 8)), (4, 4, (3, 4)),
                        (12, 1, (3, 4, 6))):
        for r in rings:
            for xs in (True, False):
                out.append(MmaConfig(3, w, min_ctas=c, ring=r, x_smem=xs))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="4")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=330.0)
    a = ap.parse_args()
    ks = [int(v) for v in a.k.split(",")]
    dev = torch.device("cuda")
    sms, l2 = sm_count(dev), l2_bytes(dev)
    arch = {f: runtime.device_arch(dev, f in sources.ARCH_SPECIFIC) for f, _ in KERNELS.values()}
    jobs = [(N, K, k, Candidate("mma", c)) for k in ks for N, K in SHAPES for c in configs()]
    jobs = [j for j in jobs if infeasible(j[3], j[2], 1, j[0], j[1]) is None]
    builds = {b for N, K, k, cand in jobs for b in candidate_builds(cand, k, 1, N, K, sms)}
    t0 = time.time()
    with cf.ProcessPoolExecutor(max(1, (os.cpu_count() or 2) - 1),
                                mp_context=multiprocessing.get_context("spawn")) as pool:
        bad = sum(1 for f in [pool.submit(_compile, f, d, arch[f]) for f, d in builds] if f.exception())
    print(f"{torch.cuda.get_device_name(dev)}: {len(builds)} builds in {time.time() - t0:.0f} s, {bad} failed",
          flush=True)
    start, res = time.time(), []
    for k in ks:
        for N, K in SHAPES:
            if time.time() - start > a.budget_s:
                print(f"budget: stopped before {N}x{K} k={k}", flush=True)
                break
            m = Measure(quantized_weight(N, K, k, 0, dev), 15, l2)
            disp = m.set_m(1, 0)
            pick = gemv_mma.launch_config(k, 1, N, K, dev)
            rows = {}
            for N_, K_, k_, cand in jobs:
                if (N_, K_, k_) != (N, K, k):
                    continue
                c = cand.config
                name = f"w{c.warps}x{c.min_ctas} r{c.ring}{' xs' if c.x_smem else ''}"
                try:
                    rows[name] = m(cand)
                except Exception as e:  # noqa: BLE001 - one config failing ends only itself
                    rows[name] = None
                    print(f"  {name}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            again = m.set_m(1, 0)  # the dispatcher again, after the sweep (drift)
            ok = {n: v for n, v in rows.items() if v}
            best = min(ok, key=ok.get)
            res.append(dict(N=N, K=K, k=k, dispatcher=[disp, again], pick=str(pick), rows=rows))
            print(f"{N}x{K} k={k}: dispatcher {disp:.2f}/{again:.2f} [{pick}] best {best} {ok[best]:.2f} "
                  f"({ok[best] / min(disp, again):.3f})", flush=True)
            del m
            torch.cuda.empty_cache()
            with open(a.out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(dev), commit=os.environ.get("KBIT_COMMIT"),
                               results=res), f, indent=1)
    print("\n| shape | k | dispatcher us | best ring config | us | best / dispatcher |")
    print("|---|--:|--:|---|--:|--:|")
    for r in res:
        ok = {n: v for n, v in r["rows"].items() if v}
        best = min(ok, key=ok.get)
        d = min(r["dispatcher"])
        print(f"| {r['N']}x{r['K']} | {r['k']} | {d:.2f} | {best} | {ok[best]:.2f} | {ok[best] / d:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Do the swap-AB kernels' builds take the same registers for bf16 and fp16 activations? (No GPU: NVRTC and
cuobjdump.) A launch plan reads its occupancy from a build; since 2026-11-27 it plans with the activations' own
dtype (``BF16``) instead of fp16, so that the launch reuses the plan's build. Where the two dtypes' builds took
different registers across an allocation step, a plan could differ; this lists every build of the shipped tuned
table's picks (``kbit.bench.tune_build.candidate_builds``) whose registers, stack or static shared memory differ.

    python lab/plan_dtype_regs.py --nvrtc /path/to/libnvrtc.so.12 [--table h100] [--wgmma-every 4] [--jobs 2]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def builds(table: str) -> list[tuple[str, tuple]]:
    from kbit.bench.tune_build import candidate_builds
    from kbit.tuning.space import candidate_from_dict

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "kbit", "tuning")
    t = json.load(open(os.path.join(root, "configs", f"tuned-{table}.json")))
    out = set()
    for k, shapes in t["entries"].items():
        for shape, by_m in shapes.items():
            N, K = (int(v) for v in shape.split("x"))
            for M, e in by_m.items():
                for f, d in candidate_builds(candidate_from_dict(e["best"]), int(k), int(M), N, K, t.get("sms", 132)):
                    out.add((f, tuple((n, v) for n, v in d if n != "BF16")))
    return sorted(out)


def resources(args) -> tuple:
    f, d, bf16, nvrtc, cuobjdump = args
    from kbit import options
    from kbit.cuda import sources

    options.set_options(nvrtc_lib=nvrtc, cache_dir=None)
    cubin = sources.compile_source(f, {**dict(d), "BF16": bf16}, "sm_90a" if f == "wgmma.cu" else "sm_90")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as t:
        t.write(cubin)
        t.flush()
        res = subprocess.run([cuobjdump, "-res-usage", t.name], capture_output=True, text=True, check=True).stdout
    return tuple(int(m.group(1)) if (m := re.search(rf"{w}:(\d+)", res)) else 0 for w in ("REG", "STACK", "SHARED"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvrtc", required=True)
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--table", default="h100")
    ap.add_argument("--wgmma-every", type=int, default=4, help="every n-th kernel-7 build (each takes seconds)")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    cuobjdump = a.cuobjdump
    if cuobjdump is None:
        import triton

        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    b = builds(a.table)
    b = [x for x in b if x[0] != "wgmma.cu"] + [x for x in b if x[0] == "wgmma.cu"][::a.wgmma_every]
    jobs = [(f, d, v, a.nvrtc, cuobjdump) for f, d in b for v in (0, 1)]
    with cf.ProcessPoolExecutor(a.jobs) as ex:
        res = {(j[0], j[1], j[2]): r for j, r in zip(jobs, ex.map(resources, jobs), strict=True)}
    diff = [(f, d) for f, d in b if res[(f, d, 0)] != res[(f, d, 1)]]
    print(f"builds {len(b)} (table {a.table}), differing between fp16 and bf16: {len(diff)}")
    for f, d in diff:
        print(f"  {f} {dict(d)}: (regs, stack, shared) fp16 {res[(f, d, 0)]}, bf16 {res[(f, d, 1)]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

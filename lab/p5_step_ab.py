"""GPU lab: the decode step with and without k = 5's pair table in the fused prologue launches (q/k/v, gate/up):
``benchmarks/bench_e2e.py`` run as is, then with ``kbit.dispatch.prologue.prologue_config`` given no plain config
(the rule before the pair table: the prologue launches take the built-in kernel-3 config), then as is again (with
``--skip-bf16``), in one process, so that an order effect shows.

    PYTHONUNBUFFERED=1 python lab/p5_step_ab.py --models llama3-8b --k 5 --batch 1 --fuse-proj --no-kr --out $OUT

Every argument goes to bench_e2e; the second and third runs' ``--name`` get ``-noprologuepairs`` and ``-again``.
"""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_e2e  # noqa: E402

from kbit.dispatch import prologue  # noqa: E402


def main() -> int:
    argv = sys.argv[1:]
    name = argv[argv.index("--name") + 1] if "--name" in argv else "e2e"
    rest = [a for i, a in enumerate(argv) if a != "--name" and (i == 0 or argv[i - 1] != "--name")]
    rc = bench_e2e.main(rest + ["--name", name])
    real = prologue.prologue_config
    prologue.prologue_config = lambda k, M, N, K, plain=None: real(k, M, N, K)
    try:
        rc |= bench_e2e.main(rest + ["--skip-bf16", "--name", name + "-noprologuepairs"])
    finally:
        prologue.prologue_config = real
    return rc | bench_e2e.main(rest + ["--skip-bf16", "--name", name + "-again"])


if __name__ == "__main__":
    sys.exit(main())

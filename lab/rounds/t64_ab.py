"""GPU A/B of the 64 KB lookup table (T64, ``kbit.tuning.mma_plan.T64_K``) at M = 1 through the dispatcher, in one
``kbit bench`` process: candidates ``t64-on`` / ``t64-off`` (and a second round of each, ``-2``) are the dispatcher
with the planner allowed or refused the table for ``--t64-k`` (default: what the tree ships, 4). Each candidate's
factory sets the planner's ``T64_K`` and clears the plan cache before its first call, so that call plans and
compiles its own build and the CUDA graph captures it (the harness times one candidate at a time: plan, first call,
capture, replay). Same weights and x for every candidate; cold L2 and graphs as ``kbit bench``. Runs on a tree that
still has T64 (6c8dbdc and before: it was taken out in 0672202 after this A/B), e.g.
``PYTHONPATH=_trees/base/src``.

    PYTHONPATH=src python lab/rounds/t64_ab.py [--t64-k 4] -- <kbit bench arguments, without --candidates>

Then ``python lab/rounds/t64_table.py RESULTS.json`` (on/off per shape, medians of the rounds).
"""
from __future__ import annotations

import sys

from kbit.bench.registry import register
from kbit.cli import main as kbit_main
from kbit.dispatch import linear as dispatch_linear
from kbit.ops import gemv_mma
from kbit.tuning import mma_plan

ON = tuple(mma_plan.T64_K)


def _cand(name: str, t64: tuple[int, ...]):
    @register(name, note=f"the dispatcher with T64_K = {t64}", default=False)
    def _factory(qw, M):
        if mma_plan.T64_K != t64:
            mma_plan.T64_K = t64
            gemv_mma.PLANS.clear()
        kw = dict(k=qw.k, blocksize=qw.blocksize, scale_format=qw.scale_format, N=qw.shape[-2], K=qw.shape[-1])
        return lambda x: dispatch_linear.linear(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)
    return _factory


def main(argv: list[str]) -> int:
    ks = ON
    if argv[:1] == ["--t64-k"]:
        ks, argv = tuple(int(v) for v in argv[1].split(",")), argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    names = []
    for r in ("", "-2"):
        for tag, t in (("on", ks), ("off", ())):
            _cand(f"t64-{tag}{r}", t)
            names.append(f"t64-{tag}{r}")
    return kbit_main(["bench", *argv, "--candidates", ",".join(names)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

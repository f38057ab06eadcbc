"""GPU lab: what would splitting an MoE step's short last blocks off the grouped kernel 7 save?

For each model / T, on the routing of ``moe_lab.routing`` (sorted by expert), time in one call:
- ``bf16``: ``torch._grouped_mm`` with the gather (as moe_lab);
- ``k7``: the grouped kernel 7 on all rows (the default plan);
- ``main``: kernel 7 on the rows outside tail blocks (blocks of its block table with <= TAIL rows);
- ``tail4`` / ``tail8``: the grouped kernel 4 (``kbit_grouped_mma4``, 32- / 64-row blocks) on the tail rows only;
- ``tail7``: kernel 7 (64-row config) on the tail rows only.
``main + tail`` against ``k7`` says whether a split (kernel 4 serving the tails) is worth building.

    PYTHONUNBUFFERED=1 python scripts/moe_tail_lab.py [--models ...] [--tokens 1024,4096] [--tails 32,64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from moe_lab import MODELS, routing, set_kernel, weight_copies  # noqa: E402

from kbit.bench.timing import time_calls  # noqa: E402
from kbit.ops import grouped_mma as GM  # noqa: E402

LOG = []


def log(*a):
    s = " ".join(str(v) for v in a)
    print(s, flush=True)
    LOG.append(s)


def split_rows(rows, eids, bt, tail):
    """(main rows, main ids), (tail rows, tail ids): tail = rows of blocks (of ``bt``) with <= ``tail`` rows."""
    blk = GM.block_table_reference(eids, bt)
    keep = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    for b in range(len(blk) - 1):
        if blk[b + 1] - blk[b] <= tail:
            keep[blk[b]:blk[b + 1]] = False
    return (rows[keep], eids[keep]), (rows[~keep], eids[~keep])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--tails", default="32,64")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--more", action="store_true", help="also time kernel 1 (ng 4) and kernel 4 (ng 2) on the tails")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, k, table = time.time(), a.k, []
    for name in a.models.split(","):
        E, top, H, I = MODELS[name]
        for which, (N, K) in (("gate_up", (2 * I, H)), ("down", (H, I))):
            ws, wb = weight_copies(E, N, K, k)
            kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K, sorted_rows=True)
            for T in [int(v) for v in a.tokens.split(",")]:
                if time.time() - t0 > a.budget:
                    log("budget reached")
                    break
                rows, eids, offs = routing(T, E, top)
                x = torch.randn(T, K, dtype=torch.bfloat16, device="cuda")
                bf = time_calls([(lambda w=w, x=x, rows=rows, offs=offs:
                                  torch._grouped_mm(x.index_select(0, rows), w, offs=offs)) for w in wb]).us

                def t_k(kern, rr, ee, ng=None, ws=ws, x=x, kw=kw):
                    if kern is not None:
                        set_kernel(kern)
                    return time_calls([(lambda w=w: GM.grouped_linear(x, rr, ee, *w, **kw, ng=ng))
                                       for w in ws]).us if rr.numel() else 0.0

                set_kernel("7")
                GM.LARGE_MIN_ROWS = 48
                P = rows.shape[0]
                bt = GM._large_rows(P, E, "cuda")
                k7 = t_k("7", rows, eids) if bt else float("nan")
                GM.LARGE_MIN_ROWS = 48
                for tail in [int(v) for v in a.tails.split(",")]:
                    if not bt:
                        break
                    (mr, me), (tr, te) = split_rows(rows, eids, bt, tail)
                    # the main part keeps the full step's config (rows a block from P / E of the full step); the
                    # previous tail's kernel-7 config must not leak into it (it did in the first run)
                    os.environ.pop("KBIT_GROUPED_LARGE_CFG", None)
                    os.environ["KBIT_GROUPED_LARGE_CFG"] = ",".join(str(v) for v in GM.large_config(P / min(E, P)))
                    GM.LARGE_MIN_ROWS = 0
                    os.environ["KBIT_GROUPED_LARGE"] = "1"
                    main_us = t_k(None, mr, me)  # ng from the overridden config
                    os.environ.pop("KBIT_GROUPED_LARGE_CFG", None)
                    t4 = t_k("4", tr, te, ng=4)
                    t8 = t_k("4", tr, te, ng=8)
                    t7 = t_k("7:7.16.8.4.8.1.1", tr, te, ng=8)
                    if a.more:  # other tail kernels: kernel 1 with 32-row blocks, kernel 4 with 16-row blocks
                        t1 = t_k("1", tr, te, ng=4)
                        t42 = t_k("4", tr, te, ng=2)
                        log(f"    tail kernel 1 ng=4 {t1:.1f} us, kernel 4 ng=2 {t42:.1f} us")
                    GM.LARGE_MIN_ROWS = 48
                    ntail = int((te.numel() > 0) and torch.unique(te).numel())
                    r = (name, which, T, bt, tail, P, tr.shape[0], ntail, bf, k7, main_us, t4, t8, t7)
                    table.append(r)
                    best = main_us + min(t4, t8)
                    log(f"{name} {which} T={T} bt={bt} tail<={tail}: rows {P} tail rows {tr.shape[0]} "
                        f"({ntail} experts) | bf16 {bf:.1f} k7 {k7:.1f} ({bf / k7:.2f}x) | main {main_us:.1f} "
                        f"tail k4/32 {t4:.1f} k4/64 {t8:.1f} k7/64 {t7:.1f} | split {best:.1f} ({bf / best:.2f}x)")
                    (out / "moe_tail_lab.log").write_text("\n".join(LOG))
            del ws, wb
            torch.cuda.empty_cache()
    log("\n| model | gemm | T | bt | tail | tail rows | bf16 | k7 | main | +k4/32 | +k4/64 | +k7/64 |")
    log("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for (name, which, T, bt, tail, _P, ntr, ntail, bf, k7, m, t4, t8, t7) in table:
        log(f"| {name} | {which} | {T} | {bt} | {tail} | {ntr} ({ntail} e) | {bf:.1f} | {k7:.1f} | {m:.1f} | "
            f"{m + t4:.1f} | {m + t8:.1f} | {m + t7:.1f} |")
    (out / "moe_tail_lab.log").write_text("\n".join(LOG))


if __name__ == "__main__":
    main()

"""GPU lab: where the time of one small-M GEMV call goes (kernels 1 and 3), from %globaltimer stamps.

Builds the kernels with the lab define ``TL`` (``KBIT_LAB_DEFINES=TL=1``): lane 0 of every warp stamps events
into the module global ``kbit_tl`` (see ``TLS`` in ``kbit/cuda/gemv_mma_src.py``):

    0 entry   1 tables built (kernel 1: after the CTA barrier)   2 after the PDL wait   3 x staged (kernel 3)
    4 first segment computed   5 last segment computed (before the split-K fix-up)   6 exit   (7: SM id + 1)
The chained call's raw stamps go to ``k3_timeline.npz`` ([global warp][8] arrays, one a case).

Two views of each (shape, k, M, config):
- ``iso``: one eager call after a device sync and an L2 flush (a 256 MB write): times from the first warp's entry.
- ``chain``: the last call of a CUDA graph over weight copies > 8x L2 (as every benchmark times): times from the
  first warp's return from the PDL wait, which is about when the previous call finished.
Also the graph time per call with and without the stamps (median of the harness), and bytes / 3.07 TB/s.

    PYTHONUNBUFFERED=1 python scripts/k3_timeline.py [--shapes 28672x4096,...] [--ks 4,2] [--ms 1]
        [--cfgs "3,8,2,2;1,8,2"] [--out DIR]
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import mma_lab as L  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kbit.bench.timing import time_calls  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402

EVENTS = {0: "entry", 1: "tables", 2: "pdl wait", 3: "x staged", 4: "first seg", 5: "last seg", 6: "exit"}
CEIL = 3.07e12
LINES: list = []
DUMP: dict = {}
LAB = ""  # --lab: lab defines of both builds


def log(s=""):
    print(s, flush=True)
    LINES.append(s)


def stamps(kern, grid, W):
    a = np.frombuffer(kern.global_bytes("kbit_tl", zero=True), dtype=np.uint64).reshape(-1, 8)
    return a[: grid * W].astype(np.float64)


def summary(a, origin_event):
    """rows (event, n, min, p10, p50, p90, max) in us from the earliest stamp of ``origin_event``."""
    col = a[:, origin_event]
    t0 = col[col > 0].min()
    rows = []
    for e, name in EVENTS.items():
        v = a[:, e]
        v = v[v > 0]
        if v.size == 0:
            continue
        v = (v - t0) / 1000.0
        rows.append((name, v.size, v.min(), *np.percentile(v, [10, 50, 90]), v.max()))
    return rows


def one(N, K, k, M, cfg, log_tab):
    env_cfg = os.environ.pop("KBIT_MMA_CFG", None)
    if cfg:
        os.environ["KBIT_MMA_CFG"] = cfg
    ws = L.copies(N, K, k)
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K, config=None)
    res = {}
    for tl in (0, 1):
        os.environ["KBIT_LAB_DEFINES"] = ",".join(d for d in (LAB, "TL=1" if tl else "") if d)
        MM._PLANS.clear()
        calls = [(lambda w=w: MM._run(x, w[0], w[1], w[2], w[3], None, **kw)) for w in ws]
        res[f"us{tl}"] = time_calls(calls).us
        if not tl:
            continue
        (p,) = MM._PLANS.values()
        kern, grid, W = p["kern"], p["grid"], p["W"]
        res["plan"] = f"K{p['defines']['KERNEL']} W={W} grid={grid} regs={p['regs']}"
        a = stamps(kern, grid, W)
        res["chain"] = summary(a, 2)  # the graph's last call
        DUMP[f"k{k}_{N}x{K}_M{M}_{cfg or 'default'}_W{W}"] = a
        flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        for _ in range(3):
            flush.fill_(1)
            torch.cuda.synchronize()
            calls[-1]()
        res["iso"] = summary(stamps(kern, grid, W), 0)
        del flush
    os.environ["KBIT_LAB_DEFINES"] = LAB
    if env_cfg is not None:
        os.environ["KBIT_MMA_CFG"] = env_cfg
    else:
        os.environ.pop("KBIT_MMA_CFG", None)
    nbytes = L.canonical_bytes(N, K, k)
    head = (f"k={k} {N}x{K} M={M} cfg={cfg or 'default'} {res['plan']} | graph us {res['us0']:.2f} "
            f"(TL {res['us1']:.2f}) | bytes/3.07 TB/s {nbytes / CEIL * 1e6:.2f}")
    log(head)
    for view in ("iso", "chain"):
        log(f"  {view:5s} {'event':10s} {'n':>5s} {'min':>7s} {'p10':>7s} {'p50':>7s} {'p90':>7s} {'max':>7s}")
        for name, n, *v in res[view]:
            log(f"  {'':5s} {name:10s} {n:5d} " + " ".join(f"{t:7.2f}" for t in v))
    ev = {r[0]: r for r in res["iso"]}
    log_tab.append((f"k={k} {N}x{K} M={M} {cfg or 'default'}", res["us0"], nbytes / CEIL * 1e6,
                    ev["pdl wait"][6], ev["first seg"][2], ev["first seg"][6], ev["last seg"][2],
                    ev["last seg"][6], ev["exit"][6], {r[0]: r for r in res["chain"]}["exit"][6]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="28672x4096,4096x14336,6144x4096,4096x4096,57344x8192")
    ap.add_argument("--ks", default="4,2")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--cfgs", default="", help="';'-separated KBIT_MMA_CFG values besides the default")
    ap.add_argument("--lab", default="", help="lab defines of every build, e.g. LAB_NOFIX=1")
    ap.add_argument("--tag", default="", help="file name suffix")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    global LAB
    LAB = args.lab
    log(f"# lab defines: {LAB or '-'}")
    log(f"# {torch.cuda.get_device_name()}; times in us; iso: from the first entry; chain: from the first return "
        f"from the PDL wait")
    tab = []
    cfgs = [""] + [c for c in args.cfgs.split(";") if c]
    for s in args.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        for k in (int(v) for v in args.ks.split(",")):
            for M in (int(v) for v in args.ms.split(",")):
                for cfg in cfgs:
                    try:
                        one(N, K, k, M, cfg, tab)
                    except Exception as e:  # noqa: BLE001
                        log(f"k={k} {N}x{K} M={M} cfg={cfg}: {e!r}"[:300])
    log()
    log("| case | graph us | bytes us | iso: all past PDL wait | first seg min | first seg max | last seg min | "
        "last seg max | exit max | chain: exit max |")
    log("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in tab:
        log(f"| {r[0]} | " + " | ".join(f"{v:.2f}" for v in r[1:]) + " |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"k3_timeline{args.tag}.log").write_text("\n".join(LINES) + "\n")
        np.savez_compressed(Path(args.out) / f"k3_timeline{args.tag}.npz", **DUMP)


if __name__ == "__main__":
    main()

"""GPU lab: small-M configs of the tensor-core kernels (``KBIT_MMA_CFG`` per column), timed as ``pdl_lab`` times
(one CUDA graph over weight copies > 8x L2, median of 15 replays, bf16 activations, log8 B = 32).

    PYTHONUNBUFFERED=1 python lab/m1_cfg_sweep.py [--shapes 6144x4096,...] [--ks 4,2] [--ms 1]
        [--cfgs "1,4,4;1,8,2;3,8,2,2;@KBIT_L2PF=8192"] [--between] [--out DIR]

``--between`` puts a small torch kernel between consecutive calls (as in a decoder layer, where the neighbours of
a GEMV never trigger programmatic dependent launch), so a call cannot overlap the previous one's tail.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import mma_lab as L  # noqa: E402
import torch  # noqa: E402

from kbit.bench.timing import time_calls  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402

ENV_KEYS: set = set()  # environment variables set by a column ("cfg@KEY=VAL+KEY2=VAL"), cleared before the next
DEFAULT_CFGS = "1,4,4;1,8,2;1,8,1;1,16,1;3,8,2,2;3,8,2,2,1;3,4,4,2;3,16,1,2"


def set_env(col):
    """Set a column's environment ("cfg@KEY=VAL+KEY2=VAL"; the previous column's is cleared); returns cfg."""
    cfg, _, env = col.partition("@")
    for key in ENV_KEYS:
        os.environ.pop(key, None)
    for e in (e for e in env.split("+") if e):
        key, val = e.split("=", 1)
        ENV_KEYS.add(key)
        os.environ[key] = val
    return cfg


def time_cfg(N, K, k, M, between):
    ws = L.copies(N, K, k)
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    pad = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K, config=None)

    def call(w):
        if between:
            pad.mul_(1.0)
        return MM._run(x, w[0], w[1], w[2], w[3], None, **kw)

    return time_calls([(lambda w=w: call(w)) for w in ws]).us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="6144x4096,4096x4096,28672x4096,4096x14336")
    ap.add_argument("--ks", default="4,2")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--cfgs", default=DEFAULT_CFGS, help="';'-separated KBIT_MMA_CFG values ('' = default), each "
                    "optionally followed by '@KEY=VAL+KEY2=VAL' (environment, e.g. KBIT_L2PF)")
    ap.add_argument("--between", action="store_true", help="a torch kernel between consecutive calls")
    ap.add_argument("--check", action="store_true", help="first check each explicit config against the float64 "
                    "reference on odd shapes at the --ms values")
    ap.add_argument("--ncu", action="store_true", help="profile target: three calls of the first shape / k / M / "
                    "column on one weight copy (run under ncu -k regex:kbit_gemv_mma -s 2 -c 1)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    if args.ncu:
        N, K = (int(v) for v in args.shapes.split(",")[0].split("x"))
        k, M = int(args.ks.split(",")[0]), int(args.ms.split(",")[0])
        cfg = set_env(args.cfgs.split(";")[0])
        if cfg:
            os.environ["KBIT_MMA_CFG"] = cfg
        w = L.rand_repacked(N, K, k, seed=0)
        x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            MM._run(x, w[0], w[1], w[2], w[3], None, k=k, blocksize=32, scale_format="log8", N=N, K=K, config=None)
        torch.cuda.synchronize()
        return
    cfgs = [""] + [c for c in args.cfgs.split(";") if c]
    lines = [f"# {torch.cuda.get_device_name()}; us per call; between={args.between}"]
    if args.check:
        n_fail = 0
        for col in cfgs[1:]:
            cfg = set_env(col)
            if not cfg:
                continue
            cfg = tuple(int(v) for v in cfg.split(","))
            cases = [c for M in (int(v) for v in args.ms.split(",")) for k in (int(v) for v in args.ks.split(","))
                     for c in ((2880, 5120, k, M, torch.bfloat16, 32, "log8", False),
                               (5120, 2880, k, M, torch.float16, 32, "log8", True),
                               (1000, 4000, k, M, torch.float16, 128, "log8", True),
                               (17, 300, k, M, torch.bfloat16, 64, "fp16", False))]
            MM._PLANS.clear()
            n_fail += len(L.run_cases(cases, config=cfg, log_every=1000))
        lines.append(f"# check: {n_fail} failures")
        print(lines[-1], flush=True)
    for s in args.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        for k in (int(v) for v in args.ks.split(",")):
            for M in (int(v) for v in args.ms.split(",")):
                line = []
                for col in cfgs:
                    cfg = set_env(col)
                    if cfg:
                        os.environ["KBIT_MMA_CFG"] = cfg
                    else:
                        os.environ.pop("KBIT_MMA_CFG", None)
                    MM._PLANS.clear()
                    try:
                        us = time_cfg(N, K, k, M, args.between)
                    except Exception as e:  # noqa: BLE001
                        us = float("nan")
                        print(cfg, repr(e)[:200])
                    line.append(f"{col or 'default'}: {us:.2f}")
                lines.append(f"k={k} {N}x{K} M={M} | " + " | ".join(line))
                print(lines[-1], flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "m1_cfg_sweep.log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

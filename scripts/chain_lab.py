"""Lab for kernel 8 (kbit.ops.chain): correctness per phase against the separate launches, then graph timings of
a Llama-3-8B-shaped layer chain (o, gate/up, down, next q/k/v) fused vs separate, weights rotated over copies
(cold L2). Prints a short table last.

    python scripts/chain_lab.py [--k 4,2] [--copies 8] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops import chain as C  # noqa: E402


def _lin(N, K, k, dtype, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=False, dtype=torch.float32, device="cuda")
    return KbitLinear.from_linear(lin, k=k, dtype=dtype).cuda().repack_for_kernels()


def layer(H, I, Q, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w1 = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).cuda()
    w2 = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).cuda()
    return [(_lin(H, H, k, dtype, seed + 1), None, 0.0, False), (_lin(2 * I, H, k, dtype, seed + 2), w1, 1e-5, True),
            (_lin(H, I, k, dtype, seed + 3), None, 0.0, False), (_lin(Q, H, k, dtype, seed + 4), w2, 1e-5, False)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(k, dtype, H, I, Q, M, log):
    st = layer(H, I, Q, k, dtype, seed=k * 100 + M)
    x = torch.randn(M, H, device="cuda").to(dtype)
    res = torch.randn(M, H, device="cuda").to(dtype)
    rows = []
    for n in range(1, 5):
        C._DEBUG = []
        y, r = C.linear_chain(x, res, st[:n])
        torch.cuda.synchronize()
        inter = [t for t in C._DEBUG]
        C._DEBUG = None
        # unfused, phase by phase
        h, rr = x, res
        errs = []
        for i, (lin, nw, eps, silu) in enumerate(st[:n]):
            h, rr = C.linear_chain_unfused(h, rr, [(lin, nw, eps, silu)])
            yf = inter[3 * i]
            errs.append(f"y{i} {rel(yf, h):.1e}")
            if nw is not None:
                errs.append(f"r{i} {rel(inter[3 * i + 1], rr):.1e}")
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        import test_chain

        yr, rr = test_chain._reference(x, res, st[:n])
        errs.append(f"| vs f64 ref: y {rel(y, yr):.1e}" + (f" r {rel(r, rr):.1e}" if n >= 2 else ""))
        line = f"k={k} {str(dtype)[6:]} M={M} {H}x{I}x{Q} n={n}: " + " ".join(errs)
        print(line, flush=True)
        log.write(line + "\n")
        rows.append(line)
    return rows


def bench(k, dtype, copies, reps=50, phases=None):
    H, I, Q = 4096, 14336, 6144
    layers = [layer(H, I, Q, k, dtype, seed=1000 + c) for c in range(copies)]
    if phases is not None:
        layers = [[st[i] for i in phases] for st in layers]
    width = layers[0][0][0].in_features
    x = torch.randn(1, width, device="cuda").to(dtype)
    res = torch.randn(1, width, device="cuda").to(dtype)
    out = {}
    for name, fn in (("fused", C.linear_chain), ("separate", C.linear_chain_unfused)):
        for st in layers:
            fn(x, res, st)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with torch.cuda.graph(g):
                for st in layers:
                    fn(x, res, st)
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1000 / copies)
        ts.sort()
        out[name] = ts[len(ts) // 2]
    nbytes = sum(lin.codes.numel() * lin.codes.element_size() + lin.scales.numel() * lin.scales.element_size()
                 for lin, *_ in layers[0])
    return out, nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="4,2")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args()
    ks = [int(v) for v in a.k.split(",")]
    log = open(os.path.join(a.out, "chain-lab.log"), "a")
    log.write(f"# {time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()} commit "
              f"{os.environ.get('KBIT_COMMIT', '?')} cfg {os.environ.get('KBIT_CHAIN_CFG', 'default')}\n")
    if not a.no_check:
        for k in ks:
            for dtype in (torch.bfloat16, torch.float16):
                for M in (1, 2):
                    check(k, dtype, 1024, 1536, 1536, M, log)
    table = []
    for k in ks:
        for ph in ([0, 1, 2, 3], [0], [1], [2], [3], [0, 1], [1, 2]):
            t, nb = bench(k, torch.bfloat16, a.copies, phases=ph)
            names = "/".join(("o", "gate_up", "down", "qkv")[i] for i in ph)
            line = (f"k={k} M=1 {names:22s} fused {t['fused']:6.1f} us  separate {t['separate']:6.1f} us  "
                    f"bytes {nb / 1e6:6.1f} MB = {nb / 3.0e6:5.1f} us at 3 TB/s")
            table.append(line)
            log.write(line + "\n")
    if os.environ.get("KBIT_CHAIN_NOWAIT") != "1":
        os.environ["KBIT_CHAIN_NOWAIT"] = "1"
        for k in ks:
            t, nb = bench(k, torch.bfloat16, a.copies)
            line = f"k={k} M=1 all four, no waits (wrong results) fused {t['fused']:6.1f} us"
            table.append(line)
            log.write(line + "\n")
        del os.environ["KBIT_CHAIN_NOWAIT"]
    print("\n".join(table), flush=True)


if __name__ == "__main__":
    main()

"""GPU lab for large M (256..4096): dequantize + cuBLAS on the whole weight (the current "dequant_mm") against
dequantizing N-slabs into one L2-sized bf16 buffer and multiplying slab by slab (the buffer's lines stay in L2
between the dequantize write and the GEMM read), next to bf16 ``F.linear``, in one call.

    PYTHONUNBUFFERED=1 python scripts/large_lab.py [--ms 256,1024,4096] [--slabs 2048,4096]

Writes ``large.json`` / ``large.log`` under ``$OUT``; prints a short table last.
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
import torch.nn.functional as F  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.ops.dequant import dequantize_tensors  # noqa: E402

SHAPES = [(28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]


def slabbed(x, w, slab, mode, N, K, k):
    codes, scales, ts, cb = w
    M = x.shape[0]
    kw = dict(k=k, blocksize=32, scale_format="log8")
    if mode == "strided":
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    else:
        yt = torch.empty(N, M, dtype=x.dtype, device=x.device)
    buf = torch.empty(min(slab, N), K, dtype=x.dtype, device=x.device)
    for n0 in range(0, N, slab):
        n1 = min(N, n0 + slab)
        b = buf[: n1 - n0]
        dequantize_tensors(codes[n0:n1], scales[n0:n1], ts, cb, shape=(n1 - n0, K), dtype=x.dtype, out=b, **kw)
        if mode == "strided":
            torch.mm(x, b.t(), out=y[:, n0:n1])
        else:
            torch.mm(b, x.t(), out=yt[n0:n1])
    if mode == "strided":
        return y
    return yt.t() if mode == "T" else yt.t().contiguous()


def whole(x, w, N, K, k):
    codes, scales, ts, cb = w
    wd = dequantize_tensors(codes, scales, ts, cb, k=k, blocksize=32, scale_format="log8", shape=(N, K),
                            dtype=x.dtype)
    return F.linear(x, wd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="256,1024,4096")
    ap.add_argument("--slabs", default="2048,4096")
    ap.add_argument("--modes", default="strided,Tc")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    out = Path(a.out)
    t0 = time.time()
    k = a.k
    rows = []
    for N, K in SHAPES:
        nb = L.canonical_bytes(N, K, k)
        ws = [L.rand_canonical(N, K, k, seed=i) for i in range(copies_for_cold_l2(nb, l2_bytes()))]
        for M in [int(v) for v in a.ms.split(",")]:
            if time.time() - t0 > a.budget:
                break
            x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
            bf = L.time_bf16(N, K, M)
            r = dict(N=N, K=K, M=M, k=k, bf16_us=bf)
            ref = whole(x, ws[0], N, K, k)
            r["whole_us"] = time_calls([(lambda w=w, x=x, N=N, K=K: whole(x, w, N, K, k)) for w in ws]).us
            for mode in a.modes.split(","):
                for slab in [int(v) for v in a.slabs.split(",")]:
                    name = f"{mode}{slab}"
                    try:
                        y = slabbed(x, ws[0], slab, mode, N, K, k)
                        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                        calls = [(lambda w=w, x=x, s_=slab, m_=mode, N=N, K=K: slabbed(x, w, s_, m_, N, K, k))
                                 for w in ws]
                        r[name] = time_calls(calls).us
                        r[name + "_err"] = err
                    except Exception as ex:  # noqa: BLE001
                        L.log(f"  {name} failed: {repr(ex)[:300]}")
            rows.append(r)
            L.log(f"{N}x{K} M={M} " + " ".join(f"{kk}={v:.1f}" if isinstance(v, float) and not kk.endswith("err")
                                                else f"{kk}={v:.0e}" if kk.endswith("err") else "" for kk, v in
                                                r.items() if kk not in ("N", "K", "M", "k")))
            (out / "large.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(),
                                                            commit=os.environ.get("KBIT_COMMIT", "?"), rows=rows),
                                                       indent=1))
        del ws
        torch.cuda.empty_cache()
    names = [kk for kk in rows[0] if kk.endswith("_us") or (kk[0] in "sT" and not kk.endswith("err"))]
    names = [n for n in names if n != "bf16_us"]
    L.log("| N x K | M | bf16 | " + " | ".join(names) + " |")
    for r in rows:
        L.log(f"| {r['N']}x{r['K']} | {r['M']} | {r['bf16_us']:.1f} | " + " | ".join(
            f"{r[n]:.1f} ({r['bf16_us'] / r[n]:.2f}x)" if r.get(n) else "-" for n in names) + " |")
    (out / "large.log").write_text("\n".join(L.LOG))


if __name__ == "__main__":
    main()

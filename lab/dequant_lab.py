"""GPU lab for the dequantize kernel (issue 4: "reads k bits and writes 16 at >= 85% of bandwidth").

Checks the CUDA kernel (kbit.cuda.dequant_src) and the Triton one bit-exact against the reference, then times
both on the benchmark shapes (bf16 out, weight copies rotated for a cold L2, CUDA graphs, median), with the
read ceiling and a plain bf16 copy (read + write of the output size) in the same run.

    PYTHONPATH=src KBIT_COMMIT=<sha> python lab/dequant_lab.py [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import kbit  # noqa: E402
import kbit.ops.dequant as dqmod  # noqa: E402
from kbit.bench.ceiling import measure_read_ceiling  # noqa: E402
from kbit.bench.run import clone_weight  # noqa: E402
from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.format.reference import dequantize_reference  # noqa: E402
from kbit.ops.dequant import dequantize_tensors  # noqa: E402

SHAPES = [(28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]
BF = torch.bfloat16


def dq(qw, dtype, backend, out=None):
    os.environ["KBIT_DEQUANT_BACKEND"] = backend
    return dequantize_tensors(qw.codes, qw.scales, qw.tensor_scale, qw.codebook, k=qw.k, blocksize=qw.blocksize,
                              scale_format=qw.scale_format, shape=qw.shape, dtype=dtype, out=out)


def check() -> int:
    bad = 0
    t0 = time.time()
    for k in (2, 3, 4, 5):
        for (B, fmt) in ((32, "log8"), (64, "fp16"), (128, "log8")):
            for shape in ((37, 200), (2, 19, 96), (5120, 2880)):
                qw = kbit.quantize(torch.randn(*shape), k=k, blocksize=B, scale_format=fmt).to("cuda")  # CPU: no JIT
                for dt in (BF, torch.float32) if B == 32 else (BF,):
                    ref = dequantize_reference(qw, dt)
                    for be in ("cuda", "triton") if shape[0] == 37 else ("cuda",):
                        got = dq(qw, dt, be)
                        if not torch.equal(got, ref):
                            bad += 1
                            print(f"MISMATCH k={k} B={B} {fmt} {shape} {dt} {be}: "
                                  f"{(got.float() - ref.float()).abs().max().item():.3e}")
        print(f"  checked k={k} ({time.time() - t0:.0f} s)", flush=True)
    print(f"bit-exact: {'PASS' if bad == 0 else f'FAIL ({bad})'}")
    return bad


def main() -> int:
    """--skip-check: timing only."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(45, repeat=True)
    bad = 0 if args.skip_check else check()
    ceil = measure_read_ceiling().read_tbps
    rows = []
    l2 = l2_bytes()
    for (N, K) in SHAPES:
        src = torch.randn(N, K, device="cuda", dtype=BF)
        dst = [torch.empty_like(src) for _ in range(2)]
        nsrc = copies_for_cold_l2(2 * N * K, l2, min_copies=2)
        srcs = [src] + [src.clone() for _ in range(min(nsrc, 3) - 1)]
        cp = time_calls([lambda s=s, d=dst[i % 2]: d.copy_(s) for i, s in enumerate(srcs)]).us
        del srcs
        for k in (2, 3, 4, 5):
            qw = kbit.quantize(torch.randn(N, K, device="cuda", dtype=BF), k=k)
            nb_in = qw.codes.numel() * 4 + qw.scales.numel()
            n = copies_for_cold_l2(nb_in, l2)
            ws = [qw] + [clone_weight(qw) for _ in range(n - 1)]
            nb = nb_in + 2 * N * K
            for be in ("cuda-u2", "cuda-u4", "cuda-u8", "triton"):
                os.environ["KBIT_DEQUANT_BACKEND"] = be.split("-")[0]
                if be.startswith("cuda"):
                    dqmod._UNITS = int(be.split("-u")[1])
                us = time_calls([lambda w=w, d=dst[i % 2]: dequantize_tensors(
                    w.codes, w.scales, w.tensor_scale, w.codebook, k=w.k, blocksize=w.blocksize,
                    scale_format=w.scale_format, shape=w.shape, dtype=BF, out=d)
                    for i, w in enumerate(ws)]).us
                rows.append(dict(N=N, K=K, k=k, backend=be, us=us, bytes=nb, tbps=nb / us / 1e6,
                                 pct_ceiling=100 * nb / us / 1e6 / ceil, copy_us=cp,
                                 copy_tbps=4 * N * K / cp / 1e6))
            del ws
    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                commit=os.environ.get("KBIT_COMMIT", "unknown"), torch=torch.__version__,
                command="python lab/dequant_lab.py", ceiling_tbps=ceil, bit_exact_failures=bad)
    with open(os.path.join(args.out, "dequant-lab.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"{meta['gpu']} commit {meta['commit']} ceiling {ceil:.3f} TB/s (bytes = codes + scales read + bf16 written)")
    print(f"{'shape':>12} {'k':>2} {'backend':>8} {'us':>8} {'TB/s':>6} {'%ceil':>6} {'copy TB/s':>9}")
    for r in rows:
        print(f"{r['N']}x{r['K']:<6} {r['k']:>2} {r['backend']:>8} {r['us']:8.1f} {r['tbps']:6.2f} "
              f"{r['pct_ceiling']:6.1f} {r['copy_tbps']:9.2f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

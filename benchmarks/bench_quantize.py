"""Time kbit.quantize on the GPU (issue: quantizing 8192 x 28672 bf16 with the default codebook <= 5 ms).

Wall-clock per call (synchronised; the call includes its finite-check host sync), median of 10 after 3
warm-ups, fresh random bf16 weights. Writes benchmarks/results/<gpu>/quantize-<date>.json (to $OUT if set).

    python benchmarks/bench_quantize.py [--commit HASH]
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time

import torch

import kbit


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return os.environ.get("KBIT_COMMIT", "unknown")


def time_call(fn, reps=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    N, K = 8192, 28672
    W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    rows = []
    for k in (2, 3, 4, 5):
        for codebook in (None, "fit"):
            for scale_format in ("log8", "fp16"):
                us = time_call(lambda k=k, c=codebook, s=scale_format:
                               kbit.quantize(W, k=k, codebook=c, scale_format=s))
                qw = kbit.quantize(W, k=k, codebook=codebook, scale_format=scale_format)
                bytes_moved = W.numel() * 2 * 2 + qw.nbytes  # the max pass and the quantize pass read W
                rows.append({"k": k, "codebook": qw.codebook_name, "scale_format": scale_format, "N": N, "K": K,
                             "us": round(us, 1), "tbps": round(bytes_moved / us / 1e6, 3)})
                print(rows[-1], flush=True)
    header = {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": args.commit or commit(),
              "command": "python benchmarks/bench_quantize.py", "torch": torch.__version__,
              "triton": __import__("triton").__version__, "dtype": "bfloat16", "blocksize": 32}
    slug = "h100" if "H100" in gpu else gpu.lower().replace(" ", "-")
    os.makedirs(os.path.join(args.out, slug), exist_ok=True)
    path = os.path.join(args.out, slug, f"quantize-{header['date']}.json")
    with open(path, "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    print(f"\n{'k':>2} {'codebook':>8} {'scales':>6} {'ms':>7} {'TB/s':>6}")
    for r in rows:
        print(f"{r['k']:>2} {r['codebook']:>8} {r['scale_format']:>6} {r['us'] / 1e3:7.3f} {r['tbps']:6.2f}")


if __name__ == "__main__":
    main()

"""GPU lab: are repeated M = 1 calls bit-identical? KbitLinear, linear_small_m and the bare launcher on one weight;
prints the route (kernel, CAU, splits) and, per path, how many of R repeats differ from the first and by how much.

    python lab/det_probe.py [--shape 4096x4096] [--k 4] [--reps 50]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402


def probe(name, f, reps):
    ys = [f().clone() for _ in range(reps)]
    torch.cuda.synchronize()
    bad = [i for i, y in enumerate(ys) if not torch.equal(y, ys[0])]
    d = max(((y.float() - ys[0].float()).abs().max().item() for y in ys), default=0.0)
    n = max((int((y != ys[0]).sum()) for y in ys), default=0)
    print(f"{name}: {len(bad)}/{reps} differ from the first; max |diff| {d:.3g}; most elements differing {n}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    N, K = (int(v) for v in a.shape.split("x"))
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device="cuda")
    q = KbitLinear.from_linear(lin, k=a.k).repack_for_kernels()
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    q(x)
    p = MM._plan_cached(a.k, 1, N, q.codes.shape[1], q.scale_format, None, True, x.device)
    print(f"{N}x{K} k={a.k} env CAU={os.environ.get('KBIT_CAU')}: kernel {p['defines']['KERNEL']} CAU "
          f"{p['defines'].get('CAU', 0)} grid {p['grid']} W {p['W']} splits {p['splits']} use_ws {p['use_ws']}")
    parts = (q.codes, q.scales, q.tensor_scale, q.codebook)
    fmt = dict(k=q.k, blocksize=q.blocksize, scale_format=q.scale_format, N=N, K=K)
    probe("KbitLinear", lambda: q(x), a.reps)
    probe("linear_repacked", lambda: MM.linear_repacked(x, *parts, bias=None, **fmt), a.reps)
    y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)

    def bare():
        MM._launch(x, *parts, None, y, k=q.k, scale_format=q.scale_format, N=N, K=K, M=1, Kp=K)
        return y

    probe("_launch", bare, a.reps)


if __name__ == "__main__":
    main()

"""What verifying the CRC-32 checksums costs when a kbit file (format 2) is loaded, on this machine's CPU.

Writes a file of synthetic quantized weights (valid random codes and scales, no quantization: only the bytes
matter) plus plain bf16 tensors, then times ``kbit.load_file(path)`` against ``load_file(path, verify=False)``
(best of ``--repeat``, the file in the page cache) and the raw ``zlib.crc32`` rate on the same bytes.

    PYTHONPATH=src python lab/checksum_speed.py --mbytes 1024 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib

import torch

import kbit
from kbit.format.codebooks import normal_float_zero


def synthetic_state(mbytes: int, n: int = 4096, k: int = 4) -> dict:
    """Quantized ``n x n`` weights (k bits, blocksize 32, log8) and a bf16 tensor per weight, ~``mbytes`` MB."""
    g = torch.Generator().manual_seed(0)
    state, total, i = {}, 0, 0
    while total < mbytes * 2**20:
        codes = torch.randint(-(2**31), 2**31 - 1, (n, n * k // 32), generator=g, dtype=torch.int32)
        scales = torch.randint(0, 255, (n, n // 32), generator=g, dtype=torch.uint8)
        qw = kbit.KbitWeight(codes, scales, torch.tensor(1.0), normal_float_zero(k), (n, n), k, 32)
        state[f"layer{i}.weight"] = qw
        state[f"layer{i}.norm"] = torch.randn(n, generator=g).to(torch.bfloat16)
        total += qw.nbytes + 2 * n
        i += 1
    return state


def best(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", type=int, default=1024, help="size of the tensor data in MiB")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    state = synthetic_state(args.mbytes)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "w.safetensors")
        kbit.save_file(state, path)
        data_bytes = sum(v.nbytes if isinstance(v, kbit.KbitWeight) else v.nbytes for v in state.values())
        kbit.load_file(path)  # into the page cache
        on = best(lambda: kbit.load_file(path), args.repeat)
        off = best(lambda: kbit.load_file(path, verify=False), args.repeat)
    flat = [t for v in state.values() for t in (v.tensors().values() if isinstance(v, kbit.KbitWeight) else [v])]
    crc = best(lambda: [zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) for t in flat], args.repeat)
    gb = data_bytes / 1e9
    print(f"tensor data: {gb:.3f} GB in {len(flat)} tensors; torch threads {torch.get_num_threads()}, "
          f"cpus {os.cpu_count()}")
    print(f"load_file verify=True : {on:.3f} s ({gb / on:.2f} GB/s)")
    print(f"load_file verify=False: {off:.3f} s ({gb / off:.2f} GB/s)")
    print(f"verification cost     : {on - off:.3f} s ({gb / max(on - off, 1e-9):.2f} GB/s of checked data)")
    print(f"zlib.crc32 alone      : {crc:.3f} s ({gb / crc:.2f} GB/s)")


if __name__ == "__main__":
    main()

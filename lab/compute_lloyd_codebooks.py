"""Compute the Lloyd-Max codebooks shipped in src/kbit/format/lloyd_codebooks.json.

For each k in 2..5 and blocksize in 32, 64, 128: draw N(0, 1) blocks, divide each block by its absmax
(the format's normalisation), and run Lloyd-Max (1-D k-means) on the normalised values. ``lloyd0`` pins
-1, 0 and +1 and moves the other levels. Deterministic (fixed seed); takes about a minute on a CPU.

    python lab/compute_lloyd_codebooks.py
"""

import json
from pathlib import Path

import torch

from kbit.format.codebooks import lloyd_max, normal_float

OUT = Path(__file__).resolve().parents[1] / "src" / "kbit" / "format" / "lloyd_codebooks.json"
VALUES = 1 << 23


def normalised_gaussian_blocks(blocksize: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(VALUES // blocksize, blocksize, generator=gen, dtype=torch.float64)
    return (x / x.abs().amax(dim=1, keepdim=True)).reshape(-1)


def pinned_init(k: int) -> torch.Tensor:
    n = 2**k
    free_neg = (n - 3) // 2
    free_pos = n - 3 - free_neg
    neg = -torch.linspace(1, 0, free_neg + 2, dtype=torch.float64)[1:-1]
    pos = torch.linspace(0, 1, free_pos + 2, dtype=torch.float64)[1:-1]
    return torch.sort(torch.cat([torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64), neg, pos])).values


def main() -> None:
    gen = torch.Generator().manual_seed(20261121)
    table = {}
    for blocksize in (32, 64, 128):
        x = normalised_gaussian_blocks(blocksize, gen)
        for k in (2, 3, 4, 5):
            free = lloyd_max(x, normal_float(k), iters=300)
            pinned = lloyd_max(x, pinned_init(k), iters=300, pinned=(-1.0, 0.0, 1.0))
            table[f"lloyd/k{k}/b{blocksize}"] = [round(float(v), 7) for v in free]
            table[f"lloyd0/k{k}/b{blocksize}"] = [round(float(v), 7) for v in pinned]
            print(blocksize, k, [round(float(v), 4) for v in free])
    OUT.write_text(json.dumps(table, indent=1) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()

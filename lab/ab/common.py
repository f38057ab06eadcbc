"""Shared by the old-vs-new tree checks: import kbit from a given source folder, the fixed cases."""

from __future__ import annotations

import sys


def import_kbit(src: str):
    """Import kbit from ``src`` (a tree's src/ folder), ahead of any installed copy."""
    sys.path.insert(0, src)
    import kbit

    assert kbit.__file__.startswith(src.rstrip("/")), (kbit.__file__, src)
    return kbit


#: the README's M = 1 table (N x K)
M1_SHAPES = [(28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672), (4096, 4096), (6144, 4096)]

#: (N, K, k, M, dtype) cases for bit-identical outputs: every kernel family (M 1..4096), odd shapes, both dtypes
def output_cases():
    import torch

    shapes = [(4096, 4096), (28672, 4096), (4096, 14336), (6144, 4096), (1000, 1000), (2880, 2880), (12288, 5120),
              (5120, 25600), (136, 200), (8192, 28672)]
    cases = []
    for i, (N, K) in enumerate(shapes):
        for k in (2, 3, 4, 5):
            for j, M in enumerate((1, 2, 5, 8, 16, 33, 64, 200, 1024)):
                if (i + k + j) % 2 and M != 1:
                    continue  # keep the run short: every second point past M = 1 (each shape and k covers M ranges)
                dtype = torch.bfloat16 if (i + k + M) % 3 else torch.float16
                cases.append((N, K, k, M, dtype))
    cases += [(28672, 4096, 4, 4096, torch.bfloat16), (4096, 4096, 2, 4096, torch.float16)]
    return cases

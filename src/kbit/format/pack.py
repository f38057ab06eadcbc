"""Bit-plane packing of k-bit codes into int32 words (docs/format.md, "Packing of one row").

Plain torch, bit-exact; the executable spec that packing kernels are tested against.
"""

from __future__ import annotations

import torch

#: Bit planes per k: (width, shift of the code bits it holds), lowest bits first.
PLANES: dict[int, tuple[tuple[int, int], ...]] = {
    2: ((2, 0),),
    3: ((2, 0), (1, 2)),
    4: ((4, 0),),
    5: ((4, 0), (1, 4)),
}


def words_per_row(k: int, padded_k: int) -> int:
    """Number of int32 words that hold one row of ``padded_k`` codes."""
    return padded_k * k // 32


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(codes: torch.Tensor, k: int) -> torch.Tensor:
    """Pack integer codes ``[..., Kp]`` (values < 2**k, Kp a multiple of 32) into int32 ``[..., Kp*k/32]``."""
    *lead, kp = codes.shape
    if kp % 32:
        raise ValueError(f"codes: expected the last dimension to be a multiple of 32, got {kp}")
    c = codes.to(torch.int64)
    out = []
    for width, shift in PLANES[k]:
        per_word = 32 // width
        bits = ((c >> shift) & ((1 << width) - 1)).reshape(*lead, kp // per_word, per_word)
        offsets = torch.arange(per_word, device=c.device, dtype=torch.int64) * width
        out.append(_to_int32((bits << offsets).sum(-1)))
    return torch.cat(out, dim=-1)


def unpack(words: torch.Tensor, k: int, padded_k: int) -> torch.Tensor:
    """Inverse of :func:`pack`: int32 ``[..., Kp*k/32]`` -> int32 codes ``[..., Kp]``."""
    *lead, nw = words.shape
    if nw != words_per_row(k, padded_k):
        raise ValueError(
            f"codes: expected {words_per_row(k, padded_k)} words per row for k={k}, K padded to {padded_k}, got {nw}"
        )
    w = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.zeros(*lead, padded_k, dtype=torch.int64, device=words.device)
    start = 0
    for width, shift in PLANES[k]:
        n = padded_k * width // 32
        per_word = 32 // width
        offsets = torch.arange(per_word, device=w.device, dtype=torch.int64) * width
        bits = (w[..., start : start + n, None] >> offsets) & ((1 << width) - 1)
        codes |= bits.reshape(*lead, padded_k) << shift
        start += n
    return codes.to(torch.int32)

"""Slicing a k-bit weight for tensor parallelism, without requantizing: each shard is an ordinary
:class:`~kbit.format.KbitWeight` whose dequantized value is bit-exactly the matching slice of the whole one.

- ``dim=0`` (column-parallel, split N): rows of ``codes`` and ``scales`` are whole rows of the matrix.
- ``dim=1`` (row-parallel, split K): on whole quantization blocks. In the bit-plane layout (``kbit.format.pack``)
  a row's words are the planes one after the other, each plane holding ``32 / width`` codes a word; a block of
  ``blocksize >= 32`` codes starts on a word boundary in every plane, so a block range is a word range per plane:
  slicing, no unpacking. The last shard keeps the padding of K (it is the only one that ends at K).

Every shard keeps the whole weight's ``tensor_scale`` and codebook: block scales are relative to the tensor
scale, so the shards dequantize to the same numbers and the row-parallel partial sums add up to the full product.
"""

from __future__ import annotations

import torch

from kbit.format.pack import PLANES
from kbit.format.spec import KbitWeight, padded_k
from kbit.utils.checks import check_choice, check_int, fail

__all__ = ["COLUMN_UNIT", "packed_ranges", "shard_range", "shard_weight", "split_rows"]

#: rows per unit of a column split by default: shards stay multiples of 16 rows (the GEMV / MMA tile height), and
#: only the last rank's shard is short where N is not a multiple of ``16 * world``
COLUMN_UNIT = 16


def shard_range(size: int, rank: int, world: int, unit: int = 1) -> tuple[int, int]:
    """``(start, stop)`` of ``rank``'s part when ``size`` is split over ``world`` ranks in whole ``unit``\\ s.

    The ``ceil(size / unit)`` units go out as evenly as possible, one more to each of the first ranks where they do
    not divide; the last unit may be short (it ends at ``size``). Every rank gets at least one unit, else
    ValueError. Example: ``size=100, unit=16, world=2`` -> rank 0 ``(0, 64)``, rank 1 ``(64, 100)``.
    """
    check_int("size", size, minimum=1)
    check_int("world", world, minimum=1)
    check_int("rank", rank, minimum=0, maximum=world - 1)
    check_int("unit", unit, minimum=1)
    units = -(-size // unit)
    if units < world:
        fail(ValueError, "size", f"at least {world} units of {unit} to split over {world} ranks",
             f"{size} ({units} units)")
    base, extra = divmod(units, world)
    first = rank * base + min(rank, extra)
    count = base + (rank < extra)
    return first * unit, min(size, (first + count) * unit)


def packed_ranges(parts, rank: int, world: int, unit: int = COLUMN_UNIT) -> list[tuple[int, int]]:
    """Rank ``rank``'s rows of a packed weight whose N is ``parts`` side by side (q/k/v, gate/up): each part is split
    over the ranks on its own (:func:`shard_range`), so a rank holds a slice of every part. Returns the absolute
    ``(start, stop)`` of each part's slice. Example: ``parts=(64, 32), world=2`` -> rank 1 ``[(32, 64), (80, 96)]``.
    """
    if not isinstance(parts, (tuple, list)) or not parts:
        fail(TypeError, "parts", "a non-empty tuple of row counts", repr(parts))
    out, offset = [], 0
    for i, n in enumerate(parts):
        check_int(f"parts[{i}]", n, minimum=1)
        a, b = shard_range(n, rank, world, unit)
        out.append((offset + a, offset + b))
        offset += n
    return out


def _rows(qw: KbitWeight, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    return qw.codes[..., start:stop, :], qw.scales[..., start:stop, :]


def split_rows(qw: KbitWeight, parts) -> list[KbitWeight]:
    """``qw`` (``[..., N, K]``) cut along N into ``parts`` rows each (``sum(parts) == N``): the members of a weight
    quantized jointly (one tensor scale), as views of its codes and scales."""
    if not isinstance(qw, KbitWeight):
        fail(TypeError, "qw", "a KbitWeight", type(qw).__name__)
    if sum(parts) != qw.N:
        fail(ValueError, "parts", f"row counts summing to N = {qw.N}", repr(tuple(parts)))
    out, lo = [], 0
    for n in parts:
        codes, scales = _rows(qw, lo, lo + n)
        out.append(KbitWeight(codes, scales, qw.tensor_scale, qw.codebook, qw.shape[:-2] + (n, qw.K), qw.k,
                              qw.blocksize, qw.scale_format, qw.codebook_name, qw.rotation))
        lo += n
    return out


def _slice_k(qw: KbitWeight, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of columns ``start:stop`` (``start`` on a block boundary; ``stop`` too, or ``stop == K``)."""
    kp = qw.padded_k
    stop_p = padded_k(stop, qw.blocksize)  # the last shard takes the padding along
    words, offset = [], 0
    for width, _ in PLANES[qw.k]:
        # a plane of a row holds kp * width / 32 words; column c of the plane is in word c * width / 32
        words.append(qw.codes[..., offset + start * width // 32: offset + stop_p * width // 32])
        offset += kp * width // 32
    codes = torch.cat(words, dim=-1)
    scales = qw.scales[..., start // qw.blocksize: stop_p // qw.blocksize].clone()
    return codes, scales


def shard_weight(qw: KbitWeight, dim: int, rank: int, world: int, unit: int | None = None, parts=None
                 ) -> KbitWeight:
    """Rank ``rank``'s shard of ``qw`` (``[..., N, K]``) split along ``dim`` over ``world`` ranks.

    Parameters
    ----------
    qw : the whole weight, canonical layout, on any device (the shard is on the same device).
    dim : 0 splits N (column-parallel: ``y[..., n0:n1] = x @ W[n0:n1].T``); 1 splits K (row-parallel:
        ``y = sum over ranks of x[..., k0:k1] @ W[:, k0:k1].T``).
    rank, world : this rank and the number of ranks.
    unit : the split is in whole units (:func:`shard_range`). Default: :data:`COLUMN_UNIT` rows for ``dim=0``,
        ``qw.blocksize`` columns for ``dim=1``; for ``dim=1`` it must be a multiple of ``qw.blocksize``. Use the
        same unit for a column-parallel layer and the row-parallel layer that reads its output (an MLP's up and
        down projections), so that their splits of the shared dimension agree.
    parts : ``dim=0`` only: N is these parts side by side (a packed q/k/v or gate/up weight); each part is split on
        its own and the shard holds this rank's slice of every part, in order (:func:`packed_ranges`).

    Returns
    -------
    KbitWeight of shape ``(..., n1 - n0, K)`` or ``(..., N, k1 - k0)``, with its own copies of codes and scales
    (the whole weight can be freed) and the same ``tensor_scale`` and codebook tensors.
    ``kbit.dequantize(shard) == kbit.dequantize(qw)[slice]`` bit for bit, the slice given by :func:`shard_range`.
    """
    if not isinstance(qw, KbitWeight):
        fail(TypeError, "qw", "a KbitWeight", type(qw).__name__)
    check_choice("dim", dim, (0, 1))
    if parts is not None and dim != 0:
        fail(ValueError, "parts", "None for a split of K (dim 1)", repr(parts))
    if dim == 0:
        unit = COLUMN_UNIT if unit is None else unit
        if parts is None:
            ranges = [shard_range(qw.N, rank, world, unit)]
        else:
            if sum(parts) != qw.N:
                fail(ValueError, "parts", f"row counts summing to N = {qw.N}", repr(tuple(parts)))
            ranges = packed_ranges(parts, rank, world, unit)
        pieces = [_rows(qw, a, b) for a, b in ranges]
        codes = torch.cat([c for c, _ in pieces], dim=-2)  # a copy even for one piece: the whole can be freed
        scales = torch.cat([s for _, s in pieces], dim=-2)
        shape = qw.shape[:-2] + (sum(b - a for a, b in ranges), qw.K)
    else:
        if qw.rotation is not None:  # R spans all of K (its signs come from one seed over K): no shard holds it
            fail(ValueError, "qw", "an unrotated weight for a split of K (dim 1)", f"rotation {qw.rotation}")
        unit = qw.blocksize if unit is None else unit
        check_int("unit", unit, minimum=1)
        if unit % qw.blocksize:
            fail(ValueError, "unit", f"a multiple of the blocksize {qw.blocksize} for a split of K", unit)
        start, stop = shard_range(qw.K, rank, world, unit)
        codes, scales = _slice_k(qw, start, stop)
        shape = qw.shape[:-1] + (stop - start,)
    return KbitWeight(codes, scales, qw.tensor_scale, qw.codebook, shape, qw.k, qw.blocksize, qw.scale_format,
                      qw.codebook_name, qw.rotation if dim == 0 else None)

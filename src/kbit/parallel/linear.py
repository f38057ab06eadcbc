"""Column- and row-parallel ``KbitLinear``: each rank holds an ordinary ``KbitLinear`` over its shard of the weight
(:func:`kbit.parallel.shard_weight`), so every kernel runs unchanged; these modules add the communication.

Semantics follow ``torch.distributed.tensor.parallel``'s ``ColwiseParallel`` / ``RowwiseParallel`` and the
``"colwise"`` / ``"rowwise"`` entries of transformers' ``tp_plan``:

- column-parallel: ``y_local = x @ W[n0:n1].T + bias[n0:n1]``, the output stays split along its last dimension
  (``gather_output=False``, the input of a following row-parallel layer) or is all-gathered (``True``);
- row-parallel: the input is split along its last dimension (``input_is_parallel=True``: it already is, the output
  of a column-parallel layer; ``False``: each rank takes its slice of a replicated input), the partial products
  are summed with ``all_reduce`` over the process group and the bias is added once, after the sum.

They are plain modules holding a process group, not DTensor styles: a k-bit weight is packed codes with per-block
scales, which DTensor's element-wise sharding of a parameter does not describe (a K split must fall on whole blocks
and cut every bit plane of a row), and ``parallelize_module`` cannot replace a module by another class.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kbit.format.spec import KbitWeight
from kbit.nn.linear import KbitLinear
from kbit.parallel.comm import AllReduceConfig, all_reduce_sum
from kbit.parallel.shard import COLUMN_UNIT, packed_ranges, shard_range, shard_weight
from kbit.utils.checks import fail

__all__ = ["ColumnParallelKbitLinear", "ColumnParallelLinear", "RowParallelKbitLinear"]


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first "
                           "(or run under torchrun)")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_linear(name: str, linear) -> KbitLinear:
    if not isinstance(linear, KbitLinear):
        fail(TypeError, name, "a KbitLinear", type(linear).__name__)
    return linear


#: torch 2.13 renamed the collective (the old name warns there); the GPU machines run 2.11, which has the old only
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_last_dim(y: torch.Tensor, sizes: list[int], group=None) -> torch.Tensor:
    """All-gather ``y [..., sizes[rank]]`` from every rank and concatenate along the last dimension.

    One all-gather (``all_gather_single``, ``all_gather_into_tensor`` before torch 2.13) into
    ``[world, ..., max(sizes)]``; shards of unequal width are padded to the widest for the collective (it moves equal
    sizes)."""
    width = max(sizes)
    if y.shape[-1] != width:
        y = torch.nn.functional.pad(y, (0, width - y.shape[-1]))
    y = y.contiguous()
    flat = y.new_empty(len(sizes) * y.numel())  # concatenated along dim 0: the form every backend takes
    _all_gather(flat, y.reshape(-1), group=group)
    out = flat.view(len(sizes), *y.shape)
    if all(s == width for s in sizes):  # [world, ..., width] -> [..., world * width]: one copy
        return out.movedim(0, -2).reshape(*y.shape[:-1], len(sizes) * width)
    return torch.cat([out[r, ..., :s] for r, s in enumerate(sizes)], dim=-1)


class ColumnParallelKbitLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W [out_features, in_features]`` split along ``out_features`` over the group.

    Parameters
    ----------
    shard : this rank's ``KbitLinear`` (rows ``start:stop`` of W and of the bias; with ``parts``, this rank's slice
        of every part, in order).
    out_features : N of the whole weight.
    group : the ``torch.distributed`` process group (None: the default group).
    gather_output : all-gather the full ``[..., out_features]`` output on every rank (else each rank returns its
        ``[..., shard.out_features]`` slice).
    unit : the split is in whole units of rows (:func:`kbit.parallel.shard_range`).
    parts : None, or the row counts of the parts a packed weight holds side by side (q/k/v, or gate/up): each part
        is split over the ranks on its own (:func:`kbit.parallel.packed_ranges`), so one kernel computes this rank's
        slice of each, and the local output is those slices side by side (``local_parts`` columns each).

    Buffers: those of ``shard`` (``self.shard``); ``ranges`` lists this rank's rows of W (one ``(start, stop)`` a
    part); ``start``, ``stop`` are its first range.
    """

    def __init__(self, shard: KbitLinear, out_features: int, *, group=None, gather_output: bool = False,
                 unit: int = COLUMN_UNIT, parts=None):
        super().__init__()
        self.shard = _check_linear("shard", shard)
        self.group = group
        self.rank, self.world = _rank_world(group)
        self.unit = unit
        self.parts = None if parts is None else tuple(parts)
        if self.parts is not None and sum(self.parts) != out_features:
            fail(ValueError, "parts", f"row counts summing to out_features = {out_features}", repr(self.parts))
        spans = [self._ranges(out_features, r) for r in range(self.world)]
        #: [rank][part] rows of each rank's slice of each part
        self.part_sizes = [[b - a for a, b in rs] for rs in spans]
        self.sizes = [sum(p) for p in self.part_sizes]
        self.ranges = spans[self.rank]
        self.local_parts = self.part_sizes[self.rank]
        self.start, self.stop = self.ranges[0]
        if shard.out_features != self.sizes[self.rank]:
            fail(ValueError, "shard", f"out_features {self.sizes[self.rank]} (rows {self._rows()} of "
                 f"{out_features} on rank {self.rank} of {self.world}, unit {unit})", shard.out_features)
        self.in_features, self.out_features = shard.in_features, int(out_features)
        self.gather_output = bool(gather_output)

    def _ranges(self, out_features: int, rank: int) -> list[tuple[int, int]]:
        if self.parts is None:
            return [shard_range(out_features, rank, self.world, self.unit)]
        return packed_ranges(self.parts, rank, self.world, self.unit)

    def _rows(self) -> str:
        return ", ".join(f"{a}:{b}" for a, b in self.ranges)

    @classmethod
    def from_weight(cls, qw: KbitWeight, bias: torch.Tensor | None = None, *, group=None,
                    dtype: torch.dtype = torch.bfloat16, gather_output: bool = False, unit: int = COLUMN_UNIT,
                    parts=None) -> ColumnParallelKbitLinear:
        """This rank's part of the layer with the whole weight ``qw [N, K]`` (packed; no float copy is made)."""
        rank, world = _rank_world(group)
        shard = shard_weight(qw, 0, rank, world, unit, parts=parts)
        if bias is not None:
            ranges = [shard_range(qw.N, rank, world, unit)] if parts is None else \
                packed_ranges(parts, rank, world, unit)
            bias = torch.cat([bias[a:b] for a, b in ranges])
        return cls(KbitLinear.from_weight(shard, bias, dtype), qw.N, group=group, gather_output=gather_output,
                   unit=unit, parts=parts)

    @classmethod
    def from_linear(cls, linear: KbitLinear, *, group=None, gather_output: bool = False, unit: int = COLUMN_UNIT,
                    parts=None) -> ColumnParallelKbitLinear:
        """This rank's part of ``linear`` (its canonical weight and bias are sliced; ``linear`` can be freed).

        ``parts="packed"``: the layer's ``packed_parts`` attribute (set where a packed layer is built), else two
        equal halves (transformers' ``"packed_colwise"``: a gate/up weight)."""
        linear = _check_linear("linear", linear)
        if isinstance(parts, str):
            if parts != "packed":
                fail(ValueError, "parts", "None, 'packed' or a tuple of row counts", repr(parts))
            n = linear.out_features
            parts = getattr(linear, "packed_parts", None) or (n // 2, n - n // 2)
        return cls.from_weight(linear.weight(), linear.bias, group=group, dtype=linear.dtype,
                               gather_output=gather_output, unit=unit, parts=parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shard(x)
        if self.gather_output and self.world > 1:
            y = gather_last_dim(y, self.sizes, self.group)
            if self.parts is not None:  # rank-major [r0: p0 p1 .., r1: p0 p1 ..] -> part-major
                pieces = y.split([n for sizes in self.part_sizes for n in sizes], dim=-1)
                nparts = len(self.parts)
                y = torch.cat([pieces[r * nparts + p] for p in range(nparts) for r in range(self.world)], dim=-1)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rows={self._rows()}, "
                f"rank={self.rank}/{self.world}, gather_output={self.gather_output}"
                + (f", parts={self.parts}" if self.parts is not None else ""))


class ColumnParallelLinear(nn.Module):
    """A float ``nn.Linear`` split along ``out_features`` (``y_local = x @ W[n0:n1].T + bias[n0:n1]``), the output
    all-gathered where ``gather_output``: a model's ``lm_head`` left in bf16 (transformers' ``"colwise_rep"``), so
    that each rank reads its slice of the vocabulary, not all of it, at every decode step.

    ``weight`` ``[stop - start, in_features]`` and ``bias`` are this rank's rows (a copy: the whole layer can be
    freed); the split is in whole units of ``unit`` rows (:func:`kbit.parallel.shard_range`)."""

    def __init__(self, linear: nn.Linear, *, group=None, gather_output: bool = True, unit: int = COLUMN_UNIT):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            fail(TypeError, "linear", "an nn.Linear", type(linear).__name__)
        self.group = group
        self.rank, self.world = _rank_world(group)
        n = linear.out_features
        self.sizes = [b - a for a, b in (shard_range(n, r, self.world, unit) for r in range(self.world))]
        self.start, self.stop = shard_range(n, self.rank, self.world, unit)
        self.weight = nn.Parameter(linear.weight.detach()[self.start:self.stop].clone(), requires_grad=False)
        b = linear.bias
        self.bias = None if b is None else nn.Parameter(b.detach()[self.start:self.stop].clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, n
        self.gather_output = bool(gather_output)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group=None, gather_output: bool = True, unit: int = COLUMN_UNIT,
                    parts=None) -> ColumnParallelLinear:
        if parts is not None:
            fail(ValueError, "parts", "None for a float layer (packed float weights are not split)", repr(parts))
        return cls(linear, group=group, gather_output=gather_output, unit=unit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        if self.gather_output and self.world > 1:
            y = gather_last_dim(y, self.sizes, self.group)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rows={self.start}:{self.stop}, "
                f"rank={self.rank}/{self.world}, gather_output={self.gather_output}")


class RowParallelKbitLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W [out_features, in_features]`` split along ``in_features`` (on whole
    quantization blocks) over the group; partial products all-reduced, the bias added once.

    Parameters
    ----------
    shard : this rank's ``KbitLinear`` without bias (columns ``start:stop`` of W).
    in_features : K of the whole weight.
    bias : the full bias ``[out_features]`` (every rank holds it; added after the all-reduce) or None.
    group : the process group (None: the default group).
    input_is_parallel : the input is already this rank's slice ``[..., stop - start]`` (the output of a
        column-parallel layer split with the same unit); False: it is the full ``[..., in_features]`` and each
        rank takes its slice.
    unit : the split is in whole units of columns, a multiple of the blocksize (default: the blocksize).

    ``comm``: None (the all-reduce is chosen by message size from :data:`kbit.parallel.ALLREDUCE_TABLE` for the
    device: symmetric-memory one-shot / two-shot for small messages, NCCL otherwise), or an
    :class:`~kbit.parallel.AllReduceConfig` that pins the choice (tests, benchmarks). The symmetric buffer is made
    at the first eligible forward: run one eager forward before capturing a CUDA graph.
    """

    #: see the class docstring
    comm: AllReduceConfig | None = None

    def __init__(self, shard: KbitLinear, in_features: int, bias: torch.Tensor | None = None, *, group=None,
                 input_is_parallel: bool = True, unit: int | None = None):
        super().__init__()
        self.shard = _check_linear("shard", shard)
        if shard.bias is not None:
            fail(ValueError, "shard", "a KbitLinear without bias (the bias is added once, after the all-reduce)",
                 "one with a bias")
        self.group = group
        self.rank, self.world = _rank_world(group)
        self.unit = shard.blocksize if unit is None else unit
        self.start, self.stop = shard_range(in_features, self.rank, self.world, self.unit)
        if shard.in_features != self.stop - self.start:
            fail(ValueError, "shard", f"in_features {self.stop - self.start} (columns {self.start}:{self.stop} of "
                 f"{in_features} on rank {self.rank} of {self.world}, unit {self.unit})", shard.in_features)
        self.in_features, self.out_features = int(in_features), shard.out_features
        self.input_is_parallel = bool(input_is_parallel)
        if bias is not None:
            self.register_buffer("bias", bias.detach().to(device=shard.codes.device, dtype=shard.dtype).clone())
        else:
            self.bias = None

    @classmethod
    def from_weight(cls, qw: KbitWeight, bias: torch.Tensor | None = None, *, group=None,
                    dtype: torch.dtype = torch.bfloat16, input_is_parallel: bool = True, unit: int | None = None
                    ) -> RowParallelKbitLinear:
        """This rank's part of the layer with the whole weight ``qw [N, K]`` (packed; no float copy is made)."""
        rank, world = _rank_world(group)
        shard = shard_weight(qw, 1, rank, world, unit)
        return cls(KbitLinear.from_weight(shard, None, dtype), qw.K, bias, group=group,
                   input_is_parallel=input_is_parallel, unit=unit)

    @classmethod
    def from_linear(cls, linear: KbitLinear, *, group=None, input_is_parallel: bool = True, unit: int | None = None
                    ) -> RowParallelKbitLinear:
        """This rank's part of ``linear`` (its canonical weight is sliced; ``linear`` can be freed)."""
        linear = _check_linear("linear", linear)
        return cls.from_weight(linear.weight(), linear.bias, group=group, dtype=linear.dtype,
                               input_is_parallel=input_is_parallel, unit=unit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        if self.world > 1:
            y = all_reduce_sum(y, self.group, self.comm)
        return y if self.bias is None else y + self.bias

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product ``x[..., start:stop] @ W[:, start:stop].T``: no all-reduce, no bias. For a
        caller that fuses the sum over the group into the kernel that reads it next (then adds ``bias``)."""
        if not self.input_is_parallel:
            if x.shape[-1] != self.in_features:
                fail(ValueError, "x", f"last dimension {self.in_features} (the full input)", x.shape[-1])
            x = x[..., self.start:self.stop].contiguous()  # the kernels read rows of x as dense vectors
        return self.shard(x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, columns={self.start}:"
                f"{self.stop}, rank={self.rank}/{self.world}, input_is_parallel={self.input_is_parallel}, "
                f"bias={self.bias is not None}")

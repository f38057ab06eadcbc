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
from kbit.parallel.shard import COLUMN_UNIT, shard_range, shard_weight
from kbit.utils.checks import fail

__all__ = ["ColumnParallelKbitLinear", "RowParallelKbitLinear"]


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first "
                           "(or run under torchrun)")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_linear(name: str, linear) -> KbitLinear:
    if not isinstance(linear, KbitLinear):
        fail(TypeError, name, "a KbitLinear", type(linear).__name__)
    return linear


def gather_last_dim(y: torch.Tensor, sizes: list[int], group=None) -> torch.Tensor:
    """All-gather ``y [..., sizes[rank]]`` from every rank and concatenate along the last dimension.

    Shards of unequal width are padded to the widest for the collective (``all_gather`` moves equal sizes)."""
    width = max(sizes)
    padded = torch.nn.functional.pad(y, (0, width - y.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[..., :s] for p, s in zip(parts, sizes, strict=True)], dim=-1)


class ColumnParallelKbitLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W [out_features, in_features]`` split along ``out_features`` over the group.

    Parameters
    ----------
    shard : this rank's ``KbitLinear`` (rows ``start:stop`` of W and of the bias).
    out_features : N of the whole weight.
    group : the ``torch.distributed`` process group (None: the default group).
    gather_output : all-gather the full ``[..., out_features]`` output on every rank (else each rank returns its
        ``[..., stop - start]`` slice).
    unit : the split is in whole units of rows (:func:`kbit.parallel.shard_range`).

    Buffers: those of ``shard`` (``self.shard``); ``start``, ``stop`` say which rows this rank holds.
    """

    def __init__(self, shard: KbitLinear, out_features: int, *, group=None, gather_output: bool = False,
                 unit: int = COLUMN_UNIT):
        super().__init__()
        self.shard = _check_linear("shard", shard)
        self.group = group
        self.rank, self.world = _rank_world(group)
        self.unit = unit
        self.sizes = [b - a for a, b in (shard_range(out_features, r, self.world, unit) for r in range(self.world))]
        self.start, self.stop = shard_range(out_features, self.rank, self.world, unit)
        if shard.out_features != self.stop - self.start:
            fail(ValueError, "shard", f"out_features {self.stop - self.start} (rows {self.start}:{self.stop} of "
                 f"{out_features} on rank {self.rank} of {self.world}, unit {unit})", shard.out_features)
        self.in_features, self.out_features = shard.in_features, int(out_features)
        self.gather_output = bool(gather_output)

    @classmethod
    def from_weight(cls, qw: KbitWeight, bias: torch.Tensor | None = None, *, group=None,
                    dtype: torch.dtype = torch.bfloat16, gather_output: bool = False, unit: int = COLUMN_UNIT
                    ) -> ColumnParallelKbitLinear:
        """This rank's part of the layer with the whole weight ``qw [N, K]`` (packed; no float copy is made)."""
        rank, world = _rank_world(group)
        shard = shard_weight(qw, 0, rank, world, unit)
        start, stop = shard_range(qw.N, rank, world, unit)
        b = None if bias is None else bias[start:stop]
        return cls(KbitLinear.from_weight(shard, b, dtype), qw.N, group=group, gather_output=gather_output,
                   unit=unit)

    @classmethod
    def from_linear(cls, linear: KbitLinear, *, group=None, gather_output: bool = False, unit: int = COLUMN_UNIT
                    ) -> ColumnParallelKbitLinear:
        """This rank's part of ``linear`` (its canonical weight and bias are sliced; ``linear`` can be freed)."""
        linear = _check_linear("linear", linear)
        return cls.from_weight(linear.weight(), linear.bias, group=group, dtype=linear.dtype,
                               gather_output=gather_output, unit=unit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shard(x)
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
    """

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
        if not self.input_is_parallel:
            if x.shape[-1] != self.in_features:
                fail(ValueError, "x", f"last dimension {self.in_features} (the full input)", x.shape[-1])
            x = x[..., self.start:self.stop].contiguous()  # the kernels read rows of x as dense vectors
        y = self.shard(x)
        if self.world > 1:
            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, columns={self.start}:"
                f"{self.stop}, rank={self.rank}/{self.world}, input_is_parallel={self.input_is_parallel}, "
                f"bias={self.bias is not None}")

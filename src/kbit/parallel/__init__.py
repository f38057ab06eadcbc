"""Tensor parallelism of k-bit layers over ``torch.distributed`` (docs/parallel.md): shards of a packed weight
without requantizing, column- / row-parallel layers around ordinary ``KbitLinear`` shards, and a plan-driven
``parallelize_kbit`` with transformers' ``tp_plan`` names."""

from kbit.parallel.linear import ColumnParallelKbitLinear, RowParallelKbitLinear, gather_last_dim
from kbit.parallel.plan import LLAMA_PLAN, STYLES, parallelize_kbit, plan_unit
from kbit.parallel.shard import COLUMN_UNIT, shard_range, shard_weight

__all__ = ["COLUMN_UNIT", "LLAMA_PLAN", "STYLES", "ColumnParallelKbitLinear", "RowParallelKbitLinear",
           "gather_last_dim", "parallelize_kbit", "plan_unit", "shard_range", "shard_weight"]

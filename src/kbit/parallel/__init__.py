"""Tensor parallelism of k-bit layers over ``torch.distributed`` (docs/parallel.md): shards of a packed weight
without requantizing, column- / row-parallel layers around ordinary ``KbitLinear`` shards, a plan-driven
``parallelize_kbit`` with transformers' ``tp_plan`` names, and the all-reduce chosen by message size (NCCL or
symmetric memory); expert parallel ``KbitMoE`` blocks; sharded checkpoints (a file per rank)."""

from kbit.parallel.checkpoint import load_sharded, read_index, save_sharded, shard_layout, shard_specs, write_index
from kbit.parallel.comm import ALLREDUCE_TABLE, AllReduceConfig, all_reduce_sum, allreduce_config, choose_method
from kbit.parallel.linear import ColumnParallelKbitLinear, ColumnParallelLinear, RowParallelKbitLinear, gather_last_dim
from kbit.parallel.moe import ExpertParallelKbitMoE, expert_range, localize_pairs, shard_experts
from kbit.parallel.plan import LLAMA_PLAN, PACKED_LLAMA_PLAN, QWEN3_MOE_PLAN, STYLES, parallelize_kbit, plan_unit
from kbit.parallel.shard import COLUMN_UNIT, packed_ranges, shard_range, shard_weight, split_rows
from kbit.parallel.shardfile import ShardReader, ShardWriter

__all__ = ["ALLREDUCE_TABLE", "COLUMN_UNIT", "LLAMA_PLAN", "PACKED_LLAMA_PLAN", "QWEN3_MOE_PLAN", "STYLES",
           "AllReduceConfig", "ColumnParallelKbitLinear", "ColumnParallelLinear", "ExpertParallelKbitMoE",
           "RowParallelKbitLinear",
           "ShardReader", "ShardWriter", "all_reduce_sum", "allreduce_config", "choose_method", "expert_range",
           "gather_last_dim", "load_sharded", "localize_pairs", "packed_ranges", "parallelize_kbit", "plan_unit",
           "read_index", "save_sharded", "shard_experts", "shard_layout", "shard_range", "shard_specs", "shard_weight",
           "split_rows", "write_index"]

"""Kernels by (source file, ``extern "C"`` name): the one way the layers above compile a CUDA kernel.

TRANSITIONAL: the sources still live in the ``*_src`` Python strings; this table maps each file/name pair that
the ``.cu`` files will have to the string, its old kernel name and its old ``KERNEL`` define.
"""

from __future__ import annotations

from kbit.cuda import dequant_src, gemv_mma_src, grouped_mma_src
from kbit.cuda.runtime import Kernel
from kbit.cuda.runtime import compile_kernel as _compile_source

_MMA = gemv_mma_src.SOURCE
_GRP = grouped_mma_src.SOURCE
_LEGACY = {
    ("gemv_mma_split.cu", "kbit_gemv_mma_split"): (_MMA, "kbit_gemv_mma", {"KERNEL": 1}),
    ("gemv_mma_streamk.cu", "kbit_gemv_mma_streamk"): (_MMA, "kbit_gemv_mma", {"KERNEL": 3}),
    ("mma_pipe.cu", "kbit_mma_pipe"): (_MMA, "kbit_gemv_mma", {"KERNEL": 4}),
    ("mma_pipe.cu", "kbit_grouped_mma_pipe"): (_MMA, "kbit_grouped_mma4", {"KERNEL": 5}),
    ("wgmma.cu", "kbit_wgmma"): (_MMA, "kbit_gemv_mma", {"KERNEL": 7}),
    ("dead.cu", "kbit_kernel2"): (_MMA, "kbit_gemv_mma", {"KERNEL": 2}),  # to be deleted with its callers
    ("dead.cu", "kbit_kernel6"): (_MMA, "kbit_gemv_mma", {"KERNEL": 6}),  # to be deleted with its callers
    ("x_tiles.cu", "kbit_x_tiles"): (gemv_mma_src.X_TILES_SOURCE, "kbit_x_tiles", {}),
    ("x_tiles.cu", "kbit_x_tiles_g"): (gemv_mma_src.X_TILES_SOURCE, "kbit_x_tiles_g", {}),
    ("x_tiles.cu", "kbit_x_tiles_silu_g"): (gemv_mma_src.X_TILES_SOURCE, "kbit_x_tiles_silu_g", {}),
    ("dequant_mma.cu", "kbit_deq_mma"): (gemv_mma_src.DEQ_SOURCE, "kbit_deq_mma", {}),
    ("moe_blocks.cu", "kbit_moe_blocks"): (_GRP, "kbit_moe_blocks", {}),
    ("moe_blocks.cu", "kbit_moe_blocks_off"): (_GRP, "kbit_moe_blocks_off", {}),
    ("moe_blocks.cu", "kbit_moe_split"): (_GRP, "kbit_moe_split", {}),
    ("moe_blocks.cu", "kbit_moe_split_rows"): (_GRP, "kbit_moe_split_rows", {}),
    ("grouped_mma.cu", "kbit_grouped_mma"): (_GRP, "kbit_grouped_mma", {}),
    ("dequant.cu", "kbit_dequant"): (dequant_src.SOURCE, "kbit_dequant", {}),
}


def compile_kernel(file: str, name: str, defines: dict, device) -> Kernel:
    """Compile (once a process; CUBINs are also cached on disk) and load kernel ``name`` of ``csrc/<file>`` with
    ``defines`` (``-D`` options) for ``device``."""
    try:
        source, old_name, extra = _LEGACY[(file, name)]
    except KeyError:
        raise ValueError(f"kernel: expected one of {sorted(_LEGACY)}, got {(file, name)}") from None
    return _compile_source(source, old_name, {**defines, **extra}, device)

"""No kernel reads what the launch before it writes above its PDL wait (tests/pdl_scan.py: NVRTC + cuobjdump, no
kernel runs). ptxas may move a read-only load above ``griddepcontrol.wait``; it did with the grouped kernels'
block count, which then raced the routing launch in CUDA graphs. Marked gpu: it needs the NVRTC and cuobjdump
that the GPU machine has (the CPU CI's torch has no NVRTC)."""

import pytest

import pdl_scan  # tests/pdl_scan.py
from kbit.ops.grouped_mma import _wgmma_defines, grouped_mma_build
from kbit.tuning.moe import GroupedMmaConfig, wgmma_config


def _builds():
    """The grouped builds of MoE steps from decode to prefill at every k (both activation dtypes, both scale
    formats), and the x gathers of kernel 7."""
    out = []
    for k in (2, 3, 4, 5):
        for i, cfg in enumerate((GroupedMmaConfig(1, 1, 4, 4), GroupedMmaConfig(1, 2, 8, 2),
                                 GroupedMmaConfig(4, 1, 4), GroupedMmaConfig(4, 2, 8), GroupedMmaConfig(4, 8, 16))):
            sf, bf16 = ("log8", "fp16")[(k + i) % 2], (k + i // 2) % 2 == 0
            b = grouped_mma_build(k, cfg, sf, bf16)
            out.append((b.file, (b.name,), b.defines))
        for rpe in (20, 100, 300):
            d, _ = _wgmma_defines(k, wgmma_config(rpe))
            out.append(("wgmma.cu", ("kbit_wgmma",), {**d, "BF16": int(rpe == 100) ^ (k % 2), "FP16_SCALES": k % 2}))
    out.append(("x_tiles.cu", ("kbit_x_tiles", "kbit_x_tiles_g", "kbit_x_tiles_silu_g"), {}))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("file,names,defines", _builds(), ids=lambda v: v if isinstance(v, str) else None)
def test_gpu_no_load_above_the_pdl_wait(file, names, defines):
    from kbit.cuda import runtime

    try:
        runtime._nvrtc()
    except OSError:
        pytest.skip("no NVRTC")
    moved = {name: params for name, params in pdl_scan.hoisted(file, names, defines).items() if params}
    assert not moved, f"loads of these parameters moved above the PDL wait: {moved}"

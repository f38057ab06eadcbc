"""T64 (csrc/common.cuh: the k = 4 lookup table of 256-byte rows) in kernels 1 and 3 at M = 1:
bit-identical to the same plan built without it (deterministic split-K sums on), and as close to the float64
reference as the kernels' own tests ask. Where kbit.tuning.mma_plan does not set T64 itself, the test builds the T64
kernel from the plan's defines and reserves the 64 KB table."""

import dataclasses

import pytest
import torch

from kbit import cuda as KC
from kbit import options
from kbit.ops import gemv_mma as MM
from kbit.ops.mma import common as MC
from kbit.ops.mma import layout as LY
from kbit.ops.reference import gemv_reference
from kbit.tuning.mma import MmaConfig as Mma
from kbit.tuning.mma_plan import KERNELS, table_smem

T64_SMEM = 65536 + 128  # the table and its alignment pad
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not (CUDA and MC.kernels_available()), reason="needs the CUDA kernel (GPU + NVRTC)")


def _weight(N, K_, k, sf, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    codes = torch.randint(-(2**31), 2**31 - 1, (N, K_ * k // 32), generator=g, dtype=torch.int32)
    if sf == "log8":
        scales = torch.randint(0, 64, (N, K_ // 32), generator=g, dtype=torch.uint8)
        scales[:, 0] = 255  # an all-zero block
        ts = torch.rand((), generator=g) + 0.5
    else:
        scales = (torch.rand(N, K_ // 32, generator=g) + 0.05).half()
        ts = torch.ones(())
    cb = torch.sort(torch.rand(2**k, generator=g) * 2 - 1).values
    return [t.cuda() for t in (codes, scales, ts, cb)]


def _run(p, defines, shared, x, rc, rs, ts, cb, N):
    """One launch of plan p's kernel built with defines, shared bytes of dynamic shared memory."""
    dev = x.device
    kern = KC.compile_kernel(*KERNELS[p.kernel], defines, dev)
    x2 = MC.prep_x(x, p.S)
    y = torch.full((1, N), float("nan"), dtype=x.dtype, device=dev)
    ws, cnt = MC.workspace(dev, p.ws_floats, p.n_cnt) if p.use_ws else (y, y)
    args = MM._kernel_args(p, rc, rs, ts, cb, x2.data_ptr(), y.data_ptr(), None, ws, cnt, 1, N, x2.stride(0),
                           y.stride(0))
    kern((p.grid,), p.warps * 32, MM._ARGS_FMT, *args, shared=shared, pdl=True)
    torch.cuda.synchronize()
    return y


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K_,config", [
    (6144, 4096, Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True)),  # CTA-aligned units
    (5000, 4096, Mma(3, warps=8, min_ctas=2, ring=2, x_smem=True)),  # DET slots, odd tile count
    (4100, 5120, Mma(3, warps=8, min_ctas=2)),  # x from global memory, N not a multiple of 16
    (2048, 14336, Mma(1, warps=8, min_ctas=2)),  # kernel 1
    (1000, 4096, Mma(1, warps=4, min_ctas=3)),  # kernel 1, 3 CTAs an SM
])
@pytest.mark.parametrize("k", [4])
@pytest.mark.parametrize("sf", ["log8", "fp16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_t64_bit_identical(monkeypatch, N, K_, config, k, sf, dtype):
    on = dataclasses.replace(options.get(), deterministic=True)
    monkeypatch.setattr(options, "get", lambda: on)
    p = MM.plan_launch(k, 1, N, K_, scale_format=sf, config=config)
    base = {n: v for n, v in p.defines.items() if n != "T64"}
    base["BF16"] = int(dtype == torch.bfloat16)
    shared0 = p.shared - p.defines.get("T64", 0) * (T64_SMEM - table_smem(k))
    codes, scales, ts, cb = _weight(N, K_, k, sf, seed=N + k)
    rc, rs = LY.repacked(codes, scales, k=k, blocksize=32, scale_format=sf, N=N, K=K_)
    x = torch.randn(1, K_, dtype=dtype, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N))
    y0 = _run(p, base, shared0, x, rc, rs, ts, cb, N)
    y1 = _run(p, {**base, "T64": 1}, shared0 - table_smem(k) + T64_SMEM, x, rc, rs, ts, cb, N)
    assert torch.equal(y0, y1), f"T64 differs: max |diff| {(y0.float() - y1.float()).abs().max().item()}"
    ref = gemv_reference(x, codes, scales, ts, cb, k=k, blocksize=32, scale_format=sf, N=N, K=K_)
    err = ((y1.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < (4e-3 if dtype == torch.float16 else 2.4e-2), f"rel err {err:.2e}"

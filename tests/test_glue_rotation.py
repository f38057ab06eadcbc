"""The glue ops with a fused rotation (kbit.ops.glue: rms_norm / add_rms_norm / silu_mul with ``rotation=``): the
Triton kernels (the interpreter on the CPU, CUDA under ``gpu``) against the unfused ops' float64 references followed
by the float64 Hadamard transform."""

import os
import subprocess
import sys

import pytest
import torch

import kbit
from kbit.format import Rotation
from kbit.ops import glue
from kbit.ops.hadamard import rotate_reference, rotation_signs

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: one rounding of a float32 result stored in each dtype (relative to the row's largest |value|), plus the
#: rounding of the unrotated value before the transform (which spreads over the block: a few ulps)
RTOL = {torch.float16: 3e-3, torch.bfloat16: 2.4e-2, torch.float32: 3e-6}
#: widths: not powers of two, whole rotation blocks (5120: 1024, 14336: 2048, 2880: 64, 11008: 256)
WIDTHS = (5120, 14336, 2880)
CASES = [(K, M, dt) for K in WIDTHS for M in (1, 3, 17) for dt in DTYPES]


def _close(y, ref, dtype):
    """``y`` within RTOL[dtype] of the float64 ``ref`` (per row scale); prints where not."""
    assert y.dtype == dtype and y.shape == ref.shape
    rel = (y.double().cpu() - ref).abs() / ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    where = tuple(int(i) for i in torch.unravel_index(rel.argmax(), rel.shape))
    assert float(rel.max()) <= RTOL[dtype], f"max error {float(rel.max()):.3g} (relative to the row max) at {where}"


def _norm_inputs(M, H, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, H, generator=g) * 2).to(dtype)
    res = torch.randn(M, H, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    return x.to(device), res.to(device), w.to(device)


def _norm_ref(x, w, eps, rot, res=None):
    """The unfused op's float64 reference, rounded to x's dtype as that op stores it, then ``R`` in float64."""
    y, r = glue.rms_norm_reference(x.cpu().double(), w.cpu().double(), eps,
                                   None if res is None else res.cpu().double())
    return rotate_reference(y.to(x.dtype).double(), rot), r


def _check_norms(M, H, dtype, device, rot=None):
    rot = rot or Rotation.for_width(H, seed=M)
    x, res, w = _norm_inputs(M, H, dtype, device, H + M)
    y, r = glue.add_rms_norm(x, res, w, 1e-5, rotation=rot)
    assert torch.equal(r, res + x)  # the residual is not rotated, and the add rounds as transformers' does
    _close(y, _norm_ref(r, w, 1e-5, rot)[0], dtype)
    _close(glue.rms_norm(x, w, 1e-6, rotation=rot), _norm_ref(x, w, 1e-6, rot)[0], dtype)


def _check_silu(M, I, dtype, device, rot=None):
    rot = rot or Rotation.for_width(I, seed=I)
    g = torch.Generator().manual_seed(I * M)
    gu = torch.randn(M, 2 * I + 3, generator=g).to(dtype).to(device)  # column slices of a fused output
    gate, up = gu[:, :I], gu[:, I:2 * I]
    y = glue.silu_mul(gate, up, rotation=rot)
    plain = glue.silu_mul_reference(gate.cpu().double(), up.cpu().double()).to(dtype)
    _close(y, rotate_reference(plain.double(), rot), dtype)


@pytest.mark.parametrize("H, M, dtype", CASES)
def test_norms_rotated(H, M, dtype):
    _check_norms(M, H, dtype, "cpu")


@pytest.mark.parametrize("I, M, dtype", CASES)
def test_silu_mul_rotated(I, M, dtype):
    _check_silu(M, I, dtype, "cpu")


@pytest.mark.parametrize("width, rot", [(11008, None), (192, Rotation(seed=1, block=64)),
                                        (5120, Rotation(seed=2, block=32)), (99, Rotation(seed=3, block=1)),
                                        (4096, None), (16384, None)])
def test_other_blocks(width, rot):
    # odd multiples of the block, blocks below the largest, signs only (block 1), one block the whole row
    for dtype in (torch.bfloat16, torch.float32):
        _check_norms(2, width, dtype, "cpu", rot)
        _check_silu(2, width, dtype, "cpu", rot)


def test_explicit_signs_and_unrotated_path():
    rot = Rotation(seed=4, block=32)
    x, res, w = _norm_inputs(3, 96, torch.float16, "cpu", 0)
    s = rotation_signs(rot, 96, "cpu")
    assert torch.equal(glue.add_rms_norm(x, res, w, 1e-5, rot, s)[0], glue.add_rms_norm(x, res, w, 1e-5, rot)[0])
    other = Rotation(seed=5, block=32)
    assert not torch.equal(glue.rms_norm(x, w, 1e-5, rot), glue.rms_norm(x, w, 1e-5, other))
    # without a rotation: today's op, bit for bit
    assert torch.equal(glue.silu_mul(x, res, None), torch.ops.kbit.silu_mul(x, res))
    assert torch.equal(glue.rms_norm(x, w, 1e-5, None), torch.ops.kbit.rms_norm(x, w, 1e-5))


def test_cpu_reference_path():
    # outside the interpreter CPU tensors take the references: the same numbers as the checks above use
    rot = Rotation(seed=7, block=64)
    x, res, w = _norm_inputs(3, 192, torch.bfloat16, "cpu", 1)
    with kbit.options.override(interpret=False):
        y, r = glue.add_rms_norm(x, res, w, 1e-5, rotation=rot)
        z = glue.silu_mul(x, res, rotation=rot)
    assert torch.equal(r, res + x)
    assert torch.equal(y, rotate_reference(glue.rms_norm_reference(x, w, 1e-5, res)[0], rot))
    assert torch.equal(z, rotate_reference(glue.silu_mul_reference(x, res), rot))


def test_rotation_errors():
    x = torch.randn(2, 96)
    w = torch.ones(96)
    with pytest.raises(ValueError, match=r"x.shape\[1\] \(H\): expected a multiple of the rotation block 64, got 96"):
        glue.rms_norm(x, w, 1e-5, rotation=Rotation(seed=0, block=64))
    with pytest.raises(ValueError, match=r"gate.shape\[1\] \(I\): expected a multiple of the rotation block 64"):
        glue.silu_mul(x, x, rotation=Rotation(seed=0, block=64))
    with pytest.raises(TypeError, match="rotation: expected a kbit.format.Rotation"):
        glue.add_rms_norm(x, x, w, 1e-5, rotation={"seed": 0})
    with pytest.raises(ValueError, match="signs: expected None when rotation is None"):
        glue.silu_mul(x, x, signs=torch.ones(96, dtype=torch.int8))
    with pytest.raises((TypeError, ValueError), match="signs"):
        glue.add_rms_norm(x, x, w, 1e-5, Rotation(seed=0, block=32), torch.ones(96))
    with pytest.raises((TypeError, ValueError), match="signs"):
        glue.rms_norm(x, w, 1e-5, Rotation(seed=0, block=32), torch.ones(48, dtype=torch.int8))


def test_ops_schema_fake_and_compile():
    rot = Rotation(seed=8, block=16)
    x, res, w = _norm_inputs(3, 64, torch.float32, "cpu", 2)
    s = rotation_signs(rot, 64, "cpu")
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.kbit.rms_norm_rotated.default, (x, w, 1e-5, s, 16), test_utils=utils)
    torch.library.opcheck(torch.ops.kbit.add_rms_norm_rotated.default, (x, res, w, 1e-5, s, 16), test_utils=utils)
    torch.library.opcheck(torch.ops.kbit.silu_mul_rotated.default, (x, res, s, 16), test_utils=utils)
    eager = glue.add_rms_norm(x, res, w, 1e-5, rot)
    compiled = torch.compile(lambda a, b: glue.add_rms_norm(a, b, w, 1e-5, rot, s), fullgraph=True,
                             backend="aot_eager")
    for got, want in zip(compiled(x, res), eager, strict=True):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------ GPU
GPU_CASES = CASES + [(K, 1024, dt) for K in (4096, 14336) for dt in (torch.float16, torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("H, M, dtype", GPU_CASES + [(4096, 1, torch.bfloat16), (16384, 3, torch.float16)])
def test_gpu_norms_rotated(H, M, dtype):
    _check_norms(M, H, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("I, M, dtype", GPU_CASES + [(11008, 5, torch.bfloat16), (28672, 2, torch.float16)])
def test_gpu_silu_mul_rotated(I, M, dtype):
    _check_silu(M, I, dtype, "cuda")


@pytest.mark.gpu
def test_gpu_cuda_graph():
    H, I = 4096, 14336
    rot_h, rot_i = Rotation.for_width(H, seed=1), Rotation.for_width(I, seed=2)
    x, res, w = _norm_inputs(2, H, torch.bfloat16, "cuda", 3)
    gu = torch.randn(2, 2 * I, device="cuda", dtype=torch.bfloat16)
    sh, si = rotation_signs(rot_h, H, x.device), rotation_signs(rot_i, I, x.device)

    def step():
        y, r = glue.add_rms_norm(x, res, w, 1e-5, rot_h, sh)
        return y, r, glue.silu_mul(gu[:, :I], gu[:, I:], rot_i, si)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn_like(x))
    gu.copy_(torch.randn_like(gu))
    graph.replay()
    for got, want in zip(out, step(), strict=True):
        assert torch.equal(got, want)


AOT_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kbit.kernels.glue import add_rms_norm_rot_kernel, silu_mul_rot_kernel
norm = {"X": "*bf16", "Res": "*bf16", "W": "*bf16", "Signs": "*i8", "Y": "*bf16", "ResOut": "*bf16",
        "stride_x": "i32", "stride_r": "i32", "stride_y": "i32", "stride_ro": "i32", "H": "i32", "eps": "fp32",
        "scale": "fp32", "HAS_RES": "constexpr", "BLOCK": "constexpr", "LOG_B": "constexpr", "PDL": "constexpr"}
for res, block, log_b, warps in ((True, 4096, 12, 16), (False, 8192, 10, 16), (True, 4096, 6, 16)):
    src = ASTSource(add_rms_norm_rot_kernel, norm, {"HAS_RES": res, "BLOCK": block, "LOG_B": log_b, "PDL": True})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
silu = {"G": "*fp16", "U": "*fp16", "Signs": "*i8", "Y": "*fp16", "stride_g": "i32", "stride_u": "i32",
        "stride_y": "i32", "I": "i32", "scale": "fp32", "BLOCK": "constexpr", "LOG_B": "constexpr",
        "PDL": "constexpr"}
for block, log_b, warps in ((2048, 11, 8), (1024, 8, 4)):
    src = ASTSource(silu_mul_rot_kernel, silu, {"BLOCK": block, "LOG_B": log_b, "PDL": True})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
print("compiled")
"""


def test_kernels_compile_for_sm90():
    # the interpreter runs no compiler: lower the kernels to sm_90 cubins (Triton's bundled ptxas, no GPU needed)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", AOT_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]

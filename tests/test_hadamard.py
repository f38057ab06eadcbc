"""The randomized Hadamard rotation: kbit.format.Rotation (the rule, the file field and its checks) and the online
transform kbit.ops.hadamard.rotate (Triton kernel under the interpreter, float64 reference, the torch op)."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file as raw_save

import kbit
from kbit.format import MAX_ROTATION_BLOCK, Rotation
from kbit.format import serialize as S
from kbit.format.spec import rotation_block
from kbit.ops import hadamard as H

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: tolerance of a float32 computation stored in each dtype, relative to the largest |value| of a row
RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-6}


def _close(y, ref, dtype):
    """``y`` within one rounding of ``dtype`` of the float64 ``ref`` (per row scale); prints where not."""
    assert y.dtype == dtype and y.shape == ref.shape
    err = (y.double() - ref).abs()
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    rel = err / scale
    where = tuple(int(i) for i in torch.unravel_index(rel.argmax(), rel.shape))
    assert float(rel.max()) <= RTOL[dtype], f"max error {float(rel.max()):.3g} (relative to the row max) at {where}"


# ------------------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize("K, block", [(11008, 256), (5120, 1024), (2880, 64), (14336, 2048), (4096, 4096),
                                      (28672, 4096), (65536, MAX_ROTATION_BLOCK), (7, 1), (6, 2)])
def test_rotation_block_rule(K, block):
    assert rotation_block(K) == block
    assert Rotation.for_width(K, seed=3) == Rotation(seed=3, block=block)


def test_signs_rule():
    # the documented rule itself (kbit.calibrate.rotation.RandomHadamard uses the same), for any K
    for K, seed in ((96, 0), (11008, 7), (5, 2**62)):
        g = torch.Generator().manual_seed(seed)
        expect = torch.randint(0, 2, (K,), generator=g, dtype=torch.int64) * 2 - 1
        assert torch.equal(Rotation(seed=seed).signs(K, torch.int64), expect)
    assert not torch.equal(Rotation(seed=1).signs(64), Rotation(seed=2).signs(64))


def test_matrix_is_orthogonal_and_blockwise():
    r = Rotation(seed=4, block=16)
    R = r.matrix(48)
    assert torch.allclose(R @ R.T, torch.eye(48, dtype=torch.float64), atol=1e-12)
    assert torch.count_nonzero(R[:16, 16:]) == 0 and torch.count_nonzero(R[16:32, :16]) == 0
    assert torch.allclose(R.abs(), torch.full_like(R, 0.25).masked_fill(R == 0, 0))


@pytest.mark.parametrize("kw, match", [
    (dict(block=3), "block: expected a power of two"),
    (dict(block=0), "block"),
    (dict(block=2 * MAX_ROTATION_BLOCK), "block"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(seed=True), "seed"),
    (dict(kind="dct"), "kind: expected one of"),
])
def test_rotation_rejects(kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Rotation(**kw)


# ------------------------------------------------------------------------------------------ the math
@pytest.mark.parametrize("K", [88, 96, 7, 2880])
def test_rotated_layer_equals_unrotated_float64(K):
    g = torch.Generator().manual_seed(K)
    r = Rotation.for_width(K, seed=11)
    W = torch.randn(13, K, generator=g, dtype=torch.float64)
    x = torch.randn(5, K, generator=g, dtype=torch.float64)
    xr, wr = H.rotate_reference(x, r), H.rotate_reference(W, r)
    torch.testing.assert_close(xr @ wr.T, x @ W.T, rtol=1e-12, atol=1e-11)
    if K <= 96:  # the butterflies are the dense matrix
        torch.testing.assert_close(xr, x @ r.matrix(K), rtol=1e-13, atol=1e-13)


# ------------------------------------------------------------------------------------------ the kernel
CASES = [(K, M, dt) for K in (5120, 2880) for M in (1, 3, 17) for dt in DTYPES]
CASES += [(K, M, dt) for K in (11008, 14336) for M, dt in ((1, torch.bfloat16), (3, torch.float16), (2, torch.float32))]


@pytest.mark.parametrize("K, M, dtype", CASES)
def test_rotate_matches_reference(K, M, dtype):
    g = torch.Generator().manual_seed(K + M)
    r = Rotation.for_width(K, seed=M)
    x = (torch.randn(M, K, generator=g) * 3).to(dtype)
    _close(H.rotate(x, r), H.rotate_reference(x.double(), r), dtype)


@pytest.mark.parametrize("config", [H.HadamardConfig(1, 64, 1), H.HadamardConfig(4, 256, 2),
                                    H.HadamardConfig(8, 32, 1)])
def test_rotate_pinned_configs(config):
    g = torch.Generator().manual_seed(1)
    r = Rotation(seed=9, block=32)
    x = torch.randn(6, 352, generator=g)  # 11 blocks: a tile past K, rows past M
    _close(H.rotate(x, r, config=config), H.rotate_reference(x.double(), r), torch.float32)


def test_rotate_shapes_and_strides():
    r = Rotation(seed=2, block=8)
    x = torch.randn(2, 3, 48)
    _close(H.rotate(x, r), H.rotate_reference(x.double(), r), torch.float32)
    wide = torch.randn(5, 100)
    sl = wide[:, 10:58]  # rows with a stride of 100
    _close(H.rotate(sl, r), H.rotate_reference(sl.double(), r), torch.float32)
    assert H.rotate(torch.randn(0, 48), r).shape == (0, 48)
    one = torch.randn(48)
    _close(H.rotate(one, r), H.rotate_reference(one.double(), r), torch.float32)


def test_rotate_odd_k_is_signs_only():
    r = Rotation.for_width(11, seed=5)
    x = torch.randn(3, 11, dtype=torch.float16)
    assert torch.equal(H.rotate(x, r), x * r.signs(11, torch.float16))


def test_rotate_errors():
    r = Rotation(seed=0, block=64)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] \(K\): expected a multiple of the rotation block 64, got 96"):
        H.rotate(torch.randn(2, 96), r)
    with pytest.raises((TypeError, ValueError), match="x"):
        H.rotate(torch.randn(2, 64, dtype=torch.float64), r)
    with pytest.raises(TypeError, match="rotation: expected a kbit.format.Rotation"):
        H.rotate(torch.randn(2, 64), {"seed": 0, "block": 64})
    with pytest.raises((TypeError, ValueError), match="signs"):
        H.rotate(torch.randn(2, 64), r, signs=torch.ones(64))
    with pytest.raises(ValueError, match="config.cols"):
        H.rotate(torch.randn(2, 128), r, config=H.HadamardConfig(1, 32, 1))


def test_op_fake_and_signs_cache():
    r = Rotation(seed=8, block=16)
    s = H.rotation_signs(r, 64, "cpu")
    assert s.dtype == torch.int8 and s is H.rotation_signs(r, 64, "cpu")
    x = torch.randn(3, 64)
    torch.library.opcheck(torch.ops.kbit.hadamard_rotate.default, (x, s, 16),
                          test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415 (only this test needs it)
    with FakeTensorMode() as mode:
        y = torch.ops.kbit.hadamard_rotate(mode.from_tensor(x), mode.from_tensor(s), 16)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_rotate_under_torch_compile():
    r = Rotation(seed=6, block=32)
    x = torch.randn(3, 64)
    ref = H.rotate(x, r)  # the first call makes the signs: compiled code then only looks them up
    compiled = torch.compile(lambda t: H.rotate(t, r), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), ref)


def test_rotate_cpu_reference_path():
    # outside the interpreter a CPU tensor takes the reference: same numbers
    r = Rotation(seed=1, block=32)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with kbit.options.override(interpret=False):
        y = H.rotate(x, r)
    assert torch.equal(y, H.rotate_reference(x, r))


# ------------------------------------------------------------------------------------------ the format
def _rotated(shape=(6, 96), seed=5, block=32):
    g = torch.Generator().manual_seed(0)
    qw = kbit.quantize(torch.randn(*shape, generator=g), k=3)
    return dataclasses.replace(qw, rotation=Rotation(seed=seed, block=block))


def test_weight_keeps_rotation():
    qw = _rotated((2, 6, 96))
    assert qw.rotation == Rotation(seed=5, block=32)
    assert qw[1].rotation == qw.rotation and qw.to("cpu").rotation == qw.rotation
    assert "rotation=" in repr(qw) and "rotation" in qw.metadata()
    assert "rotation" not in kbit.quantize(torch.randn(4, 32), k=3).metadata()
    with pytest.raises(ValueError, match=r"shape\[-1\] \(K\): expected a multiple of the rotation block 64, got 96"):
        _rotated(block=64)
    with pytest.raises(TypeError, match="rotation: expected None or a kbit.format.Rotation"):
        dataclasses.replace(_rotated(), rotation={"seed": 1})


def test_round_trip(tmp_path):
    path = tmp_path / "w.safetensors"
    plain = kbit.quantize(torch.randn(4, 32), k=4)
    kbit.save_file({"a": _rotated(), "b": plain, "e": _rotated((3, 4, 96), seed=2**40, block=1)}, path)
    back = kbit.load_file(path)
    assert back["a"].rotation == Rotation(seed=5, block=32)
    assert back["e"].rotation == Rotation(seed=2**40, block=1)
    assert back["b"].rotation is None
    assert torch.equal(back["a"].codes, _rotated().codes)


def _meta(path):
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118


def _forge(path, edit, fix_crc=True):
    meta, tensors = _meta(path)
    weights = json.loads(meta[S.WEIGHTS_KEY])
    edit(weights["a"])
    meta[S.WEIGHTS_KEY] = json.dumps(weights)
    if fix_crc:
        meta[S.METADATA_CRC_KEY] = str(S.metadata_crc32(meta))
    raw_save(tensors, str(path), metadata=meta)


def _set(field, value):
    def edit(p):
        p["rotation"][field] = value
    return edit


@pytest.mark.parametrize("edit, match", [
    (_set("kind", "dct"), "rotation: kind: expected one of"),
    (_set("seed", -3), r"rotation: seed: expected an int in \[0, 2\*\*63\)"),
    (_set("seed", "5"), "rotation: seed"),
    (_set("block", 64), "rotation: block: expected a power of two <= 16384 dividing K=96, got 64"),
    (_set("block", 12), "rotation: block"),
    (_set("block", True), "rotation: block"),
    (_set("extra", 1), "rotation: expected the fields"),
    (lambda p: p["rotation"].pop("seed"), "rotation: expected the fields"),
    (lambda p: p.update(rotation=[5, 32]), "rotation: expected a JSON object"),
    (lambda p: p.update(rotations={}), "expected the fields"),
])
def test_schema_checks_rotation(tmp_path, edit, match):
    path = tmp_path / "w.safetensors"
    kbit.save_file({"a": _rotated()}, path)
    _forge(path, edit)
    with pytest.raises(ValueError, match=match):
        kbit.load_file(path)


def test_checksum_covers_rotation(tmp_path):
    path = tmp_path / "w.safetensors"
    kbit.save_file({"a": _rotated()}, path)
    _forge(path, _set("seed", 6), fix_crc=False)
    with pytest.raises(ValueError, match="metadata checksum mismatch"):
        kbit.load_file(path)
    kbit.save_file({"a": _rotated()}, path)
    _forge(path, lambda p: p.pop("rotation"), fix_crc=False)  # dropping it is caught too
    with pytest.raises(ValueError, match="metadata checksum mismatch"):
        kbit.load_file(path)


AOT_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kbit.kernels.hadamard import hadamard_rotate_kernel
sig = {"X": "*bf16", "Signs": "*i8", "Y": "*bf16", "M": "i32", "K": "i32", "stride_x": "i32", "stride_y": "i32",
       "scale": "fp32", "BM": "constexpr", "C": "constexpr", "LOG_B": "constexpr", "PDL": "constexpr"}
for BM, C, LOG_B, warps in ((1, 16384, 14, 16), (4, 1024, 8, 8), (2, 1024, 0, 4)):
    src = ASTSource(hadamard_rotate_kernel, sig, {"BM": BM, "C": C, "LOG_B": LOG_B, "PDL": True})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
print("compiled")
"""


def test_kernel_compiles_for_sm90():
    # the interpreter runs no compiler: lower the kernel to an sm_90 cubin (Triton's bundled ptxas, no GPU needed)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", AOT_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("K", [4096, 5120, 11008, 14336, 28672, 16384, 2880])
@pytest.mark.parametrize("M", [1, 3, 17, 1024])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_gpu(K, M, dtype):
    g = torch.Generator().manual_seed(K * M)
    r = Rotation.for_width(K, seed=K)
    x = (torch.randn(M, K, generator=g) * 3).to(dtype)
    y = H.rotate(x.cuda(), r)
    _close(y.cpu(), H.rotate_reference(x.double(), r), dtype)


@pytest.mark.gpu
def test_rotate_gpu_layer_identity_float64_reference():
    # (x R)(W R)^T on the GPU with the rotated weight in float32 equals x W^T to float32 accuracy
    K, N = 14336, 64
    g = torch.Generator().manual_seed(0)
    r = Rotation.for_width(K, seed=3)
    W = torch.randn(N, K, generator=g, dtype=torch.float64)
    x = torch.randn(17, K, generator=g, dtype=torch.float64)
    xr = H.rotate(x.float().cuda(), r).double().cpu()
    y = xr @ H.rotate_reference(W, r).T
    torch.testing.assert_close(y, x.float().double() @ W.T, rtol=0, atol=1e-3 * math.sqrt(K))


@pytest.mark.gpu
def test_rotate_cuda_graph_and_compile():
    K = 5120
    r = Rotation.for_width(K, seed=1)
    x = torch.randn(3, K, device="cuda", dtype=torch.float16)
    eager = H.rotate(x, r)  # makes the signs before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = H.rotate(x, r)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(y, H.rotate(x, r))
    assert not torch.equal(y, eager)
    compiled = torch.compile(lambda t: H.rotate(t, r, H.rotation_signs(r, K, t.device)), fullgraph=True)
    assert torch.equal(compiled(x), y)

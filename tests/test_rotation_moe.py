"""KbitMoE with a rotated gate_up stack (one rotation of H for all experts): the kernel path on ``x R`` equals the
float64 reference on the unrotated weight; the down stack refuses a rotation; the state dict carries it."""
import pytest
import torch

from kbit import options
from kbit.dispatch.moe import MoePlan
from kbit.format import Rotation
from kbit.format.reference import dequantize_reference
from kbit.nn.moe import KbitMoE
from kbit.ops.moe import moe_reference, relative_error
from kbit.ops.quantize import rotate_weight, unrotate_weight

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
GEMV, MM = MoePlan("gemv", "gemv"), MoePlan("grouped_mm", "grouped_mm")
GEMM = MoePlan("gemm", "gemm")  # the grouped tensor-core kernel (CUDA)


def _stacks(E, H, I, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device), \
        (torch.randn(E, H, I, generator=g) / I**0.5).to(device)


def _reference(m, x, logits, plan):
    """float64 on the dequantized stacks, gate_up unrotated (``W``), x as given."""
    r = m.route(logits, m.plan_for(x.shape[0], plan, x.dtype, x.device))
    gu = unrotate_weight(dequantize_reference(m.gate_up_weight(), torch.float64), m.rotation)
    return moe_reference(x, r.topk_weights, r.topk_ids, gu, dequantize_reference(m.down_weight(), torch.float64))


@pytest.mark.parametrize("dtype,plan,H", [(torch.float32, MM, 96), (torch.float16, GEMV, 64),
                                          (torch.float16, None, 80)])
def test_rotated_gate_up_matches_reference(dtype, plan, H):
    E, I, top_k, T = 6, 32, 2, 5
    gu, dn = _stacks(E, H, I, seed=H)
    m = KbitMoE.from_float(gu, dn, top_k=top_k, k=4, dtype=dtype, rotation="hadamard", seed=3).to(DEV)
    assert m.rotation == Rotation.for_width(H, 3) and m.gate_up_weight().rotation == m.rotation
    assert m.down_weight().rotation is None and f"rotation={m.rotation!r}" in repr(m)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEV)
    logits = torch.randn(T, E, generator=g).to(DEV)
    out = m(x, logits, plan=plan)
    assert out.dtype == dtype and relative_error(out, _reference(m, x, logits, plan)) < 1e-2
    r = m.route(logits, m.plan_for(T, plan, dtype, x.device))
    exact = moe_reference(x, r.topk_weights, r.topk_ids, gu.double().to(DEV), dn.double().to(DEV))
    plain = KbitMoE.from_float(gu, dn, top_k=top_k, k=4, dtype=dtype).to(DEV)(x, logits, plan=plan)
    assert relative_error(out, exact) < 0.2 and relative_error(plain, exact) < 0.2  # 4-bit error, rotated or not


def test_rotated_moe_cpu_reference_path():
    E, H, I, top_k = 4, 64, 32, 2
    m = KbitMoE.from_float(*_stacks(E, H, I), top_k=top_k, k=4, dtype=torch.float32, rotation="hadamard")
    x, logits = torch.randn(3, H), torch.randn(3, E)
    with torch.no_grad(), options.override(interpret=False):
        out = m(x, logits)
    assert relative_error(out, _reference(m, x, logits, None)) < 1e-6


def test_rotated_moe_state_dict_and_errors():
    E, H, I = 4, 64, 32
    gu, dn = _stacks(E, H, I)
    m = KbitMoE.from_float(gu, dn, top_k=2, k=3, dtype=torch.float32, rotation="hadamard", seed=2)
    fresh = KbitMoE(E, H, I, 2, k=3, dtype=torch.float32, rotation=Rotation(seed=2, block=64))
    fresh.load_state_dict(m.state_dict())
    x, logits = torch.randn(3, H), torch.randn(3, E)
    assert torch.equal(fresh(x, logits, plan=MM), m(x, logits, plan=MM))
    with pytest.raises(ValueError, match="rotation="):
        KbitMoE(E, H, I, 2, k=3, dtype=torch.float32).load_state_dict(m.state_dict())
    with pytest.raises(ValueError, match="down.rotation: expected None"):
        KbitMoE.from_weights(m.gate_up_weight(), _rotated_down(dn), top_k=2)
    with pytest.raises(ValueError, match="hidden_size: expected a multiple of the rotation block 128"):
        KbitMoE(E, H, I, 2, rotation=Rotation(seed=0, block=128))


def _rotated_down(dn):
    from kbit import quantize
    return quantize(dn, k=3, rotation="hadamard")


def test_rotate_weight_of_a_stack_is_per_matrix():
    gu, _ = _stacks(3, 64, 8)
    r = Rotation.for_width(64, 1)
    torch.testing.assert_close(rotate_weight(gu.double(), r), gu.double() @ r.matrix(64), rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 64, 300])
@pytest.mark.parametrize("plan", [None, GEMV, MM, GEMM], ids=["auto", "gemv", "grouped_mm", "gemm"])
def test_gpu_rotated_moe_real_size(T, plan):
    """Qwen3-30B-A3B-shaped (E = 128, H = 2048, I = 768, top 8), bf16, every plan; a CUDA graph of the GEMV and
    grouped tensor-core plans replays it (the rotation's signs were made by the eager call)."""
    E, H, I, top_k = 128, 2048, 768, 8
    gu, dn = _stacks(E, H, I, seed=0, device="cuda")
    m = KbitMoE.from_float(gu.bfloat16(), dn.bfloat16(), top_k=top_k, k=4, dtype=torch.bfloat16,
                           rotation="hadamard", seed=1)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(T, E, device="cuda", generator=g).bfloat16()
    out = m(x, logits, plan=plan)
    assert relative_error(out, _reference(m, x, logits, plan)) < 2e-2
    if plan not in (GEMV, GEMM):  # the plans tests/test_moe.py captures at every T
        return
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replay = m(static, logits, plan=plan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replay, m(x, logits, plan=plan))


def test_rotated_from_hf_block():
    """A Hugging Face Qwen3-MoE block quantized rotated: its router and float experts' output within the 5-bit error,
    as close as the unrotated layer's."""
    tr = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = tr.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    m = KbitMoE.from_hf(block, k=5, rotation="hadamard", seed=6)
    assert m.rotation == Rotation.for_width(64, 6)
    x = torch.randn(7, 64)
    with torch.no_grad():
        ref = block(x[None])
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
        err = relative_error(m(x, plan=MM), ref.double())
        plain = relative_error(KbitMoE.from_hf(block, k=5)(x, plan=MM), ref.double())
    assert err < 0.08 and plain < 0.08, (err, plain)

"""The fast decode step (kbit.hf.fast_decode) on rotated layers: x R made by the norm / SiLU * up kernels, one
standalone rotation a layer (o_proj), against the same model's unfused math (transformers' forward, every layer
rotating its own input) and against the unrotated model (CPU: the interpreter; GPU: CUDA graphs)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from kbit.format import Rotation  # noqa: E402
from kbit.hf import fast_decode, quantize_model  # noqa: E402
from kbit.hf.decode import StaticDecoder  # noqa: E402
from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops.hadamard import rotate, rotate_reference  # noqa: E402

PROMPT = [[1, 5, 9, 33, 2], [7, 3, 3, 60, 11]]
#: the seed of each projection's rotation: q/k/v share one, gate/up share one
SEEDS = {"self_attn.q_proj": 1, "self_attn.k_proj": 1, "self_attn.v_proj": 1, "self_attn.o_proj": 2,
         "mlp.gate_proj": 3, "mlp.up_proj": 3, "mlp.down_proj": 4}


def llama(vocab=96, hidden=64, inter=128):
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


class RotatedLinear(nn.Module):
    """A float layer quantized under nothing but a rotation: holds ``W R``; ``forward(x) = (x R)(W R)^T`` (the
    unfused math), ``forward_rotated(x R)`` the product alone (the two names of a rotated KbitLinear)."""

    def __init__(self, lin: nn.Linear, rotation: Rotation):
        super().__init__()
        self.rotation, self.in_features, self.out_features = rotation, lin.in_features, lin.out_features
        w = rotate_reference(lin.weight.detach().double(), rotation).to(lin.weight.dtype)
        self.register_buffer("weight_rot", w)
        self.bias = lin.bias
        self.calls = 0  # forward calls (the fast step should make none)

    def forward_rotated(self, x):
        return F.linear(x, self.weight_rot, self.bias)

    def forward(self, x):
        self.calls += 1
        return self.forward_rotated(rotate(x, self.rotation))


def rotate_float_model(model, seeds=SEEDS, head_seed=None):
    """A copy of ``model`` with every projection in ``seeds`` (and lm_head with ``head_seed``) a RotatedLinear."""
    model = copy.deepcopy(model)
    for layer in model.model.layers:
        for name, seed in seeds.items():
            lin = layer.get_submodule(name)
            layer.set_submodule(name, RotatedLinear(lin, Rotation.for_width(lin.in_features, seed)))
    if head_seed is not None:
        model.lm_head = RotatedLinear(model.lm_head, Rotation.for_width(model.lm_head.in_features, head_seed))
    return model


def rotated_kbit_llama(k=4, device="cpu", dtype=torch.float32):
    """A k-bit llama quantized under rotations with joint q/k/v and gate/up groups (one GEMV each in the fast
    step). Before KbitLinear carries ``rotation`` / ``forward_rotated`` itself, a stand-in of those two names:
    the weights are rotated in float before quantizing and the instances get the attributes."""
    if hasattr(KbitLinear, "forward_rotated"):
        return quantize_model(llama().to(device, dtype), k=k, progress=False, rotation="hadamard")
    model = llama().to(device, dtype)
    for layer in model.model.layers:
        for name, seed in SEEDS.items():
            lin = layer.get_submodule(name)
            with torch.no_grad():
                lin.weight.copy_(rotate_reference(lin.weight.double(), Rotation.for_width(lin.in_features, seed)))
    quantize_model(model, k=k, progress=False)
    for layer in model.model.layers:
        for name, seed in SEEDS.items():
            m = layer.get_submodule(name)
            rot = Rotation.for_width(m.in_features, seed)
            m.rotation, m.forward_rotated = rot, m.forward  # the layer as it is takes x R
            m.forward = lambda x, m=m, rot=rot: m.forward_rotated(rotate(x, rot))
    return model


def dynamic_greedy(model, ids, n):
    """transformers' forward and dynamic cache, argmax: tokens [B, n], logits [n, B, V]."""
    toks, logits = [], []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for _ in range(n):
            lg = out.logits[:, -1].float()
            toks.append(lg.argmax(-1))
            logits.append(lg)
            out = model(toks[-1].view(-1, 1), past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(toks, 1), torch.stack(logits)


def fast_greedy(model, ids, n, graph=False):
    dec = StaticDecoder(model, ids.shape[0], ids.shape[1] + n, graph=graph, fast=True)
    assert dec._fast is not None
    toks, logits = [dec.prefill(ids).clone()], [dec.logits.clone()]
    for _ in range(n - 1):
        toks.append(dec.step().clone())
        logits.append(dec.logits.clone())
    return torch.stack(toks, 1), torch.stack(logits), dec


def _count_rotates(monkeypatch):
    calls = []

    def counting(x, rotation, signs=None):
        calls.append(rotation)
        return rotate(x, rotation, signs)

    monkeypatch.setattr(fast_decode, "rotate", counting)
    return calls


@pytest.mark.parametrize("variant", ["shared", "mixed", "head", "down_only"])
def test_rotated_step_equals_unrotated_math(variant, monkeypatch):
    """The fast step of a model whose layers hold ``W R`` equals the unrotated model's math (float32)."""
    plain = llama()
    seeds = dict(SEEDS)
    if variant == "mixed":  # k_proj under another rotation: q/k/v run their own forward, which rotates
        seeds["self_attn.k_proj"] = 9
    if variant == "down_only":
        seeds = {"mlp.down_proj": 4}
    model = rotate_float_model(plain, seeds, head_seed=5 if variant == "head" else None)
    ids = torch.tensor(PROMPT)
    ref_t, ref_l = dynamic_greedy(plain, ids, 5)
    calls = _count_rotates(monkeypatch)
    t, lg, dec = fast_greedy(model, ids, 5)
    assert torch.equal(t, ref_t)
    torch.testing.assert_close(lg, ref_l, atol=1e-4, rtol=1e-3)
    f = dec._fast
    assert (f.rot_qkv[0] is None) == (variant in ("mixed", "down_only"))
    assert (f.rot_head is not None) == (variant == "head")
    # decode steps: the only standalone rotation is o_proj's, once a layer a step
    steps = 4
    assert len(calls) == (0 if variant == "down_only" else steps * len(f.layers))
    # transformers' prefill calls each layer once; the steps call forward_rotated, except where q/k/v differ
    own = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, RotatedLinear)]
    mixed = [m for m in own if variant == "mixed" and m.rotation.seed in (1, 9)]
    assert all(m.calls == 1 + steps * (m in mixed) for m in own)


def test_rotated_kbit_step_matches_its_forward(monkeypatch):
    """k = 4 layers under rotations, q/k/v and gate/up fused into one GEMV each: the fast step (the norm and
    SiLU * up kernels rotate) equals the model's own forward (each layer rotates its input)."""
    model = rotated_kbit_llama()
    ids = torch.tensor(PROMPT)
    ref_t, ref_l = dynamic_greedy(model, ids, 5)
    t, lg, dec = fast_greedy(model, ids, 5)
    assert all(f is not None for f in dec._fast.qkv + dec._fast.gate_up)
    assert all(r is not None for r in dec._fast.rot_qkv + dec._fast.rot_gate_up + dec._fast.rot_down)
    assert torch.equal(t, ref_t)
    torch.testing.assert_close(lg, ref_l, atol=1e-4, rtol=1e-3)


def test_fuse_group_needs_one_rotation():
    model = rotated_kbit_llama()
    att = model.model.layers[0].self_attn
    parts = [att.q_proj, att.k_proj, att.v_proj]
    assert fast_decode.shared_rotation(parts, "cpu")[0] == att.q_proj.rotation
    assert fast_decode.shared_rotation([nn.Linear(4, 4)], "cpu") is None
    other = copy.copy(att.k_proj)  # a shallow copy under another rotation
    other.__dict__["rotation"] = Rotation.for_width(64, 7)
    assert fast_decode.shared_rotation([att.q_proj, other], "cpu") is None
    assert fast_decode.fuse_group([att.q_proj, other, att.v_proj]) is None


# ------------------------------------------------------------------------------------------ GPU
def residual_kbit_llama(k=4, device="cpu", dtype=torch.float32):
    """``quantize_model(rotation="residual")``: the residual stream rotated offline, only down_proj online."""
    model = llama(vocab=256, hidden=256, inter=1536)
    return quantize_model(model, k=k, progress=False, rotation="residual").to(device, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["float", "kbit", "residual"])
def test_gpu_rotated_step(variant):
    """bf16 on CUDA: the fast step in CUDA graphs equals its eager run, and the rotated model's fast step follows
    the unrotated reference (float: the unrotated model's fast step; kbit: the model's own forward)."""
    if variant == "float":
        plain = llama(vocab=256, hidden=256, inter=1536).to("cuda", torch.bfloat16)  # 1536: block 512, 3 blocks
        model = rotate_float_model(plain, head_seed=5)
        _, ref_l, _ = fast_greedy(plain, torch.tensor(PROMPT, device="cuda"), 8, graph=True)
    else:
        build = rotated_kbit_llama if variant == "kbit" else residual_kbit_llama
        model = build(device="cuda", dtype=torch.bfloat16)
        _, ref_l = dynamic_greedy(model, torch.tensor(PROMPT, device="cuda"), 8)
    ids = torch.tensor(PROMPT, device="cuda")
    eager_t, eager_l, _ = fast_greedy(model, ids, 8)
    graph_t, graph_l, _ = fast_greedy(model, ids, 8, graph=True)
    assert torch.equal(graph_t, eager_t)
    torch.testing.assert_close(graph_l, eager_l, atol=1e-2, rtol=1e-2)
    rel = (graph_l[:3] - ref_l[:3]).norm() / ref_l[:3].norm()
    assert rel < 2e-2, rel


@pytest.mark.parametrize("silu", [False, True])
def test_add_rms_norm_linear_rotated_layer(silu):
    """kbit.dispatch.prologue: a layer with a rotation gets rms_norm(r) R from the norm kernel (kernel 3's
    prologue does not rotate) and runs forward_rotated; the same as the unfused steps with the layer's forward."""
    from kbit.dispatch.prologue import add_rms_norm_linear  # noqa: PLC0415 (only this test needs it)
    from kbit.ops.glue import rms_norm_reference, silu_mul_reference  # noqa: PLC0415

    torch.manual_seed(3)
    lin = RotatedLinear(nn.Linear(96, 64), Rotation.for_width(96, 3))  # block 32: three blocks
    x, res, w = torch.randn(3, 96), torch.randn(3, 96), 1 + 0.1 * torch.randn(96)
    z, r = add_rms_norm_linear(x, res, w, 1e-5, lin, silu_mul=silu)
    want = lin(rms_norm_reference(x, w, 1e-5, res)[0])
    if silu:
        want = silu_mul_reference(want[:, :32], want[:, 32:])
    assert torch.equal(r, res + x) and lin.calls == 1  # the reference's call only
    torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-5)

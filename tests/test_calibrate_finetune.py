"""kbit.calibrate.finetune: the differentiable view of a KbitWeight, its export, the sparse KL, and end-to-end
tuning lowering a quantized model's divergence from the unquantized one (codes fixed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import kbit
from kbit.calibrate import (
    FinetuneConfig,
    Hessian,
    TunableWeight,
    decoder_linear_names,
    finetune,
    gptq_quantize,
    sparse_kl,
    teacher_targets,
)
from kbit.format.pack import unpack
from kbit.format.reference import dequantize_reference
from kbit.ops.quantize import unrotate_weight


def _float_weight(qw) -> torch.Tensor:
    """What a layer holding ``qw`` multiplies its unrotated input by (float64 reference)."""
    w = dequantize_reference(qw).double()
    return unrotate_weight(w, qw.rotation) if qw.rotation is not None else w


def _rounded(N: int, K: int, k: int, rotation, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g)
    X = torch.randn(256, K, generator=g)
    return gptq_quantize(W, X.T @ X, k=k, rotation=rotation)


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("K", [96, 72, 40])
@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_tunable_weight_is_the_dequantized_weight_and_exports_unchanged(k, K, rotation):
    qw = _rounded(24, K, k, rotation)
    t = TunableWeight(qw)
    torch.testing.assert_close(t().double(), _float_weight(qw), rtol=0, atol=1e-5)
    back = t.to_weight()
    assert back.shape == qw.shape and back.k == k and back.rotation == qw.rotation
    torch.testing.assert_close(_float_weight(back), _float_weight(qw), rtol=1e-6, atol=1e-6)
    assert torch.equal(back.scales, qw.scales)


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_gradients_match_autograd_through_plain_indexing(k, rotation):
    """The codebook's gradient comes from a histogram of the codes (not the generic index backward); the block
    exponents' and the codebook's gradients equal those of the same weight built with plain indexing."""
    qw = _rounded(40, 72, k, rotation, seed=3)
    t = TunableWeight(qw)
    g = torch.randn(40, 72, generator=torch.Generator().manual_seed(4))
    (t() * g).sum().backward()
    ours = t.codebook.grad.clone(), t.q.grad.clone()
    t.codebook.grad, t.q.grad = None, None
    values = t.codebook[t.current_codes()]
    W = (values * t.scales()[..., None]).reshape(40, -1)[:, :72]
    if t.rotation is not None:
        W = (W.reshape(40, -1, t.rotation.block) @ t._h.T).reshape(40, 72) * t._signs
    (W * g).sum().backward()
    torch.testing.assert_close(ours[0], t.codebook.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], t.q.grad, rtol=1e-5, atol=1e-5)


def test_export_of_a_moved_codebook_and_scales_keeps_the_weight():
    """An unsorted codebook beyond [-1, 1] and exponents off the grid export to a valid weight that dequantizes
    to what the forward pass computed (codes renumbered, the tensor scale absorbing the codebook's size)."""
    qw = _rounded(16, 64, 2, "hadamard")
    t = TunableWeight(qw)
    with torch.no_grad():
        t.codebook.copy_(torch.tensor([0.3, -1.7, 0.9, -0.2]))
        t.q.add_(torch.linspace(-3.3, 2.6, t.q.numel()).reshape(t.q.shape))
    expected = t().double()
    out = t.to_weight()
    out.check_values()
    assert out.codebook.tolist() == sorted(out.codebook.tolist()) and float(out.codebook.abs().max()) == 1.0
    torch.testing.assert_close(_float_weight(out), expected, rtol=1e-5, atol=1e-6)
    codes = unpack(out.codes, 2, out.padded_k)
    assert not torch.equal(codes, unpack(qw.codes, 2, qw.padded_k))  # renumbered with the codebook's order


def test_zero_blocks_stay_zero():
    W = torch.randn(8, 64)
    W[:, :32] = 0
    qw = kbit.quantize(W, k=2)
    t = TunableWeight(qw)
    with torch.no_grad():
        t.q.add_(3.0)
    assert bool((t()[:, :32] == 0).all())
    assert bool((t.to_weight().scales[:, 0] == 255).all())


def test_sparse_kl_is_exact_with_the_whole_vocabulary_and_a_lower_bound_otherwise():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 7, 40, generator=g, dtype=torch.float64)
    logits = torch.randn(3, 7, 40, generator=g, dtype=torch.float64)
    lp, lq = ref.log_softmax(-1), logits.log_softmax(-1)
    full = float((lp.exp() * (lp - lq)).sum(-1).mean())
    v, i = lp.topk(40, -1)
    assert float(sparse_kl(logits, v, i)) == pytest.approx(full, rel=1e-5)
    v, i = lp.topk(5, -1)
    assert 0 <= float(sparse_kl(logits, v, i)) <= full + 1e-6


class _Norm(nn.Module):
    """An RMSNorm with a gain (the type name marks it for tuning)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Layer(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = _Norm(d)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d)

    def forward(self, h):
        return h + self.down(torch.nn.functional.silu(self.up(self.norm(h))))


class _TinyLM(nn.Module):
    """Embedding, a ModuleList of pre-norm MLP layers, a final norm and head; returns ``.logits``."""

    def __init__(self, vocab: int = 64, d: int = 64, hidden: int = 96, n: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Layer(d, hidden) for _ in range(n))
        self.norm = _Norm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, use_cache=False):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return SimpleNamespace(logits=self.head(self.norm(h)))


def _kl(model, batches, teacher) -> float:
    with torch.no_grad():
        return sum(float(sparse_kl(model(b).logits[:, :-1], lp, i))
                   for b, lp, i in zip(batches, teacher.logp, teacher.index, strict=True)) / len(batches)


def _install(model, weights):
    for n, qw in weights.items():
        model.get_submodule(n).weight.data = _float_weight(qw).float()


def test_finetune_lowers_kl_against_plain_gptq_and_restores_the_modules():
    torch.manual_seed(0)
    model = _TinyLM().eval()
    batches = [torch.randint(0, 64, (2, 24)) for _ in range(4)]
    held_out = [torch.randint(0, 64, (2, 24)) for _ in range(2)]
    names = decoder_linear_names(model)
    assert names == ["layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down"]
    teacher = teacher_targets(model, batches, top=64)
    held_teacher = teacher_targets(model, held_out, top=64)
    hessians = {n: Hessian(model.get_submodule(n).in_features) for n in names}
    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda _m, a, h=hessians[n]: h.add(a[0]))
             for n in names]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    original = {n: model.get_submodule(n) for n in names}
    qws = {n: gptq_quantize(original[n].weight, hessians[n].H, k=2, rotation="hadamard") for n in names}
    tuned = finetune(model, qws, batches, teacher, FinetuneConfig(steps=60, lr_q=0.1, lr_codebook=3e-3))
    assert all(model.get_submodule(n) is original[n] for n in names)
    assert all(p.requires_grad for p in model.parameters())  # the flags as they were
    gains = [p.detach().clone() for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert any(not torch.equal(g, torch.ones_like(g)) for g in gains)  # the norm gains moved
    for n in names:
        assert torch.equal(model.get_submodule(n).weight, original[n].weight)
    tuned_model = _TinyLM().eval()
    tuned_model.load_state_dict(model.state_dict())
    _install(tuned_model, tuned)
    plain = _TinyLM().eval()
    plain.load_state_dict(model.state_dict())
    for n, p in plain.named_parameters():  # plain GPTQ keeps the untuned gains
        if n.endswith("norm.weight"):
            p.data.fill_(1.0)
    _install(plain, qws)
    before, after = _kl(plain, batches, teacher), _kl(tuned_model, batches, teacher)
    assert after < 0.7 * before, (before, after)
    assert _kl(tuned_model, held_out, held_teacher) < _kl(plain, held_out, held_teacher)
    for n in names:
        assert torch.equal(unpack(tuned[n].codes, 2, tuned[n].padded_k).sort().values.unique(),
                           unpack(qws[n].codes, 2, qws[n].padded_k).sort().values.unique())
        tuned[n].check_values()


def test_finetune_without_norms_and_zero_steps():
    torch.manual_seed(1)
    model = _TinyLM(n=1).eval()
    batches = [torch.randint(0, 64, (1, 12))]
    teacher = teacher_targets(model, batches, top=8)
    name = "layers.0.up"
    qw = kbit.quantize(model.get_submodule(name).weight.detach(), k=2)
    before = {n: p.clone() for n, p in model.named_parameters()}
    out = finetune(model, {name: qw}, batches, teacher, FinetuneConfig(steps=3, norms=False))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.requires_grad for p in model.parameters())  # flags restored
    same = finetune(model, {name: qw}, batches, teacher, FinetuneConfig(steps=0))
    torch.testing.assert_close(_float_weight(same[name]), _float_weight(qw))
    assert not torch.equal(_float_weight(out[name]), _float_weight(qw))


def test_argument_errors():
    model = _TinyLM(n=1).eval()
    batches = [torch.randint(0, 64, (1, 8))]
    teacher = teacher_targets(model, batches, top=4)
    qw = kbit.quantize(model.layers[0].up.weight.detach(), k=2)
    with pytest.raises(TypeError, match="qw: expected a kbit.format.KbitWeight"):
        TunableWeight(torch.zeros(4, 32))
    with pytest.raises(ValueError, match="qw: expected a 2-D weight with log8 scales"):
        TunableWeight(kbit.quantize(torch.randn(4, 32), k=2, scale_format="fp16"))
    with pytest.raises(ValueError, match="top: expected"):
        teacher_targets(model, batches, top=0)
    with pytest.raises(ValueError, match="batches: expected at least one batch"):
        teacher_targets(model, [], top=4)
    with pytest.raises(TypeError, match="config: expected a FinetuneConfig"):
        finetune(model, {"layers.0.up": qw}, batches, teacher, config={"steps": 3})
    with pytest.raises(ValueError, match="steps: expected"):
        FinetuneConfig(steps=-1)
    with pytest.raises(ValueError, match="lr_q: expected a finite float >= 0, got -0.1"):
        FinetuneConfig(lr_q=-0.1)
    with pytest.raises(ValueError, match=r"weights\[\('layers.0.up',\)\]: expected 96 rows"):
        finetune(model, {("layers.0.up",): kbit.quantize(torch.randn(95, 64), k=2)}, batches, teacher)
    with pytest.raises(TypeError, match="weights: expected names of modules with out_features"):
        finetune(model, {"layers.0.norm": qw}, batches, teacher)
    with pytest.raises(ValueError, match="batches: expected the 1 batches"):
        finetune(model, {"layers.0.up": qw}, batches * 2, teacher)
    with pytest.raises(ValueError, match="weights: expected at least one"):
        finetune(model, {}, batches, teacher)


def test_free_codes_export_what_the_forward_pass_computes():
    """With free codes the latent values round to the nearest level each pass; moved across a midpoint, a code
    changes, and the export dequantizes to the forward pass's weight."""
    qw = _rounded(16, 64, 2, "hadamard")
    t = TunableWeight(qw, free_codes=True)
    torch.testing.assert_close(t().double(), _float_weight(qw), rtol=0, atol=1e-5)
    with torch.no_grad():
        t.latent.add_(torch.randn(t.latent.shape, generator=torch.Generator().manual_seed(3)) * 0.4)
    expected = t().double()
    out = t.to_weight()
    torch.testing.assert_close(_float_weight(out), expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(unpack(out.codes, 2, out.padded_k), unpack(qw.codes, 2, qw.padded_k))


def test_finetune_with_free_codes_lowers_kl():
    torch.manual_seed(2)
    model = _TinyLM(n=1).eval()
    batches = [torch.randint(0, 64, (2, 16)) for _ in range(2)]
    teacher = teacher_targets(model, batches, top=64)
    names = decoder_linear_names(model)
    qws = {n: kbit.quantize(model.get_submodule(n).weight.detach(), k=2) for n in names}
    tuned = finetune(model, qws, batches, teacher, FinetuneConfig(steps=40, lr_codes=0.02, norms=False))
    plain = _TinyLM(n=1).eval()
    plain.load_state_dict(model.state_dict())
    _install(plain, qws)
    before = _kl(plain, batches, teacher)
    _install(plain, tuned)
    assert _kl(plain, batches, teacher) < 0.7 * before


def test_joint_weight_of_two_modules_is_tuned_as_one():
    """A tuple of names is one weight (one codebook) whose rows feed those modules in order (q/k/v, gate/up)."""
    torch.manual_seed(4)
    model = _TinyLM(n=1).eval()
    model.layers[0].gate = nn.Linear(64, 96, bias=False)
    model.layers[0].forward = lambda h, m=model.layers[0]: h + m.down(
        torch.nn.functional.silu(m.gate(m.norm(h))) * m.up(m.norm(h)))
    batches = [torch.randint(0, 64, (2, 16)) for _ in range(2)]
    teacher = teacher_targets(model, batches, top=64)
    key = ("layers.0.gate", "layers.0.up")
    joint = kbit.quantize(torch.cat([model.layers[0].gate.weight, model.layers[0].up.weight]).detach(), k=2,
                          rotation="hadamard")
    same = finetune(model, {key: joint}, batches, teacher, FinetuneConfig(steps=0))
    torch.testing.assert_close(_float_weight(same[key]), _float_weight(joint))
    plain = _TinyLM(n=1).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.layers[0].gate = nn.Linear(64, 96, bias=False)
    plain.layers[0].forward = lambda h, m=plain.layers[0]: h + m.down(
        torch.nn.functional.silu(m.gate(m.norm(h))) * m.up(m.norm(h)))

    def install_joint(qw):
        W = _float_weight(qw).float()
        plain.layers[0].gate.weight.data, plain.layers[0].up.weight.data = W[:96].clone(), W[96:].clone()

    install_joint(joint)
    before = _kl(plain, batches, teacher)
    tuned = finetune(model, {key: joint}, batches, teacher, FinetuneConfig(steps=30, lr_q=0.1, norms=False))
    assert tuned[key].shape == (192, 64) and tuned[key].rotation == joint.rotation
    install_joint(tuned[key])
    assert _kl(plain, batches, teacher) < before


def test_half_precision_gains_are_tuned_through_float32_copies():
    """lr_norm 1e-3 on bfloat16 gains: each step alone would round back to 1.0; the float32 copies accumulate
    the steps, and the gains stay bfloat16 parameters."""
    torch.manual_seed(4)
    model = _TinyLM(n=1).eval().to(torch.bfloat16)
    batches = [torch.randint(0, 64, (1, 12)) for _ in range(2)]
    teacher = teacher_targets(model, batches, top=16)
    name = "layers.0.up"
    qw = kbit.quantize(model.get_submodule(name).weight.detach().float(), k=2)
    finetune(model, {name: qw}, batches, teacher, FinetuneConfig(steps=4, lr_norm=1e-3))
    gains = model.layers[0].norm.weight
    assert gains.dtype == torch.bfloat16 and isinstance(gains, nn.Parameter)
    assert not torch.equal(gains, torch.ones_like(gains))

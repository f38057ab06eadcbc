"""kbit.calibrate.residual.rotate_residual: the rotated float model computes the same logits (float64 to ~1e-10,
float32 to 1e-4) for a tiny random model of every supported family, the rotated weights are flatter, a second call
and unsupported architectures are refused before anything changes, and save/from_pretrained round trips."""

import types

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from kbit.calibrate.residual import MARK, rotate_residual  # noqa: E402
from test_hf_quantizer import FAMILIES, PROMPT, SMALL  # noqa: E402  (the tiny configs of every family)

CASES = dict(FAMILIES, **{"llama+bias": dict(SMALL, attention_bias=True, mlp_bias=True)})


def tiny(case: str, dtype=torch.float64, seed: int = 0):
    """A tiny random model of ``case`` with random norm weights (the sandwich post norms of Gemma3 kept at one
    constant) and random biases, so folding and the bias rotations are exercised."""
    model_type = case.split("+")[0]
    config = transformers.AutoConfig.for_model(model_type, **CASES[case])
    torch.manual_seed(seed)
    # the grouped-mm experts path has no float64 kernel on the CPU; "eager" runs the same math per expert
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval().to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and ".post_" not in name:
                p.normal_(0.0 if model_type == "gemma3_text" else 1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


def exact_norms(model) -> None:
    """Make every RMSNorm compute in x's dtype: transformers' norms round to float32 inside, which would cap a
    float64 comparison at ~1e-7 whatever the rotation does."""
    offset = 1.0 if model.config.model_type == "gemma3_text" else 0.0

    def forward(self, x):
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + self.weight)

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(forward, m)


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(PROMPT).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_function_float64(case):
    model = tiny(case)
    exact_norms(model)
    want = logits(model)
    report = rotate_residual(model, seed=3)
    got = logits(model)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert report.model_type == case.split("+")[0] and report.seed == 3
    assert getattr(model.config, MARK)["seed"] == 3
    n = model.config.num_hidden_layers
    assert report.folded_norms == 2 * n + 1 and len(report.online_inputs) == n
    assert all("down" in name for name in report.online_inputs)
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight"} <= set(report.rotated)
    for layer in model.model.layers:  # every folded norm is the identity now
        for norm in (layer.input_layernorm, getattr(layer, "pre_feedforward_layernorm", None)
                     or layer.post_attention_layernorm):
            assert torch.all(norm.weight == (0.0 if case == "gemma3_text" else 1.0))


@pytest.mark.parametrize("case", ["qwen2", "qwen3_moe", "phi3", "gemma3_text"])
def test_orthogonal_kind_same_function(case):
    model = tiny(case)
    exact_norms(model)
    want = logits(model)
    report = rotate_residual(model, kind="orthogonal")
    torch.testing.assert_close(logits(model), want, rtol=1e-10, atol=1e-10)
    assert report.kind == "orthogonal" and report.block == model.config.hidden_size
    assert getattr(model.config, MARK)["kind"] == "orthogonal"
    with pytest.raises(ValueError, match="kind"):
        rotate_residual(tiny(case), kind="givens")


@pytest.mark.parametrize("case", ["llama", "qwen3_moe", "phi3", "gemma3_text"])
def test_same_function_float32(case):
    model = tiny(case, torch.float32)
    want = logits(model)
    rotate_residual(model)
    torch.testing.assert_close(logits(model), want, rtol=1e-4, atol=1e-4)


def test_rotated_weights_are_flatter():
    model = tiny("mistral")
    q = model.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        q[:, 5] *= 40.0  # one outlier input channel, as trained LLMs have
    before = q.detach().clone()
    report = rotate_residual(model)
    after = model.model.layers[0].self_attn.q_proj.weight.detach()

    def ratio(w):
        return float((w.abs().amax(-1) / w.pow(2).mean(-1).sqrt()).mean())

    def kurtosis(w):
        z = w - w.mean(-1, keepdim=True)
        return float((z.pow(4).mean(-1) / z.pow(2).mean(-1).pow(2)).mean())

    assert ratio(after) < 0.5 * ratio(before)
    assert kurtosis(after) < 0.25 * kurtosis(before)
    assert report.incoherence_after < report.incoherence_before


def test_tied_head_untied_only_when_needed():
    model = tiny("llama")  # tied, random final norm: the head becomes E diag(g) R, the embedding E R
    report = rotate_residual(model)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert not model.config.tie_word_embeddings
    assert report.untied_bytes == model.lm_head.weight.numel() * 8
    model = tiny("llama")
    with torch.no_grad():
        model.model.norm.weight.fill_(1.0)  # all ones: E R serves both
    assert rotate_residual(model).untied_bytes == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.tie_word_embeddings


def test_second_call_refuses():
    model = tiny("qwen3")
    rotate_residual(model)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match="rotated already"):
        rotate_residual(model)
    assert all(torch.equal(t, state[n]) for n, t in model.state_dict().items())


def _unsupported(model, what: str):
    if what == "gemma3 post norm":
        with torch.no_grad():
            model.model.layers[1].post_feedforward_layernorm.weight.normal_()
    elif what == "layernorm":
        model.model.layers[1].post_attention_layernorm = nn.LayerNorm(model.config.hidden_size)
    elif what == "quantized":
        model.model.layers[1].mlp.down_proj = nn.Identity()
    elif what == "parallel":
        model.config.parallel_attn = True


@pytest.mark.parametrize("case, what, match", [
    ("gemma3_text", "gemma3 post norm", r"layers\.1\.post_feedforward_layernorm\.weight: expected one constant"),
    ("mistral", "layernorm", r"post_attention_layernorm: expected an RMSNorm"),
    ("qwen2", "quantized", r"mlp\.down_proj: expected a float torch\.nn\.Linear"),
    ("llama", "parallel", r"config\.parallel_attn: expected False"),
])
def test_unsupported_refused_before_any_change(case, what, match):
    model = tiny(case)
    _unsupported(model, what)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        rotate_residual(model)
    assert all(torch.equal(t, state[n]) for n, t in model.state_dict().items())
    assert not hasattr(model.config, MARK)


def test_unknown_family_and_bad_seed():
    config = transformers.AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"model: expected a decoder of one of the families .*got 'gpt2'"):
        rotate_residual(model)
    with pytest.raises(ValueError, match="seed"):
        rotate_residual(tiny("llama"), seed=-1)


@pytest.mark.parametrize("case", ["llama", "mixtral"])
def test_save_pretrained_round_trip(case, tmp_path):
    model = tiny(case, torch.float32)
    rotate_residual(model, seed=1)
    want = logits(model)
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert getattr(back.config, MARK) == getattr(model.config, MARK)
    assert torch.equal(logits(back), want)
    with pytest.raises(ValueError, match="rotated already"):
        rotate_residual(back)


def test_rotated_model_quantizes_like_any_model():
    from kbit.hf import quantize_model
    from kbit.nn import KbitLinear

    model = tiny("qwen3", torch.float32)
    rotate_residual(model)
    float_logits = logits(model)
    quantize_model(model, k=5, progress=False)
    assert isinstance(model.model.layers[0].self_attn.o_proj, KbitLinear)
    got = logits(model)
    assert torch.isfinite(got).all()
    assert float((got - float_logits).norm() / float_logits.norm()) < 0.1  # 5-bit rounding (~0.05 here either way)

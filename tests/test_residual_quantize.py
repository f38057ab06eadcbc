"""``quantize_model(rotation="residual")``: the residual stream rotated offline, then the weights quantized as they
are except down_proj (rotated online); the quantized model follows the float model as closely as the unrotated one
does, saves and loads back bit-exact, and refuses what the residual rotation cannot do before changing anything."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kbit.calibrate.residual import MARK, residual_unsupported  # noqa: E402
from kbit.hf import load_quantized, quantize_model, save_quantized  # noqa: E402
from kbit.hf.quantize_model import auto_rotation, plan  # noqa: E402
from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops.quantize import KbitQualityWarning  # noqa: E402
from test_hf_quantizer import PROMPT  # noqa: E402
from test_residual_rotation import tiny  # noqa: E402  (random norm weights and biases: folding is exercised)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(PROMPT).logits


@pytest.mark.parametrize("case", ["llama", "qwen3", "mistral"])
def test_residual_rotation_quantized(case, tmp_path):
    ref = logits(tiny(case, torch.float32))
    plain = quantize_model(tiny(case, torch.float32), k=5, progress=False)
    with pytest.warns(KbitQualityWarning, match="calibration="):  # round-to-nearest after folding: worse
        model = quantize_model(tiny(case, torch.float32), k=5, progress=False, rotation="residual", seed=3)
    assert getattr(model.config, MARK)["seed"] == 3
    lins = {n: m for n, m in model.named_modules() if isinstance(m, KbitLinear)}
    assert lins and all((m.rotation is not None) == n.endswith("down_proj") for n, m in lins.items())
    got = logits(model)
    # the same function before rounding: as close to the float model as the unrotated quantization (k = 5)
    assert rel(got, ref) < max(2 * rel(logits(plain), ref), 0.02)
    save_quantized(model, tmp_path / "q")
    for back in (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q"), load_quantized(tmp_path / "q")):
        assert getattr(back.config, MARK)["seed"] == 3
        assert torch.equal(logits(back), got)


def test_residual_rotation_refusals():
    model = tiny("llama", torch.float32)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="rotation: expected None or one of"):
        quantize_model(model, rotation="quarot", progress=False)
    with pytest.raises(ValueError, match="k: expected"):  # the plan's checks run before the rotation
        quantize_model(model, k=7, rotation="residual", progress=False)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    assert not getattr(model.config, MARK, None)


def calib(model, n=2, seed=0):
    V = model.config.get_text_config().vocab_size
    return [torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(seed + s)) for s in range(n)]


def test_auto_rotation_choice():
    """``rotation="auto"``: none without calibration; the residual rotation where the family supports it; every
    input rotated online elsewhere (a Gemma-3 model with real post norms), fused experts kept unrotated by
    overrides that the caller's own entries still beat. Nothing changes while choosing."""
    llama = tiny("llama", torch.float32)
    before = {n: p.clone() for n, p in llama.state_dict().items()}
    assert auto_rotation(llama, None) == (None, None)
    assert auto_rotation(llama, calib(llama), overrides={"lm_head": None}) == ("residual", {"lm_head": None})
    assert all(torch.equal(p, before[n]) for n, p in llama.state_dict().items())
    gemma = tiny("gemma3_text", torch.float32)
    assert auto_rotation(gemma, calib(gemma))[0] == "residual"  # post norms one constant: supported
    with torch.no_grad():
        gemma.model.layers[1].post_feedforward_layernorm.weight.normal_(0.0, 0.3)
    assert residual_unsupported(gemma) is not None
    assert auto_rotation(gemma, calib(gemma)) == ("hadamard", None)
    moe = tiny("qwen3_moe", torch.float32)
    setattr(moe.config, MARK, {"seed": 0})  # rotated once already: the residual rotation refuses a second time
    rot, ov = auto_rotation(moe, calib(moe), overrides={"down_proj": {"k": 5}})
    experts = [n for n in ov if "experts" in n]
    assert rot == "hadamard" and experts and list(ov)[-1] == "down_proj"  # the caller's entry last: it wins
    todo = plan(moe, k=4, overrides=ov, rotation=rot)  # without the overrides: refused (experts cannot rotate)
    assert all((c["rotation"] is None) == (c["kind"] == "experts") for c in todo.values())


def test_auto_rotation_quantized():
    """``quantize_model(rotation="auto", calibration=...)`` is ``rotation="residual"`` on a supported family,
    bit-exact; without calibration it is no rotation (and no warning about one)."""
    ids = calib(tiny("llama", torch.float32))
    a = quantize_model(tiny("llama", torch.float32), k=3, rotation="auto", calibration=ids, progress=False)
    b = quantize_model(tiny("llama", torch.float32), k=3, rotation="residual", calibration=ids, progress=False)
    assert getattr(a.config, MARK)["seed"] == 0
    assert torch.equal(logits(a), logits(b))
    c = quantize_model(tiny("llama", torch.float32), k=3, rotation="auto", progress=False)
    assert not getattr(c.config, MARK, None)
    assert all(m.rotation is None for m in c.modules() if isinstance(m, KbitLinear))

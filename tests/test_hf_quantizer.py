"""kbit.KbitConfig through transformers' quantizer registry: quantize while loading, generate, save_pretrained,
from_pretrained (bit-exact), pipeline, logits against kbit's reference path; load_quantized's checks before
allocation; quantize_model and save_quantized all or nothing. Tiny random models of every supported family."""

import importlib
import json
import time

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from kbit.format.serialize import load_file, save_file  # noqa: E402
from kbit.hf import KbitConfig, KbitExperts, load_quantized, quantize_model, save_quantized  # noqa: E402
from kbit.hf.experts import CHILDREN  # noqa: E402
from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops.dequant import dequantize  # noqa: E402

quantize_module = importlib.import_module("kbit.hf.quantize_model")  # kbit.hf.quantize_model is the function
checkpoint_module = importlib.import_module("kbit.hf.checkpoint")
AutoModelForCausalLM = transformers.AutoModelForCausalLM
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
FAMILIES = {
    "llama": dict(SMALL, tie_word_embeddings=True),
    "mistral": SMALL,
    "qwen2": SMALL,
    "qwen3": dict(SMALL, head_dim=16),
    "qwen3_moe": dict(SMALL, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[1]),
    "mixtral": dict(SMALL, num_local_experts=4, num_experts_per_tok=2),
    "gemma3_text": dict(SMALL, head_dim=16, sliding_window=16),
    "phi3": SMALL,
}
PROMPT = torch.tensor([[1, 5, 7, 9, 11]])


def float_folder(tmp_path, model_type: str, seed: int = 0):
    config = transformers.AutoConfig.for_model(model_type, **FAMILIES[model_type])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path / f"float-{model_type}"
    model.save_pretrained(path)
    return path, model


def kbit_tensors(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.state_dict().items()
            if n.rsplit(".", 1)[-1] in ("codes", "scales", "tensor_scale", "codebook")}


def greedy(model, n: int = 4) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=n, do_sample=False, min_new_tokens=n)


def reference_logits(float_model, quantized) -> torch.Tensor:
    """kbit's reference path: the float model with each quantized weight replaced by ``dequantize`` of it
    (float32), F.linear as transformers does it."""
    ref = float_model.float()
    for name, m in quantized.named_modules():
        if isinstance(m, KbitLinear):
            ref.get_submodule(name).weight.data = dequantize(m.weight(), torch.float32)
        elif isinstance(m, KbitExperts):
            for w in CHILDREN:
                getattr(ref.get_submodule(name), w).data = dequantize(m.weight(w), torch.float32)
    with torch.no_grad():
        return ref(PROMPT).logits


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_quantize_on_load_generate_save_load_bit_exact(model_type, tmp_path):
    path, float_model = float_folder(tmp_path, model_type)
    q = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4), device_map="cpu")
    assert any(isinstance(m, KbitLinear) for m in q.modules())
    assert any(isinstance(m, KbitExperts) for m in q.modules()) == (model_type in ("qwen3_moe", "mixtral"))
    with torch.no_grad():
        logits = q(PROMPT).logits
    torch.testing.assert_close(logits.float(), reference_logits(float_model, q), rtol=1e-4, atol=1e-4)
    tokens = greedy(q)
    out = tmp_path / "quantized"
    q.save_pretrained(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "kbit" and qc["k"] == 4 and qc["modules"]
    back = AutoModelForCausalLM.from_pretrained(out)  # no kbit-specific call
    assert torch.equal(greedy(back), tokens)
    want = kbit_tensors(q)
    for other in (back, load_quantized(out)):
        got = kbit_tensors(other)
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
        with torch.no_grad():
            assert torch.equal(other(PROMPT).logits, logits)


def test_kbit_folder_loads_with_from_pretrained_and_back(tmp_path):
    path, _ = float_folder(tmp_path, "qwen3_moe")
    q = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=KbitConfig(k=3, overrides={r"down_proj": {"k": 5}},
                                             modules_to_not_convert=[r"o_proj"]))
    assert isinstance(q.model.layers[0].self_attn.o_proj, nn.Linear)
    assert q.model.layers[1].mlp.down_proj.k == 5 and q.model.layers[1].mlp.up_proj.k == 3
    save_quantized(q, tmp_path / "k")
    assert load_file(tmp_path / "k" / "model.safetensors")  # a kbit file (its metadata, its checks)
    for back in (AutoModelForCausalLM.from_pretrained(tmp_path / "k"), load_quantized(tmp_path / "k")):
        assert back.model.layers[1].mlp.down_proj.k == 5
        assert isinstance(back.model.layers[0].self_attn.o_proj, nn.Linear)
        with torch.no_grad():
            assert torch.equal(back(PROMPT).logits, q(PROMPT).logits)


@pytest.mark.parametrize("model_type", ["mistral", "llama"])  # untied, tied word embeddings
def test_quantize_lm_head(model_type, tmp_path):
    path, _ = float_folder(tmp_path, model_type)
    q = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4, quantize_lm_head=True))
    assert isinstance(q.lm_head, KbitLinear) and isinstance(q.model.embed_tokens.weight, nn.Parameter)
    assert not q.config.tie_word_embeddings  # the float embedding and the k-bit head are two tensors now
    tokens = greedy(q)
    q.save_pretrained(tmp_path / "q")
    save_quantized(q, tmp_path / "k")
    for back in (AutoModelForCausalLM.from_pretrained(tmp_path / "q"), AutoModelForCausalLM.from_pretrained(
            tmp_path / "k"), load_quantized(tmp_path / "k")):
        assert isinstance(back.lm_head, KbitLinear) and torch.equal(greedy(back), tokens)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, 96)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                 pad_token="<pad>", unk_token="<unk>")


def test_pipeline_text_generation(tmp_path):
    path, _ = float_folder(tmp_path, "llama")
    q = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4))
    pipe = transformers.pipeline("text-generation", model=q, tokenizer=tiny_tokenizer(), device="cpu")
    out = pipe("w5 w7 w9", max_new_tokens=3, do_sample=False, min_new_tokens=3)
    text = out[0]["generated_text"]  # WordLevel decodes without spaces between new tokens
    assert text.startswith("w5 w7 w9") and text.count("w") == 6


def test_unsupported_architecture_names_the_model_type(tmp_path):
    config = transformers.AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    # GPT-2's layers hold transformers' Conv1D, not nn.Linear: its structure gives nothing to quantize
    with pytest.raises(ValueError, match=r"model_type 'gpt2' has no row .* no nn.Linear .*include="):
        AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", quantization_config=KbitConfig(k=4))


def test_config_checks_its_arguments():
    with pytest.raises(ValueError, match="k"):
        KbitConfig(k=7)
    with pytest.raises(ValueError, match="codebook: expected None or one of"):
        KbitConfig(codebook="bogus")
    with pytest.raises(TypeError, match="modules_to_not_convert"):
        KbitConfig(modules_to_not_convert="lm_head")
    with pytest.raises(ValueError, match="quant_method"):
        KbitConfig(quant_method="gptq")
    with pytest.raises(ValueError, match=r"overrides\['down_proj'\]: expected keys among"):
        KbitConfig(overrides={"down_proj": {"codebook": torch.zeros(16)}})
    with pytest.raises(ValueError, match=r"overrides\['down_proj'\]: expected keys among"):
        KbitConfig(overrides={"down_proj": {"bits": 3}})
    with pytest.raises(ValueError, match=r"overrides\['\('\]: the key: expected a regular expression, got '\(', "
                                         r"which is not one"):
        KbitConfig(overrides={"(": {"k": 4}})
    with pytest.raises(ValueError, match=r"modules_to_not_convert\[1\]: expected a regular expression"):
        KbitConfig(modules_to_not_convert=["lm_head", "mlp.[up"])
    cfg = KbitConfig.from_dict(KbitConfig(k=3, codebook="nf").to_dict())
    assert (cfg.k, cfg.codebook, cfg.quant_method) == (3, "nf", "kbit")


# ------------------------------------------------------------------------------------------------ robustness


def saved(tmp_path, model_type: str = "qwen3"):
    _, model = float_folder(tmp_path, model_type)
    quantize_model(model, k=4, progress=False)
    out = tmp_path / "ckpt"
    save_quantized(model, out)
    return out, model


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_absurd_layer_count_fails_fast_before_building(tmp_path):
    out, _ = saved(tmp_path)
    edit_config(out, num_hidden_layers=1000000)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"num_hidden_layers: expected an int in \[1, 4096\], got 1000000"):
        load_quantized(out)
    assert time.perf_counter() - t0 < 1.0
    edit_config(out, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"num_hidden_layers: expected 2 \(the checkpoint has tensors of layers"):
        load_quantized(out)
    edit_config(out, num_hidden_layers=2, hidden_size=32)
    with pytest.raises(ValueError, match=r"vocab_size, hidden_size: expected \(96, 64\).*got \(96, 32\)"):
        load_quantized(out)


def test_sharded_save_pretrained_folder_loads_and_is_checked(tmp_path):
    path, _ = float_folder(tmp_path, "qwen3")
    q = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4))
    out = tmp_path / "sharded"
    q.save_pretrained(out, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert torch.equal(load_quantized(out)(PROMPT).logits, q(PROMPT).logits)
    edit_config(out, num_hidden_layers=1000000)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_quantized(out)


@pytest.mark.skipif(not hasattr(transformers.quantizers.base.HfQuantizer, "update_attn_implementation"),
                    reason="transformers shows no config before it builds the model (5.17 no, 5.24 yes)")
def test_from_pretrained_refuses_absurd_sizes_before_building(tmp_path):
    out, _ = saved(tmp_path, "llama")
    edit_config(out, num_hidden_layers=1000000)
    with pytest.raises(ValueError, match=r"num_hidden_layers: expected an int in \[1, 4096\], got 1000000"):
        AutoModelForCausalLM.from_pretrained(out)


def rewrite(path, name: str, fn):
    state = load_file(path)
    state[name] = fn(state[name])
    save_file(state, path, metadata={"format": "pt"})


def test_tensor_shape_or_dtype_mismatch_names_file_and_tensor(tmp_path):
    out, _ = saved(tmp_path)
    f = out / "model.safetensors"
    rewrite(f, "model.norm.weight", lambda t: t[:40].clone())
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.norm.weight': expected shape \[64\] "
                                         r"dtype float, got shape \[40\]"):
        load_quantized(out)
    rewrite(f, "model.norm.weight", lambda t: torch.ones(64, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"'model.norm.weight'.*got shape \[64\] dtype torch.int32"):
        load_quantized(out)
    rewrite(f, "model.norm.weight", lambda t: torch.ones(64))
    state = load_file(f)
    state["model.extra.weight"] = torch.ones(3)
    save_file(state, f)
    with pytest.raises(ValueError, match=r"tensor 'model.extra.weight' is not a parameter or buffer"):
        load_quantized(out)
    del state["model.extra.weight"], state["model.norm.weight"]
    save_file(state, f)
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*model.norm.weight"):
        load_quantized(out)


def test_recorded_module_shape_must_match_the_model(tmp_path):
    out, _ = saved(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["modules"]["model.layers.0.mlp.up_proj"]["shape"] = [64, 64]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"modules\['model.layers.0.mlp.up_proj'\]: expected an nn.Linear \[64, 64\]"):
        load_quantized(out)


def test_quantize_model_failing_on_the_last_module_changes_nothing(monkeypatch):
    config = transformers.AutoConfig.for_model("qwen3", **FAMILIES["qwen3"])
    model = AutoModelForCausalLM.from_config(config)
    before = {n: (type(m), id(m)) for n, m in model.named_modules()}
    real, calls = quantize_module._quantize_linear, []

    def flaky(linear, kw, device):
        calls.append(1)
        if linear is model.model.layers[1].mlp.down_proj:  # the last module
            raise RuntimeError("boom")
        return real(linear, kw, device)

    monkeypatch.setattr(quantize_module, "_quantize_linear", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        quantize_model(model, k=4, progress=False)
    assert calls and {n: (type(m), id(m)) for n, m in model.named_modules()} == before


def test_save_quantized_failure_leaves_the_old_folder(tmp_path, monkeypatch):
    out, model = saved(tmp_path)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(checkpoint_module, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        save_quantized(model, out)
    with pytest.raises(OSError, match="disk full"):
        save_quantized(model, tmp_path / "new")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "float-qwen3"]  # no temporary left


def test_save_quantized_replaces_weights_keeps_other_files(tmp_path):
    out, model = saved(tmp_path)
    (out / "tokenizer.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors").write_text("stale shard")
    (out / "kbit_config.json").write_text("{}")
    save_quantized(model, out)
    assert (out / "tokenizer.json").read_text() == "{}"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json"]
    assert load_quantized(out) is not None


def test_legacy_kbit_config_folder_still_loads(tmp_path):
    _, model = float_folder(tmp_path, "qwen3_moe")
    quantize_model(model, k=4, progress=False)
    state, modules = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, KbitLinear):
            state[f"{name}.weight"] = m.weight()
            modules[name] = {"kind": "linear", "dtype": "float32"}
        elif isinstance(m, KbitExperts):
            state |= {f"{name}.{w}": m.weight(w) for w in CHILDREN}
            modules[name] = {"kind": "experts", "dtype": "float32"}
    quantized = tuple(f"{n}." for n in modules)
    state |= {n: t for n, t in model.state_dict().items() if not n.startswith(quantized)}
    old = tmp_path / "old"
    old.mkdir()
    save_file(state, old / "model.safetensors")
    del model.config.quantization_config  # quantize_model sets it; a legacy folder's config.json has none
    model.config.save_pretrained(old)
    (old / "kbit_config.json").write_text(json.dumps({"kbit_checkpoint_version": 1, "class": type(model).__name__,
                                                      "modules": modules, "tied": {}}))
    back = load_quantized(old)
    with torch.no_grad():
        assert torch.equal(back(PROMPT).logits, model(PROMPT).logits)


# ------------------------------------------------------------------------------------------------ GPU


REAL_SHAPED = {  # one decoder layer of real width: the load bound is about layers, not depth
    "llama": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=512),
    "qwen3_moe": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64,
                      num_experts_per_tok=8, vocab_size=32000, max_position_embeddings=512),
}


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", sorted(REAL_SHAPED))
def test_gpu_quantize_on_load_peak_memory_and_static_cache(model_type, tmp_path):
    config = transformers.AutoConfig.for_model(model_type, **REAL_SHAPED[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    layer_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers)
    model.save_pretrained(tmp_path / "float", max_shard_size=f"{max(layer_bytes // 2**20, 1)}MB")
    del model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=KbitConfig(k=4),
                                             device_map="cuda", dtype=torch.bfloat16)
    peak = torch.cuda.max_memory_allocated() - base
    held = torch.cuda.memory_allocated() - base
    print(f"{model_type}: peak {peak / 2**20:.1f} MiB, k-bit model {held / 2**20:.1f} MiB, "
          f"largest layer (bf16) {layer_bytes / 2**20:.1f} MiB")
    assert peak <= held + layer_bytes, (peak, held, layer_bytes)  # the k-bit model plus one float layer
    prompt = torch.tensor([[1, 5, 7, 9, 11]], device="cuda")
    static = q.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8, cache_implementation="static")
    assert static.shape == (1, 13) and torch.equal(static[:, :5], prompt)
    # a random model's bf16 logits are nearly flat, so greedy tokens of two cache layouts may differ by a near-tie:
    # the static-cache logits are compared with the full forward's instead
    with torch.no_grad():
        full = q(static).logits[0, 4:-1].float()
    chosen = full.gather(-1, static[0, 5:, None]).squeeze(-1)
    assert (chosen >= full.amax(-1) - 0.05 * full.std(-1)).all()
    q.save_pretrained(tmp_path / "q")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map="cuda")
    want, got = kbit_tensors(q), kbit_tensors(back)
    assert set(got) == set(want) and all(torch.equal(got[n].cpu(), want[n].cpu()) for n in want)
    with torch.no_grad():
        a, b = back(static).logits.float(), q(static).logits.float()
    # the codes are bit-identical (above); the two models may still take different kernels (a kernel layout, split-K
    # atomics), whose bf16 outputs differ by an ulp here and there: compare norm-wise
    assert ((a - b).norm() / b.norm()).item() <= 1e-2


def test_config_refuses_unknown_arguments_and_loads_unknown_keys_with_a_warning():
    """``KbitConfig(bits=2)`` would quantize at the default k = 4 without a word: an argument that is not the
    config's is a TypeError naming it. A config.json's ``quantization_config`` with keys this version does not know
    still loads (another kbit version wrote it), with a warning naming them; the config's own dict loads silently."""
    with pytest.raises(TypeError, match=r"KbitConfig: expected arguments among \('quant_method', 'k', .*\['bits'\]"):
        KbitConfig(bits=2)
    with pytest.warns(UserWarning, match=r"quantization_config: keys \['bits', 'future'\] are not KbitConfig's"):
        c = KbitConfig.from_dict({"quant_method": "kbit", "k": 3, "bits": 2, "future": {"x": 1}})
    assert c.k == 3 and not hasattr(c, "bits")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = KbitConfig(k=5, overrides={"down_proj": {"k": 4}}).to_dict()
        assert KbitConfig.from_dict(d).to_dict() == d

"""The `kbit` command: `kbit quantize` on a local model directory gives the same model as quantize_model."""

import pytest
import torch

from kbit.cli import build_parser, main

transformers = pytest.importorskip("transformers")

from kbit.hf import load_quantized, quantize_model  # noqa: E402


def tiny_llama():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def logits(model):
    x = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(x).logits


def test_subcommands_are_listed():
    text = build_parser().format_help()
    for name in ("bench", "eval", "quantize"):
        assert name in text


def test_quantize_command_matches_library(tmp_path):
    model = tiny_llama()
    src, dst = tmp_path / "model", tmp_path / "kbit"
    model.save_pretrained(src)
    assert main(["quantize", str(src), str(dst), "--k", "3", "--override", 'down_proj={"k": 5}']) == 0
    loaded = load_quantized(dst)
    expected = quantize_model(tiny_llama(), k=3, overrides={"down_proj": {"k": 5}}, progress=False)
    torch.testing.assert_close(logits(loaded), logits(expected), rtol=0, atol=0)


def test_bad_override_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["quantize", str(tmp_path), str(tmp_path / "o"), "--override", "x={not json"])
    assert "PATTERN=JSON" in capsys.readouterr().err

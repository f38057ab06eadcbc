"""The `kbit` command: `kbit quantize` on a local model directory gives the same model as quantize_model."""

import pytest
import torch

from kbit.cli import build_parser, main

transformers = pytest.importorskip("transformers")

from kbit.hf import load_quantized, quantize_model, save_quantized  # noqa: E402


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


def tiny_tokenizer():
    """A word-level fast tokenizer built in memory (no hub): enough for save/load round trips."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_quantize_copies_tokenizer_and_generation_config(tmp_path, capsys):
    src, dst = tmp_path / "model", tmp_path / "kbit"
    model = tiny_llama()
    model.save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    assert (src / "generation_config.json").exists()
    assert main(["quantize", str(src), str(dst), "--k", "4"]) == 0
    n = sum(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
    assert f"{n} Linear quantized, chosen by its table row ('llama')" in capsys.readouterr().out
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(dst, local_files_only=True)
    assert tok("hello world").input_ids == [3, 4]


def test_quantize_rotation_and_calibration_match_library(tmp_path, capsys):
    """``--rotation hadamard --seed 1 --calibrate FILE`` is quantize_model(rotation=, seed=, calibration=text) with
    the model folder's tokenizer; the rotation round-trips through the checkpoint."""
    src, dst = tmp_path / "model", tmp_path / "kbit"
    tiny_llama().save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    text = " ".join(["hello", "world", "hello", "</s>"] * 300)
    (tmp_path / "cal.txt").write_text(text)
    args = ["quantize", str(src), str(dst), "--k", "3", "--rotation", "hadamard", "--seed", "1",
            "--calibrate", str(tmp_path / "cal.txt")]
    assert main(args) == 0
    assert "rotation=hadamard, calibrated on" in capsys.readouterr().out
    loaded = load_quantized(dst)
    assert loaded.model.layers[0].self_attn.q_proj.rotation.seed == 1
    expected = quantize_model(tiny_llama(), k=3, rotation="hadamard", seed=1, calibration=text,
                              tokenizer=tiny_tokenizer(), progress=False)
    torch.testing.assert_close(logits(loaded), logits(expected), rtol=0, atol=0)


def test_quantize_refuses_newly_initialized_weights(tmp_path, capsys):
    """An encoder folder loaded as a causal LM gets a randomly initialized head: refuse, write nothing."""
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=50)
    src, dst = tmp_path / "bert", tmp_path / "out"
    transformers.BertModel(config).save_pretrained(src)
    capsys.readouterr()
    assert main(["quantize", str(src), str(dst)]) == 1
    err = one_error_line(capsys)
    assert "newly initialized" in err and "--encoder" in err and "nothing written" in err
    assert not dst.exists()
    assert main(["quantize", str(src), str(dst), "--encoder"]) == 0
    assert (dst / "config.json").exists()


def _folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_quantize_never_writes_over_a_float_model(tmp_path, capsys):
    """`kbit quantize MODEL MODEL` replaced the float weights with the checkpoint and then failed (SameFileError):
    the model was lost. The model's own folder, and any folder holding another model that is not a kbit checkpoint,
    are refused before the model loads, and left as they were; a kbit checkpoint is replaced."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    src, other = tmp_path / "llama", tmp_path / "other"
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    transformers.LlamaForCausalLM(config).save_pretrained(other)
    before, before_other = _folder_bytes(src), _folder_bytes(other)
    capsys.readouterr()
    for out in (src, tmp_path / "." / "llama"):
        assert main(["quantize", str(src), str(out)]) == 1
        assert "out: expected a folder other than the model's" in one_error_line(capsys)
    assert main(["quantize", str(src), str(other)]) == 1
    err = one_error_line(capsys)
    assert "directory: expected a new folder, or a kbit checkpoint to replace" in err and "nothing written" in err
    assert _folder_bytes(src) == before and _folder_bytes(other) == before_other
    dst = tmp_path / "q"
    assert main(["quantize", str(src), str(dst)]) == 0
    assert main(["quantize", str(src), str(dst), "--k", "2"]) == 0  # a kbit checkpoint: replaced
    assert '"k": 2' in (dst / "config.json").read_text()
    capsys.readouterr()
    with pytest.raises(ValueError, match="holds model.safetensors of a model that is not a kbit checkpoint"):
        save_quantized(load_quantized(dst), other)  # the library call refuses it too
    assert _folder_bytes(other) == before_other


def test_quantize_calibration_inputs_are_checked_first(tmp_path, capsys):
    """A missing --calibrate file, a model folder without a tokenizer (the text is tokenized with it) and a
    negative --finetune-steps are one-line errors naming the option, and nothing is written."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    src, dst, text = tmp_path / "llama", tmp_path / "q", tmp_path / "cal.txt"
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    text.write_text("some calibration text")
    capsys.readouterr()
    assert main(["quantize", str(src), str(dst), "--calibrate", str(tmp_path / "gone.txt")]) == 1
    assert "--calibrate: expected a text file, got " in one_error_line(capsys)
    assert main(["quantize", str(src), str(dst), "--calibrate", str(text)]) == 1
    assert "--calibrate: expected the model's tokenizer files in " in one_error_line(capsys)
    with pytest.raises(SystemExit):
        main(["quantize", str(src), str(dst), "--calibrate", str(text), "--finetune-steps", "-3"])
    assert "argument --finetune-steps: expected int >= 0, got '-3'" in capsys.readouterr().err
    assert not dst.exists()


def test_quantize_missing_folder_is_one_line(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "nope"), str(tmp_path / "out")]) == 1
    err = one_error_line(capsys)
    assert err.startswith("kbit quantize: error: model: expected a Hugging Face model folder")
    with pytest.raises(FileNotFoundError):  # --debug: the exception itself, with its traceback
        main(["--debug", "quantize", str(tmp_path / "nope"), str(tmp_path / "out")])


def test_bench_without_cuda_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--shapes", "64x64", "--moe", "none"]) == 1
    err = one_error_line(capsys)
    assert "expected an NVIDIA GPU" in err and "kbit generate --compare" in err


def test_missing_optional_package_names_the_install(monkeypatch, capsys):
    from kbit.cli import error_line

    line = error_line("eval", ModuleNotFoundError("No module named 'gensim'", name="gensim"))
    assert "'gensim'" in line and "pip install" in line


def test_kbit_warnings_print_as_one_line(tmp_path, capsys):
    """kbit's own warnings print as one line each under the CLI, like its errors (here: Llama-4's pre-routed
    experts kept in float); other packages' warnings keep Python's format."""
    import warnings

    from kbit.cli import warning_line

    assert warning_line("quantize", UserWarning("kbit: experts kept in float: x (why)\nmore")) == \
        "kbit quantize: warning: experts kept in float: x (why)"
    assert warning_line("quantize", FutureWarning("`past_key_values` is deprecated")) is None
    try:
        config = transformers.AutoConfig.for_model("llama4_text", hidden_size=64, intermediate_size=64,
                                                   intermediate_size_mlp=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                   vocab_size=96, num_local_experts=4)
    except (KeyError, ValueError):
        pytest.skip(f"transformers {transformers.__version__} has no llama4_text")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        before = warnings.showwarning
        assert main(["quantize", str(tmp_path / "m"), str(tmp_path / "q"), "--k", "4"]) == 0
        assert warnings.showwarning is before  # the CLI's handler is gone again
    printed = capsys.readouterr()
    err = [line for line in printed.err.splitlines() if "kept in float" in line]
    assert len(err) == 1 and err[0].startswith("kbit quantize: warning: fused experts kept in float"), err
    assert "14 Linear quantized, chosen by its structure ('llama4_text')" in printed.out


def test_generate_under_torchrun_splits_the_model(tmp_path):
    """``torchrun --nproc-per-node 2 -m kbit.cli generate --model DIR --device cpu``: the checkpoint split over two
    gloo ranks (kbit.hf.tp.shard_loaded) decodes the same greedy text as one process, printed once."""
    import subprocess
    import sys

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=5,
                                      max_position_embeddings=64)  # head_dim 32: whole heads a rank
    torch.manual_seed(0)
    src, dst = tmp_path / "model", tmp_path / "kbit"
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.eos_token = None  # all 6 tokens, whatever the random model picks
    tok.save_pretrained(src)
    assert main(["quantize", str(src), str(dst), "--k", "4"]) == 0
    args = ["generate", "hello world", "--model", str(dst), "--device", "cpu", "--temperature", "0",
            "--max-new-tokens", "6"]

    def text(cmd):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return out.stdout

    one = text([sys.executable, "-m", "kbit.cli", *args])
    two = text([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "kbit.cli", *args])
    assert "[6 tokens in" in two and "2 ranks" in two and two.count("tokens in") == 1, two  # rank 0 prints once
    assert one.split("\n[")[0] == two.split("\n[")[0] and one.split("\n[")[0].strip(), (one, two)

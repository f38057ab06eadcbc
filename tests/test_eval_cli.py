"""`kbit eval` saves its results after each row and shows progress (a stopped run keeps what it measured)."""

import json

import pytest

from kbit.cli import main
from kbit.eval import cli as eval_cli


class FakeJudge:
    """Scores each method by a counter; the third score is interrupted like a user's Ctrl-C."""

    name = "fake"

    def __init__(self, n=400):
        self.info = {"model": "fake", "sentences": n}
        self.calls = 0

    def score(self, fn):
        self.calls += 1
        if self.calls == 3:
            raise KeyboardInterrupt
        return {"loss": 0.1 * self.calls, "cos_p1": 0.9, "cos_min": 0.8}


def test_rows_are_saved_as_they_come(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(eval_cli.JUDGES, "minilm", FakeJudge)
    rc = main(["eval", "--model", "minilm", "--k", "4", "--codebooks", "nf0,lloyd", "--out", str(tmp_path)])
    assert rc == 130
    out = capsys.readouterr().out
    assert "1/4 fake k=4 kbit/nf0" in out and "2/4 fake k=4 kbit/lloyd" in out
    (path,) = tmp_path.glob("quality-minilm-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["method"] for r in rows] == ["kbit/nf0", "kbit/lloyd"]
    assert rows[0]["loss"] == pytest.approx(0.1)
    assert not list(tmp_path.glob("*.tmp"))


def test_quick_is_small():
    assert eval_cli.QUICK["k"] == [4] and eval_cli.QUICK["tokens"] <= 512 and eval_cli.QUICK["sentences"] <= 100


def test_unknown_judge_is_one_line(tmp_path, capsys):
    assert main(["eval", "--model", "nope", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kbit eval: error: --model: expected one of") and len(err.splitlines()) == 1


def test_bad_bits_and_missing_table_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--k", "4,7"])
    assert "argument --k: expected bits in (2, 3, 4, 5), got [7]" in capsys.readouterr().err
    assert main(["eval", "--table", str(tmp_path / "none.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kbit eval: error: --table: expected a results JSON file") and len(err.splitlines()) == 1
    (tmp_path / "bad.json").write_text("{")
    assert main(["eval", "--table", str(tmp_path / "bad.json")]) == 1
    assert "--table: expected a results JSON file, got unreadable JSON" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--sentences", "0"], "argument --sentences: expected an integer >= 1, got 0"),
    (["--tokens", "-1"], "argument --tokens: expected an integer >= 1, got -1"),
    (["--window", "x"], "argument --window: expected an integer >= 1, got 'x'")])
def test_bad_counts_are_usage_errors(capsys, argv, message):
    """Counts are checked as they are parsed, before the judges' packages are looked for."""
    with pytest.raises(SystemExit):
        main(["eval", *argv])
    assert message in capsys.readouterr().err


def test_unknown_codebook_is_one_line_before_any_judge(tmp_path, capsys):
    assert main(["eval", "--codebooks", "nf,bogus", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kbit eval: error: --codebooks: expected names from") and "'bogus'" in err
    assert list(tmp_path.iterdir()) == []


class FakeCausalJudge(FakeJudge):
    """Takes whole-model methods too: runs each on a tiny Llama (with a word-level tokenizer) and checks that the
    copy holds k-bit modules while its own model stays float."""

    def __init__(self, tokens=2048, window=512):
        super().__init__()
        from tokenizers import Tokenizer, models, pre_tokenizers

        transformers = pytest.importorskip("transformers")
        vocab = {w: i for i, w in enumerate(["<unk>", "the", "a", "of", "to", "in", "and"])}
        tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        self.tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
                                          max_position_embeddings=64)
        self.model = transformers.LlamaForCausalLM(config).eval()
        self.models = []

    def score(self, fn):
        return {"ppl": 1.0, "kl": 0.0, "top1": 1.0}

    def score_model(self, quantize):
        import copy

        from kbit.nn import KbitLinear

        model = quantize(copy.deepcopy(self.model))
        self.models.append(model)
        assert any(isinstance(m, KbitLinear) for m in model.modules())
        assert not any(isinstance(m, KbitLinear) for m in self.model.modules())
        return {"ppl": 2.0, "kl": 0.5, "top1": 0.5}


def test_calibrate_adds_the_library_row(tmp_path, monkeypatch):
    """``--calibrate``: one ``kbit/calibrated`` row per k, from quantize_model(rotation="auto", calibration=...)
    (here the residual rotation: a Llama), after the weight-function rows."""
    judges = []
    monkeypatch.setitem(eval_cli.JUDGES, "smollm2", lambda **kw: judges.append(FakeCausalJudge(**kw)) or judges[-1])
    # the default text is gensim's corpus (the eval extra); the row does not depend on which text it is
    monkeypatch.setattr(eval_cli, "default_calibration_text", lambda: "The quick brown fox jumps over the dog. " * 64)
    assert main(["eval", "--model", "smollm2", "--k", "3", "--codebooks", "nf0", "--no-baselines", "--calibrate",
                 "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("quality-smollm2-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["method"] for r in rows] == ["kbit/nf0", "kbit/calibrated"] and rows[1]["kl"] == 0.5
    (model,) = judges[0].models
    assert model.config.kbit_residual_rotation["seed"] == 0

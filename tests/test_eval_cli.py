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

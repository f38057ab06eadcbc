"""The model-shape suite (kbit.bench.suite), its summary (kbit.bench.summary) and the bench CLI's suite options."""
from __future__ import annotations

import csv

import pytest
import torch

from kbit.bench import cli as bench_cli
from kbit.bench import report, summary
from kbit.bench import suite as S
from kbit.bench.moe import QWEN3_30B_A3B
from kbit.cli import build_parser

MODELS = S.load_models()


def _by(model: str) -> dict[str, S.Layer]:
    return {lay.name: lay for lay in S.layers() if lay.model == model}


def test_suite_size_and_sources():
    dense = [lay for lay in S.layers() if lay.dense]
    assert len(dense) >= 40 and len(S.dense_shapes(dense)) >= 40
    assert len(S.families()) >= 10
    assert len({m.name for m in MODELS}) == len(MODELS)
    for m in MODELS:
        assert m.source.startswith("https://huggingface.co/") and m.source.endswith("/config.json"), m.name
        assert set(m.unsure) <= set(m.config), m.name
    wanted = {"Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B", "Qwen2.5-7B", "Qwen2.5-72B", "Qwen3-8B", "Qwen3-14B",
              "Qwen3-32B", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "Mistral-Small-24B-Instruct-2501", "gemma-3-27b-it",
              "phi-4", "gpt-oss-20b", "gpt-oss-120b", "DeepSeek-V3", "GLM-4.5-Air", "Mixtral-8x7B-v0.1"}
    assert wanted <= {m.name for m in MODELS}


def _expected(m: S.Model) -> dict[str, tuple[int, ...]]:
    """The layer shapes of one model written out from the config (independent of kbit.bench.suite's code)."""
    c = m.config
    h = c["hidden_size"]
    nh = c["num_attention_heads"]
    out = {"lm_head": (c["vocab_size"], h)}
    if m.attention == "mla":
        out.update(q_a=(c["q_lora_rank"], h), kv_a=(c["kv_lora_rank"] + c["qk_rope_head_dim"], h),
                   q_b=(nh * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]), c["q_lora_rank"]),
                   kv_b=(nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
                   o=(h, nh * c["v_head_dim"]))
    else:
        hd = c.get("head_dim", h // nh)
        out.update(qkv=(nh * hd + 2 * c["num_key_value_heads"] * hd, h), o=(h, nh * hd))
    if m.dense_mlp:
        out.update(gate_up=(2 * c["intermediate_size"], h), down=(h, c["intermediate_size"]))
    if m.experts:
        E = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
        inter = c.get("moe_intermediate_size", c["intermediate_size"])
        out["experts.gate_up"] = (E, 2 * inter, h, c["num_experts_per_tok"])
        out["experts.down"] = (E, h, inter, c["num_experts_per_tok"])
        if c.get("n_shared_experts"):
            si = c["n_shared_experts"] * c["moe_intermediate_size"]
            out.update({"shared.gate_up": (2 * si, h), "shared.down": (h, si)})
    return out


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_shapes_match_config(model):
    got = {lay.name: ((lay.N, lay.K) if lay.dense else (lay.E, lay.N, lay.K, lay.topk))
           for lay in S.model_layers(model)}
    assert got == _expected(model)


def test_known_shapes():
    """Shapes the issue names: the Qwen3-32B down projection, Llama-3-8B's MLP, gpt-oss's square expert, and the
    harness's Qwen3-30B-A3B preset."""
    assert (_by("Qwen3-32B")["down"].N, _by("Qwen3-32B")["down"].K) == (5120, 25600)
    assert (_by("Llama-3.1-8B")["gate_up"].N, _by("Llama-3.1-8B")["gate_up"].K) == (28672, 4096)
    ex = _by("gpt-oss-20b")["experts.down"]
    assert (ex.N, ex.K, ex.topk) == (2880, 2880, 4)
    sel = S.select(families_=["qwen3-moe"])
    moe = {(s.E, s.N, s.K, s.topk) for s in S.moe_shapes(sel)}
    assert {(s.E, s.N, s.K, s.topk) for s in QWEN3_30B_A3B} <= moe


def test_split_disjoint_and_balanced():
    halves = S.split_of()
    assert set(halves) == set(S.families()) and set(halves.values()) == set(S.SPLITS)
    tune, held = S.select(split="tune"), S.select(split="held-out")
    assert not {lay.family for lay in tune} & {lay.family for lay in held}
    assert len(tune) + len(held) == len(S.layers())
    for half in (tune, held):
        assert sum(lay.dense for lay in half) >= 15 and any(not lay.dense for lay in half)
    assert S.split_of() == halves  # deterministic
    unseen = S.unseen_shapes()
    assert not set(unseen) & set(S.dense_shapes(tune)) and len(unseen) >= 20
    assert set(unseen) <= set(S.dense_shapes(held))


def test_select_and_errors():
    sel = S.select(families_=["llama3"], min_weights=100_000_000)
    assert sel and all(lay.family == "llama3" and lay.weights >= 100_000_000 for lay in sel)
    shapes = S.dense_shapes(sel)
    assert shapes == sorted(shapes, key=lambda s: -s[0] * s[1]) and len(set(shapes)) == len(shapes)
    with pytest.raises(ValueError, match="families"):
        S.select(families_=["nope"])
    with pytest.raises(ValueError, match="split"):
        S.select(split="train")
    with pytest.raises(ValueError, match="suite"):
        S.load_models("no-such-suite")
    bad = S.Model("x", "x", "", "gqa", True, False, {"hidden_size": 64, "num_attention_heads": 2})
    with pytest.raises(ValueError, match="intermediate_size"):
        S.model_layers(bad)


def test_model_from_hf_config():
    cfg = {"model_type": "gemma3", "text_config": {"hidden_size": 640, "intermediate_size": 2048,
                                                   "num_attention_heads": 4, "num_key_value_heads": 1,
                                                   "head_dim": 256, "vocab_size": 1000}}
    lays = {lay.name: (lay.N, lay.K) for lay in S.model_layers(S.model_from_config("g", cfg))}
    assert lays == {"qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048),
                    "lm_head": (1000, 640)}
    moe = S.model_from_config("m", {"hidden_size": 64, "num_attention_heads": 2, "vocab_size": 10,
                                    "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2})
    assert {lay.name for lay in S.model_layers(moe)} == {"qkv", "o", "lm_head", "experts.gate_up", "experts.down"}


def test_cli_parses_suite():
    args = build_parser().parse_args(["bench", "--suite", "models", "--families", "llama3,qwen3", "--split",
                                      "tune", "--m", "1,16", "--k", "4", "--max-shapes", "3", "--suite-parts",
                                      "dense"])
    assert args.suite == "models" and args.families == ["llama3", "qwen3"] and args.split == "tune"
    layers, shapes, moe = bench_cli.suite_selection(args)
    assert {lay.family for lay in layers} == {"llama3"} and len(shapes) == 3 and moe == []
    assert S.spread(list(range(10)), 4) == [0, 3, 6, 9] and S.spread([1, 2], 5) == [1, 2]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--suite", "models", "--split", "train"])
    args = build_parser().parse_args(["bench", "--suite", "models", "--pick", "5120x25600,28672x4096",
                                      "--suite-parts", "dense"])
    assert bench_cli.suite_selection(args)[1] == [(5120, 25600), (28672, 4096)]
    args = build_parser().parse_args(["bench", "--suite", "models", "--pick", "5120x25601"])
    with pytest.raises(ValueError, match="pick"):
        bench_cli.suite_selection(args)
    args = build_parser().parse_args(["bench", "--suite", "models", "--suite-parts", "attn"])
    with pytest.raises(ValueError, match="suite-parts"):
        bench_cli.suite_selection(args)


def _row(kernel, k, N, K, M, us, E=1):
    return dict(gpu="h100", commit="abc", kernel=kernel, k=k, blocksize=32, dtype="bfloat16", N=N, K=K, M=M, E=E,
                us=us, bf16_us=None, tbps=1.0, ceiling_tbps=3.0, bytes=100)


def _rows():
    rows = []
    for N, K, base in ((5120, 25600, 100.0), (25600, 5120, 80.0)):
        rows += [_row("bf16", 16, N, K, 1, base * 4), _row("kbit-linear", 4, N, K, 1, base),
                 _row("gemm-fused", 4, N, K, 1, base * 0.9), _row("humming", 4, N, K, 1, base * 0.8)]
    return rows


def test_summarize():
    lays = [S.Layer("a", "fam", "down", 5120, 25600), S.Layer("b", "fam", "o", 25600, 5120),
            S.Layer("c", "other", "down", 5120, 25600)]
    out = {(s["family"], s["M"], s["k"]): s for s in summary.summarize(_rows(), lays)}
    s = out[("fam", 1, 4)]
    assert s["n"] == 2 and s["x_humming_median"] == pytest.approx(0.8) and s["x_bf16_worst"] == pytest.approx(4.0)
    assert s["disp_best_worst"] == pytest.approx(1 / 0.9)
    assert out[("other", 1, 4)]["n"] == 1
    text = summary.summary_markdown(summary.summarize(_rows(), lays))
    assert "| fam | 1 | 2 | 0.80 (0.80) | 4.00 (4.00) | 1.111 |" in text


def test_summarize_cut_run_keeps_other_kernels_out():
    """A point whose dispatcher row is missing from a run that timed the dispatcher elsewhere (cut by --budget-s)
    is left out, not summarized by whichever candidates ran before the cut; a run of chosen candidates (no
    dispatcher row at all) is summarized by its fastest one."""
    lays = [S.Layer("a", "fam", "down", 5120, 25600)]
    rows = _rows() + [_row("bf16", 16, 5120, 25600, 16, 400.0), _row("gemv", 4, 5120, 25600, 16, 8000.0)]
    keys = {(s["family"], s["M"]) for s in summary.summarize(rows, lays)}
    assert keys == {("fam", 1)}
    only = [r for r in rows if r["kernel"] != "kbit-linear"]
    out = {(s["family"], s["M"]): s for s in summary.summarize(only, lays)}
    assert out[("fam", 16)]["x_bf16_median"] == pytest.approx(0.05)
    assert out[("fam", 1)]["x_bf16_median"] == pytest.approx(4 / 0.9)


def test_suite_outputs_and_summary_cli(tmp_path, capsys):
    header = dict(gpu="h100", gpu_name="H100", date="2026-11-25", commit="abc", command="kbit bench", torch="2",
                  triton="3", suite="models")
    rows = _rows()
    path = report.write_results(tmp_path / "suite.json", header, rows)
    text = bench_cli.write_suite_outputs(path, header, rows, S.layers())
    assert "| qwen3 | 1 | 1 |" in text and "| [held-out] | 1 | 1 |" in text and "[tune]" not in text
    halves = summary.with_halves(S.layers())
    extra = halves[len(S.layers()):]
    assert len(extra) == len({(lay.E, lay.N, lay.K) for lay in S.layers()})
    with (tmp_path / "suite.csv").open() as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) and got[0]["kernel"] == "bf16"
    assert (tmp_path / "suite-summary.md").exists()
    from kbit.cli import main
    assert main(["bench", "--summary", str(path)]) == 0
    assert "| qwen3 | 1 | 1 | 0.80 (0.80) |" in capsys.readouterr().out


def test_bench_main_suite_run(tmp_path, monkeypatch, capsys):
    """``kbit bench --suite`` end to end with the GPU run replaced: the selection reaches the run, and the results,
    CSV, summary and table are written."""
    seen = {}

    def fake_run(cfg, checkpoint=None):
        seen["cfg"] = cfg
        header = dict(gpu="h100", gpu_name="H100", date="2026-11-25", commit="abc", command=cfg.command, torch="2",
                      triton="3", **cfg.extra_header)
        return header, _rows()

    monkeypatch.setattr(bench_cli, "run_bench", fake_run)
    monkeypatch.setattr(bench_cli.torch.cuda, "is_available", lambda: True)  # past the one-line "needs a GPU" check
    from kbit.cli import main
    assert main(["bench", "--suite", "models", "--pick", "5120x25600", "--suite-parts", "dense", "--m", "1",
                 "--k", "4", "--peers", "humming", "--out", str(tmp_path), "--name", "suite"]) == 0
    cfg = seen["cfg"]
    assert cfg.shapes == [(5120, 25600)] and cfg.moe == [] and cfg.peers_with_shape
    assert cfg.extra_header["suite"] == "models"
    files = sorted(p.name for p in (tmp_path / "h100").iterdir())
    for end in (".json", ".csv", ".md", "-summary.md"):
        assert any(f.startswith("suite-") and f.endswith(end) for f in files), (end, files)
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("| [held-out] | 1 | 1 |")
    assert "| qwen3 | 1 | 1 |" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_suite_bench_one_shape(tmp_path, capsys):
    """``kbit bench --suite`` on one small suite shape (gpt-oss o_proj) at M = 1, k = 4: rows of kbit and bf16, and
    the summary names the family (no speed is asserted)."""
    from kbit.cli import main
    assert main(["bench", "--suite", "models", "--pick", "2880x4096", "--suite-parts", "dense", "--m", "1", "--k",
                 "4", "--reps", "15", "--no-ceiling", "--out", str(tmp_path), "--name", "suite"]) == 0
    res = next(p for p in tmp_path.rglob("suite-*.json"))
    _, rows = report.read_results(res)
    assert {"bf16", "kbit-linear"} <= {r["kernel"] for r in rows}
    assert "| gpt-oss | 1 | " in capsys.readouterr().out


def test_committed_suite_table_is_current():
    """benchmarks/suites/models.md is the output of ``python -m kbit.bench.suite`` (after its two-line preface)."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "suites" / "models.md").read_text()
    assert text.split("\n\n", 2)[2] == S.suite_markdown()


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(r, M=M) for M in (1, 16, 256) for r in _rows()]
    summ = summary.summarize(rows, summary.with_halves(S.layers()))
    path = summary.plot(summ, tmp_path / "p.png", title="t")
    assert path is not None and path.stat().st_size > 1000

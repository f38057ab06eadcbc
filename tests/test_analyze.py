"""kbit analyze: interpolation, workload weights, tables and plots from small synthetic result files (CPU)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kbit.analyze import report

SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336)]


def _gemv_file(tmp_path):
    rows = []
    for n, k_ in SHAPES:
        for m in (1, 2, 4, 8):
            bf = 10.0 * n * k_ / 4096**2
            rows.append({"kernel": "bf16", "k": 16, "N": n, "K": k_, "M": m, "E": 1, "us": bf, "bf16_us": bf})
            for k in (2, 4):
                rows.append({"kernel": "gemv", "k": k, "N": n, "K": k_, "M": m, "E": 1, "us": bf * m / 4,
                             "bf16_us": bf})
                rows.append({"kernel": "gemm-fused", "k": k, "N": n, "K": k_, "M": m, "E": 1, "us": bf * 0.9,
                             "bf16_us": bf})
    p = tmp_path / "gemv.json"
    p.write_text(json.dumps({"header": {"commit": "abc1234", "gpu_name": "test"}, "rows": rows}))
    return p


def _lab_file(tmp_path):
    rows = [{"what": "overhead", "N": 512, "K": 512}]
    for n, k_ in SHAPES[1:]:
        for m in (16, 64, 256, 1024, 4096):
            bf = 10.0 * n * k_ / 4096**2 * max(1.0, m / 256)
            rows.append({"what": "bf16", "N": n, "K": k_, "M": m, "us": bf})
            for k in (2, 4):
                rows.append({"what": "fused0", "N": n, "K": k_, "k": k, "M": m, "us": bf * 2, "bf16_us": bf})
                rows.append({"what": "dequant_mm", "N": n, "K": k_, "k": k, "M": m, "us": bf * 1.25,
                             "bf16_us": bf})
    p = tmp_path / "lab.json"
    p.write_text(json.dumps({"checks_passed": True, "rows": rows}))
    return p


def test_interp_loglog():
    pts = {1: 10.0, 4: 40.0, 16: 40.0}
    assert report.interp_loglog(pts, 4) == (40.0, False)
    us, ex = report.interp_loglog(pts, 2)
    assert us == pytest.approx(20.0) and not ex  # linear in log-log: t ~ M on [1, 4]
    us, ex = report.interp_loglog(pts, 8)
    assert us == pytest.approx(40.0) and not ex
    us, ex = report.interp_loglog(pts, 64)
    assert us == pytest.approx(40.0) and ex
    us, ex = report.interp_loglog({2: 2.0, 4: 4.0}, 1)
    assert us == pytest.approx(1.0) and ex


@pytest.mark.parametrize("users", [1, 4, 64])
@pytest.mark.parametrize("chunk", [512, 2048])
def test_step_weights_sum_to_one(users, chunk):
    dists = report.token_distributions()
    w = report.step_weights(users, chunk, dists)
    assert math.isclose(sum(w.values()), 1.0, rel_tol=1e-12)
    assert all(v >= 0 for v in w.values())
    assert max(w) <= chunk + users - 1 and min(w) >= 1
    if users == 1:
        assert w[users] == max(w.values())  # one user: decode steps dominate this workload


def test_packaged_distributions_sum_to_one():
    d = report.token_distributions()
    for key in ("input_tokens_per_turn", "generated_tokens_per_turn"):
        assert math.isclose(sum(d[key]["freq"].values()), 1.0, abs_tol=1e-3)


def test_tables_from_synthetic_files(tmp_path):
    rep = report.build(_gemv_file(tmp_path), _lab_file(tmp_path), tmp_path / "missing.json", mma_paths=(),
                       dequant_path=None)
    rows = {r["M"]: r for r in rep["block"]["rows"]}
    assert rows[1]["scope"] == "block" and rows[16]["scope"] == "mlp"
    # M = 1: gemv at bf16/4 on every projection -> 4x
    assert rows[1]["k"][4]["speedup"] == pytest.approx(4.0)
    assert rows[8]["k"][2]["kernels"]["q_proj"] == "gemm-fused"
    assert rows[1024]["k"][4]["speedup"] == pytest.approx(0.8)
    w = rep["workload"]
    assert w["ks"] == [2, 4] and len(w["rows"]) == len(report.USERS) * len(report.CHUNKS)
    for r in w["rows"]:
        assert 0 < r["k"][4]["ratio"] < 2
        assert not r["k"][4]["extrapolated"]
        assert math.isclose(sum(r["k"][4]["kernel_time_share"].values()), 1.0)
    md = report.render_markdown(rep)
    assert "abc1234" in md and "(b) Workload-weighted" in md and "| 64 |" in md
    json.dumps(report.to_jsonable(rep))


def test_cli_writes_outputs(tmp_path):
    from kbit.cli import main

    md, js = tmp_path / "a.md", tmp_path / "a.json"
    assert main(["analyze", "--gemv", str(_gemv_file(tmp_path)), "--gemm-lab", str(_lab_file(tmp_path)),
                 "--moe", "", "--dequant", "", "--mma", "--out-md", str(md), "--out-json", str(js)]) == 0
    assert md.read_text().startswith("# kbit workload analysis")
    assert "workload" in json.loads(js.read_text())
    assert main(["analyze", "--gemv", str(_gemv_file(tmp_path)), "--gemm-lab", str(_lab_file(tmp_path)),
                 "--moe", str(_moe_file(tmp_path)), "--dequant", str(_dequant_file(tmp_path)),
                 "--mma", str(_issue3_file(tmp_path)), str(_mma_file(tmp_path)),
                 "--out-md", str(md), "--out-json", str(js)]) == 0
    text = md.read_text()
    assert "mma-issue3.json" in text and "(d) Dequantize" in text and "moe.json" in text
    assert json.loads(js.read_text())["mma"]["cells_by_file"]["mma-issue3.json"] > 0


def test_cli_writes_nothing_by_default(tmp_path, capsys, monkeypatch):
    from kbit.cli import main

    gemv, lab = _gemv_file(tmp_path), _lab_file(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    assert main(["analyze", "--gemv", str(gemv), "--gemm-lab", str(lab), "--moe", "", "--dequant", "",
                 "--mma"]) == 0
    assert capsys.readouterr().out.startswith("# kbit workload analysis")
    assert sorted(tmp_path.rglob("*")) == before


def test_cli_outside_the_repository_says_what_to_pass(tmp_path, capsys, monkeypatch):
    from kbit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["analyze"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("kbit analyze: error: --gemv: expected a results JSON file") and "--gemm-lab FILE" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--moe", "--dequant", "--quality", "--tokens", "--mma"])
def test_cli_a_named_file_that_is_missing_is_an_error_not_skipped(tmp_path, capsys, flag):
    """An optional input is skipped where its default is not there (outside a checkout), but a file the user names
    is read or refused with a one-line error naming the option; a file that is not JSON names its path."""
    from kbit.cli import main

    base = ["analyze", "--gemv", str(_gemv_file(tmp_path)), "--gemm-lab", str(_lab_file(tmp_path)), "--moe", "",
            "--dequant", "", "--mma", "--out-md", str(tmp_path / "a.md")]
    assert main(base + [flag, str(tmp_path / "gone.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kbit analyze: error: {flag}: expected a JSON file, got ") and "gone.json" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "a.md").exists()
    (tmp_path / "bad.json").write_text("{")
    assert main(["analyze", "--gemv", str(tmp_path / "bad.json"), "--gemm-lab", str(_lab_file(tmp_path))]) == 1
    assert "bad.json: expected a JSON results file, got unreadable JSON" in capsys.readouterr().err


def test_committed_analysis_matches_the_code(capsys, monkeypatch):
    """docs/analysis.md is what `kbit analyze --out-md docs/analysis.md` writes today (regenerate it if not)."""
    from kbit.analyze.cli import PLOT_FILES

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    rep = report.build()
    plots = [f"docs/plots/{name}" for name in PLOT_FILES if (root / "docs/plots" / name).exists()]
    assert report.render_markdown(rep, plots) == (root / "docs/analysis.md").read_text(), \
        "run: kbit analyze --out-md docs/analysis.md"


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from kbit.analyze import plots

    gemv = json.loads(_gemv_file(tmp_path).read_text())
    lab = json.loads(_lab_file(tmp_path).read_text())
    mma = json.loads(_mma_file(tmp_path).read_text())
    p = plots.plot_speedup(gemv, lab, tmp_path / "s.png", mma=[mma])
    assert p.exists() and p.stat().st_size < 200_000
    assert ("mma", 4) in plots.speedup_series(gemv, lab, [mma])[(4096, 4096)]
    rep = report.build(_gemv_file(tmp_path), _lab_file(tmp_path), None, mma_paths=[_mma_file(tmp_path)],
                       dequant_path=None, default_cfg=_dflt)
    p = plots.plot_best(rep, tmp_path / "b.png")
    assert p.exists() and p.stat().st_size < 200_000
    q = {"model": "m", "sentences": 4, "rows": [{"method": m, "k": k, "bits": k + 0.25, "loss": 0.1 / k}
                                                for m in ("kbit/nf", "rtn-g128") for k in (2, 3, 4, 5)]}
    p = plots.plot_quality(q, tmp_path / "q.png")
    assert p.exists() and p.stat().st_size < 200_000


# ---------------------------------------------------------------------------------------------- new sources
def _dflt(k, M, N, K):
    """Synthetic "today's default config" of the small-M kernel: kernel 3 on tall shapes at M <= 8."""
    return (3, 8, 2, 2) if M <= 8 and N >= 16384 else (1, 8, 2)


def _mma_file(tmp_path, name="mma-final.json"):
    """Like mma-*-final.json: kind == "mma" rows (fp16, same-run bf16_us), M = 1..64, plus noise rows."""
    rows = [{"kind": "sweep", "N": 4096, "K": 4096, "k": 4, "M": 1, "cfg": [1, 4, 4], "us": 0.001}]
    for n, k_ in SHAPES:
        for m in (1, 2, 4, 8, 16, 32, 64):
            bf = 10.0 * n * k_ / 4096**2
            for k in (2, 3, 4, 5):
                rows.append({"kind": "mma", "N": n, "K": k_, "k": k, "M": m, "dtype": "float16",
                             "cfg": [1, 8, 2], "us": bf * (0.2 if m <= 16 else 3.0), "bf16_us": bf * 1.1})
        rows.append({"kind": "mma", "N": n, "K": k_, "k": 4, "M": 1, "dtype": "bfloat16", "cfg": [1, 8, 2],
                     "us": bf * 0.19, "bf16_us": bf * 1.1})
        rows.append({"kind": "triton", "N": n, "K": k_, "k": 4, "M": 1, "us": 0.002})
    p = tmp_path / name
    p.write_text(json.dumps({"device": "test-gpu", "commit": "fff0001", "date": "d", "rows": rows}))
    return p


def _issue3_file(tmp_path):
    """Like mma-*-issue3.json: kind == "variant", several configs a cell, no bf16 time."""
    n, k_ = 28672, 4096
    bf = 10.0 * n * k_ / 4096**2
    rows = [{"kind": "variant", "N": n, "K": k_, "k": 4, "M": 1, "cfg": [3, 8, 2, 2], "us": bf * 0.15},
            {"kind": "variant", "N": n, "K": k_, "k": 4, "M": 1, "cfg": [3, 8, 2, 2, 1], "us": bf * 0.01},
            # M = 2 only at a config that is not the default: must fall back to the final file
            {"kind": "variant", "N": n, "K": k_, "k": 4, "M": 2, "cfg": [3, 8, 2, 3], "us": bf * 0.01}]
    p = tmp_path / "mma-issue3.json"
    p.write_text(json.dumps({"device": "test-gpu", "commit": "eee0002", "rows": rows}))
    return p


def _moe_file(tmp_path):
    rows = []
    for t, plans in ((1, {"auto": 30.0, "gemv": 25.0}), (64, {"auto": 200.0}), (1024, {"auto": 900.0,
                                                                                       "grouped_mm": 800.0})):
        for plan, us in plans.items():
            rows.append({"model": "m", "k": 4, "T": t, "plan": plan, "kernels": f"{plan}/{plan}", "kbit_us": us,
                         "bf16_us": 400.0, "speedup": 400.0 / us})
    p = tmp_path / "moe.json"
    p.write_text(json.dumps({"meta": {"device": "test-gpu", "commit": "ddd0003"}, "rows": rows}))
    return p


def _dequant_file(tmp_path):
    rows = [{"N": n, "K": k_, "k": k, "backend": b, "us": us}
            for n, k_ in SHAPES for k in (2, 4) for b, us in (("cuda-u4", 50.0), ("triton", 70.0))]
    p = tmp_path / "dequant.json"
    p.write_text(json.dumps({"meta": {"gpu": "test-gpu", "commit": "ccc0004"}, "rows": rows}))
    return p


def test_mma_cells_prefer_newer_file_at_default_config(tmp_path):
    files = [(str(p), json.loads(p.read_text())) for p in (_issue3_file(tmp_path), _mma_file(tmp_path))]
    cells = report.mma_cells(files, _dflt)
    bf = 10.0 * 28672 * 4096 / 4096**2
    c = cells[(28672, 4096, 4, 1)]
    assert c["file"] == "mma-issue3.json" and c["cfg"] == [3, 8, 2, 2] and c["default"]
    assert c["us"] == pytest.approx(bf * 0.15)  # the default config's row, not the faster lab variant
    c = cells[(28672, 4096, 4, 2)]
    assert c["file"] == "mma-final.json" and c["default"] is False and c["default_cfg"] == [3, 8, 2, 2]
    assert c["us"] == pytest.approx(bf * 0.2)
    assert cells[(4096, 4096, 4, 1)]["default"] is True and cells[(4096, 4096, 4, 1)]["bf16_us"] > 0
    assert len(cells) == len(SHAPES) * 4 * 7  # sweep / triton / bf16-activation rows left out
    assert report.mma_cells(files, None)[(28672, 4096, 4, 1)]["file"] == "mma-final.json"


def test_best_option_over_all_sources(tmp_path):
    rep = report.build(_gemv_file(tmp_path), _lab_file(tmp_path), _moe_file(tmp_path),
                       mma_paths=[_issue3_file(tmp_path), _mma_file(tmp_path)],
                       dequant_path=_dequant_file(tmp_path), default_cfg=_dflt)
    best = {(r["N"], r["K"], r["k"], r["M"]): r for r in rep["best"]}
    # mma at 0.2 x bf16 beats gemv (M/4 x bf16) and gemm-fused (0.9 x); at M = 64 mma (3 x) loses to the lab
    assert best[(4096, 14336, 4, 1)]["kernel"] == "mma"
    assert best[(4096, 14336, 4, 16)]["kernel"] == "mma" and best[(4096, 14336, 4, 16)]["file"] == "mma-final.json"
    assert best[(4096, 14336, 4, 64)]["kernel"] == "dequant+cublas"
    assert best[(4096, 14336, 4, 64)]["file"] == "lab.json"
    assert best[(28672, 4096, 4, 1)]["file"] == "mma-issue3.json"
    # baseline bf16: the gemv file at M <= 8, the lab at M >= 16, the mma run only where neither measured
    assert best[(4096, 14336, 4, 1)]["bf16_file"] == "gemv.json"
    assert best[(4096, 14336, 4, 16)]["bf16_file"] == "lab.json"
    assert best[(4096, 4096, 4, 16)]["bf16_file"] == "mma-final.json"
    assert best[(4096, 4096, 4, 16)]["bf16_us"] == pytest.approx(11.0)
    rows = {r["M"]: r for r in rep["block"]["rows"]}
    assert rows[16]["scope"] == "block" and rows[256]["scope"] == "mlp"  # 4096x4096 via the mma bf16
    # M = 1, bf16 10 + 10 + 70 + 35; kbit 0.2 x on q, o, down and 0.15 x on gate_up (issue3 row)
    assert rows[1]["k"][4]["speedup"] == pytest.approx(125 / (0.2 * 55 + 0.15 * 70))
    assert rows[1]["k"][3]["kernels"]["q_proj"] == "mma"  # k = 3 only in the gemv and mma files
    assert rows[1]["k"][4]["files"]["gate_up_proj"] == "mma-issue3.json"
    for r in rep["workload"]["rows"]:  # M = 64: the lab's dequant+cublas (1.25 x) beats mma (3 x)
        assert ("mma" in r["k"][4]["kernel_time_share"]) == (r["users"] < 64)
    m = rep["mma"]
    assert m["cells_by_file"] == {"mma-issue3.json": 1, "mma-final.json": len(SHAPES) * 4 * 7 - 1}
    assert any("28672x4096 k=4 M=2" in x for x in m["not_default"])
    assert m["activation_dtype_check"][0]["bf16_act_us"] < m["activation_dtype_check"][0]["fp16_act_us"]
    d = rep["bf16_mma_vs_baseline"]
    assert d["max_rel"] == pytest.approx(0.1)  # the synthetic mma run's bf16 is 1.1 x the baseline
    moe = {(r["T"], r["plan"]): r for r in rep["moe"]}
    assert moe[(1, "gemv")]["best"] and not moe[(1, "auto")]["best"] and moe[(1024, "grouped_mm")]["best"]
    deq = {(r["N"], r["K"], r["k"]): r for r in rep["dequant"]}
    assert deq[(28672, 4096, 4)]["new_us"] == 50.0 and deq[(28672, 4096, 4)]["triton_us"] == 70.0
    assert deq[(28672, 4096, 4)]["sweep_dequant_us"] is None  # the synthetic lab file has no dequant rows
    roles = [s["role"] for s in rep["sources"]]
    assert roles == ["gemv", "lab", "mma", "mma", "moe", "dequant"]
    md = report.render_markdown(rep)
    for s in ("fff0001", "eee0002", "ddd0003", "ccc0004", "Method notes", "(d) Dequantize", "not today's default",
              "bf16 baselines disagree", "| 28672x4096 |", "**25.0**"):
        assert s in md, s
    json.dumps(report.to_jsonable(rep))


def test_mma_without_default_config_function(tmp_path):
    rep = report.build(_gemv_file(tmp_path), _lab_file(tmp_path), None, mma_paths=[_issue3_file(tmp_path),
                       _mma_file(tmp_path)], dequant_path=None, default_cfg=None)
    assert rep["mma"]["cells_by_file"] == {"mma-final.json": len(SHAPES) * 4 * 7}
    assert "could not be imported" in report.render_markdown(rep)

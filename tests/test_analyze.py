"""kbit analyze: interpolation, workload weights, tables and plots from small synthetic result files (CPU)."""
from __future__ import annotations

import json
import math

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
    rep = report.build(_gemv_file(tmp_path), _lab_file(tmp_path), tmp_path / "missing.json")
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
                 "--moe", "", "--out-md", str(md), "--out-json", str(js)]) == 0
    assert md.read_text().startswith("# kbit workload analysis")
    assert "workload" in json.loads(js.read_text())


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from kbit.analyze import plots

    gemv = json.loads(_gemv_file(tmp_path).read_text())
    lab = json.loads(_lab_file(tmp_path).read_text())
    p = plots.plot_speedup(gemv, lab, tmp_path / "s.png")
    assert p.exists() and p.stat().st_size < 200_000
    q = {"model": "m", "sentences": 4, "rows": [{"method": m, "k": k, "bits": k + 0.25, "loss": 0.1 / k}
                                                for m in ("kbit/nf", "rtn-g128") for k in (2, 3, 4, 5)]}
    p = plots.plot_quality(q, tmp_path / "q.png")
    assert p.exists() and p.stat().st_size < 200_000

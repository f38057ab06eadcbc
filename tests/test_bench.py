"""CPU checks of the benchmark harness: copies for a cold L2, the result schema and file, the table,
routing, the registry and the CLI parsing. No timing here: performance is proven by benchmarks."""
import json
import math
import re

import pytest
import torch

from kbit.bench import candidates, moe, report
from kbit.bench.registry import CANDIDATES, Unsupported, register, select_candidates
from kbit.bench.timing import copies_for_cold_l2, tbps
from kbit.bench.weights import clone_weight, kbit_bytes, stand_in_weight
from kbit.cli import build_parser

L2 = 50 * 1000 * 1000


@pytest.mark.parametrize("nbytes", [1, 4_500_000, 50_000_000, 399_999_999, 400_000_000, 470_000_000, 9e8])
def test_copies_exceed_8x_l2(nbytes):
    nbytes = int(nbytes)
    n = copies_for_cold_l2(nbytes, L2, max_copies=10**9)
    assert n * nbytes > 8 * L2
    assert n >= 2
    if n > 2:  # the fewest that do
        assert (n - 1) * nbytes <= 8 * L2


def test_copies_bad_input():
    with pytest.raises(ValueError, match="bytes_per_copy"):
        copies_for_cold_l2(0, L2)
    with pytest.raises(ValueError, match="at most"):
        copies_for_cold_l2(1000, L2, max_copies=100)


def test_tbps():
    assert tbps(3e6, 1.0) == pytest.approx(3.0)
    assert math.isnan(tbps(1, 0.0))


def _row(**kw):
    row = dict(gpu="h100", commit="abc", kernel="gemv", k=4, blocksize=32, dtype="bfloat16", N=4096, K=4096,
               M=1, E=1, us=10.0, bf16_us=12.0, tbps=2.0, ceiling_tbps=3.0, bytes=9_000_000)
    row.update(kw)
    return row


def _header(**kw):
    h = dict(gpu="h100", gpu_name="NVIDIA H100 80GB HBM3", date="2026-11-21", commit="abc",
             command="kbit bench", torch="2.11", triton="3.6", ceiling_tbps=3.0, ceiling_bytes=2**31, reps=15)
    h.update(kw)
    return h


def test_row_schema():
    report.validate_row(_row())
    report.validate_row(_row(us=None, tbps=None, bf16_us=None))  # a missing measurement is null
    with pytest.raises(ValueError, match="'M'"):
        bad = _row()
        del bad["M"]
        report.validate_row(bad)
    with pytest.raises(ValueError, match="'k': expected int, got float"):
        report.validate_row(_row(k=4.0))
    with pytest.raises(ValueError, match="'N'"):
        report.validate_row(_row(N=True))
    assert set(report.REQUIRED) >= {"gpu", "commit", "kernel", "k", "blocksize", "dtype", "N", "K", "M", "E",
                                    "us", "bf16_us", "tbps", "ceiling_tbps", "bytes"}


def test_results_file_roundtrip(tmp_path):
    path = report.results_path(tmp_path, "NVIDIA H100 80GB HBM3", "bench", date="2026-11-21")
    assert path == tmp_path / "h100" / "bench-2026-11-21.json"
    rows = [_row(), _row(kernel="bf16", k=16, blocksize=0, tbps=float("nan"))]
    report.write_results(path, _header(), rows)
    data = json.loads(path.read_text())  # strict JSON: NaN written as null
    assert data["header"]["gpu"] == "h100"
    assert data["rows"][1]["tbps"] is None
    header, back = report.read_results(path)
    assert back[0] == rows[0] and header["commit"] == "abc"
    # a second run the same day does not overwrite the first
    assert report.results_path(tmp_path, "NVIDIA H100 80GB HBM3", "bench", date="2026-11-21").name == \
        "bench-2026-11-21-2.json"
    with pytest.raises(ValueError, match="header lacks"):
        report.write_results(tmp_path / "x.json", {"gpu": "h100"}, rows)


def test_reading_a_bad_results_file_names_it(tmp_path, capsys):
    """`kbit bench --table` / `--summary` on a missing or broken file: one line naming the file."""
    from kbit.cli import main
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "other.json").write_text('{"a": 1}')
    for name, what in (("gone.json", "got no such file"), ("bad.json", "got unreadable JSON"),
                       ("other.json", "expected an object with 'header' and 'rows'")):
        with pytest.raises((FileNotFoundError, ValueError), match=what):
            report.read_results(tmp_path / name)
        for flag in ("--table", "--summary"):
            assert main(["bench", flag, str(tmp_path / name)]) == 1
            err = capsys.readouterr().err.strip()
            assert name in err and what in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("name, slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "l40s"),
                                        ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),
                                        ("", "unknown-gpu")])
def test_gpu_slug(name, slug):
    assert report.gpu_slug(name) == slug


def test_markdown_table():
    rows = [_row(kernel="gemv", M=4), _row(kernel="bf16", k=16, blocksize=0, us=12.0, M=4),
            _row(M=1, us=None, tbps=None),
            _row(kernel="grouped_gemv", E=128, N=1536, K=2048, M=1, mode="loop")]
    text = report.markdown_table(rows, _header(skipped=["humming: not importable"]))
    lines = text.splitlines()
    assert lines[0].startswith("GPU: NVIDIA H100 80GB HBM3; commit abc")
    table = [ln for ln in lines if ln.startswith("| ")]
    assert table[0].startswith("| kernel | k | B | N x K | M | us | bf16 us | x bf16 | TB/s | % ceiling")
    body = table[1:]
    assert len(body) == 4 and all(ln.count("|") == table[0].count("|") for ln in body)
    # dense first (largest first, then M, bf16 first), MoE last
    assert body[0].startswith("| gemv | 4 | 32 | 4096x4096 | 1 | - |")
    assert body[1].startswith("| bf16 | 16 | - | 4096x4096 | 4 | 12.00 |")
    assert "| 1.20 |" in body[2] and "| 67 |" in body[2]  # x bf16 = 12/10, 2.0 of 3.0 TB/s
    assert body[3].startswith("| grouped_gemv (loop) | 4 | 32 | 128x1536x2048 | 1 |")
    assert "| 3.00 |" in body[2]  # roofline us = 9 MB / 3 TB/s
    assert text.rstrip().endswith("Not measured: humming: not importable")


def test_report_main(tmp_path, capsys):
    path = report.write_results(tmp_path / "r.json", _header(), [_row()])
    assert report.main([str(path)]) == 0
    assert "| gemv | 4 | 32 | 4096x4096 | 1 | 10.00 |" in capsys.readouterr().out


def test_routing():
    r = moe.make_routing(tokens=4, topk=8, E=128, seed=3)
    assert r.expert_ids.shape == (32,) and r.expert_ids.dtype == torch.int32
    assert torch.all(r.expert_ids[1:] >= r.expert_ids[:-1])
    assert r.offsets.shape == (128,) and int(r.offsets[-1]) == 32
    assert r.touched == tuple(sorted(set(r.expert_ids.tolist())))
    for t in range(4):  # each token's experts are distinct
        mine = r.expert_ids[r.token_ids == t]
        assert len(set(mine.tolist())) == 8
    spans = moe.groups(r)
    assert sum(e - s for _, s, e in spans) == 32
    assert all(bool((r.expert_ids[s:e] == ex).all()) for ex, s, e in spans)
    assert moe.make_routing(4, 8, 128, seed=3).touched == r.touched  # seeded
    with pytest.raises(ValueError, match="topk"):
        moe.make_routing(1, 9, 8)


def test_bf16_grouped_matches_reference():
    torch.manual_seed(0)
    E, N, K = 16, 24, 32
    w = torch.randn(E, N, K).to(torch.bfloat16)
    r = moe.make_routing(tokens=3, topk=4, E=E, seed=1)
    a = torch.randn(12, K).to(torch.bfloat16)
    ref = moe.reference(a, w, r)
    for fn in (moe.bf16_loop(w, r), moe.bf16_grouped(w, r)[0]):
        try:
            y = fn(a)
        except RuntimeError as e:  # _grouped_mm may have no CPU kernel in this torch
            pytest.skip(f"no CPU _grouped_mm: {e}")
        assert ((y.float() - ref).norm() / ref.norm()) < 1e-2


def test_kbit_bytes_and_clone():
    qw = stand_in_weight((4, 64, 96), k=3, blocksize=32, device="cpu")
    assert qw.codes.shape == (4, 64, 96 * 3 // 32) and qw.scales.shape == (4, 64, 3)
    per_expert = 64 * 9 * 4 + 64 * 3 + 4
    assert kbit_bytes(qw) == 4 * per_expert + 8 * 4
    assert kbit_bytes(qw, experts=[0, 2]) == 2 * per_expert + 8 * 4
    c = clone_weight(qw)
    assert c is not qw and c.codes.data_ptr() != qw.codes.data_ptr() and torch.equal(c.codes, qw.codes)
    assert (c.k, c.blocksize, c.shape) == (qw.k, qw.blocksize, qw.shape)


def test_registry():
    assert candidates.register is register  # the built-ins register in the one registry
    assert {"gemv", "dequant+bf16", "dummy-linear", "grouped_gemv"} <= set(CANDIDATES)
    assert [c.name for c in select_candidates("dense")] == [c.name for c in CANDIDATES.values()
                                                 if c.kind == "dense" and c.default]
    assert [c.name for c in select_candidates("dense", "dummy-linear")] == ["dummy-linear"]
    assert {c.name for c in select_candidates("moe", "all")} >= {"grouped_gemv"}
    with pytest.raises(ValueError, match="unknown candidates"):
        select_candidates("dense", "nope")
    with pytest.raises(ValueError, match="already registered"):
        register("gemv")(lambda qw, M: None)

    @register("test-only-candidate", default=False)
    def _factory(qw, M):
        raise Unsupported("M too large")
    try:
        with pytest.raises(Unsupported, match="M too large"):
            CANDIDATES["test-only-candidate"].factory(None, 4096)
    finally:
        del CANDIDATES["test-only-candidate"]


def test_cli_parses_bench():
    args = build_parser().parse_args(["bench", "--shapes", "28672x4096,4096x14336", "--m", "1,2,4,8",
                                      "--k", "2,4", "--peers", "humming,tinygemm", "--moe", "none",
                                      "--out", "x"])
    assert args.shapes == [(28672, 4096), (4096, 14336)]
    assert args.m == [1, 2, 4, 8] and args.k == [2, 4] and args.moe == []
    assert args.peers == "humming,tinygemm" and args.out == "x" and not args.floor
    assert build_parser().parse_args(["bench", "--floor"]).floor
    defaults = build_parser().parse_args(["bench"])
    assert len(defaults.shapes) == 5 and len(defaults.moe) == 2 and defaults.tokens == [1, 4]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--shapes", "28672by4096"])


@pytest.mark.parametrize("argv,message", [
    (["bench", "--k", "7"], "argument --k: expected bits in (2, 3, 4, 5), got [7]"),
    (["bench", "--k", "4,1"], "argument --k: expected bits in (2, 3, 4, 5), got [1]"),
    (["bench", "--k", ","], "argument --k: expected a comma list of integers, got ','"),
    (["bench", "--m", "1,0"], "argument --m: expected integers >= 1, got [0]"),
    (["bench", "--tokens", "-4"], "argument --tokens: expected integers >= 1, got [-4]"),
    (["bench", "--shapes", "0x4096"], "argument --shapes: shape '0x4096': expected N and K >= 1"),
    (["bench", "--blocksize", "48"], "argument --blocksize: invalid choice: 48"),
    (["tune", "--k", "6"], "argument --k: expected bits in (2, 3, 4, 5), got [6]"),
    (["tune", "--m", "0"], "argument --m: expected integers >= 1, got [0]"),
    (["tune", "--shapes", "4096by4096"], "argument --shapes: shape '4096by4096': expected NxK, e.g. 28672x4096"),
    (["bench", "--suite", "nosuch"], "argument --suite: expected one of ['models'], got 'nosuch'"),
    (["bench", "--suite-parts", ","], "argument --suite-parts: expected a comma list of names, got ','"),
    (["bench", "--max-shapes", "0"], "argument --max-shapes: expected an integer >= 1, got 0"),
    (["bench", "--budget-s", "-1"], "argument --budget-s: expected a number > 0, got '-1'"),
    (["tune", "--suite", "nosuch"], "argument --suite: expected one of ['models'], got 'nosuch'"),
    (["tune", "--kernels", "mma,cutlass"],
     "argument --kernels: expected a subset of mma,large,fused,gemv,dequant_mm, got ['cutlass']"),
    (["tune", "--max-shapes", "0"], "argument --max-shapes: expected an integer >= 1, got 0"),
    (["tune", "--reps", "x"], "argument --reps: expected an integer >= 1, got 'x'"),
    (["tune", "--build-workers", "-1"], "argument --build-workers: expected an integer >= 0, got -1"),
    (["tune", "--budget-s", "nan"], "argument --budget-s: expected a number > 0, got 'nan'")])
def test_cli_rejects_bad_lists_before_any_gpu_work(capsys, argv, message):
    """Bits, rows, tokens, shapes, suites, counts and budgets are checked as the command line is parsed: a one-line
    usage error naming the option, on a machine with or without a GPU (the GPU check comes later)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kw,message", [
    (dict(ks=(4, 6)), "k: expected one of (2, 3, 4, 5), got 6"), (dict(ms=(0,)), "ms[0]: expected an int in [1, inf]"),
    (dict(tokens=(1, -1)), "tokens[1]: expected an int in [1, inf], got -1"),
    (dict(shapes=((4096, 0),)), "shapes[0].K: expected an int in [1, inf], got 0"),
    (dict(blocksize=48), "blocksize: expected one of (32, 64, 128), got 48"),
    (dict(reps=0), "reps: expected an int in [1, inf], got 0")])
def test_bench_config_rejects_bad_values(kw, message):
    from kbit.bench.run import BenchConfig
    with pytest.raises(ValueError, match=re.escape(message)):
        BenchConfig(**kw)


def test_cli_table(tmp_path, capsys):
    from kbit.cli import main
    path = report.write_results(tmp_path / "r.json", _header(), [_row()])
    assert main(["bench", "--table", str(path)]) == 0
    assert "4096x4096" in capsys.readouterr().out


def test_read_floor_bad_input():
    from kbit.bench.floor import measure_read_floor
    with pytest.raises(ValueError, match="nbytes"):
        measure_read_floor(8, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_read_floor_runs():
    """Every variant runs and the fastest is kept (not a timed test: no speed is asserted)."""
    from kbit.bench.floor import VARIANTS, measure_read_floor
    f = measure_read_floor(3_000_016, reps=3)
    assert f.nbytes == 3_000_016 and len(f.variants) == len(VARIANTS) + 1
    assert f.us == min(f.variants.values()) or math.isclose(f.us, min(f.variants.values()), rel_tol=1e-3)
    assert f.read_tbps > 0 and f.best in f.variants

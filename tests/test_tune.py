"""The config tuner without a GPU: search spaces (kbit.tuning.space), tuned tables and the fitted rule
(kbit.tuning.tuned), and ``kbit tune``'s driver with a fake timer (kbit.bench.tune)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from kbit import options
from kbit.bench import tune as T
from kbit.tuning.gemm import GemmConfig
from kbit.tuning.mma import LargeConfig, MmaConfig
from kbit.tuning.mma_plan import make_plan
from kbit.tuning.space import FAMILIES, Candidate, candidate_from_dict, search_space
from kbit.tuning.tuned import (
    Trial,
    TunedTable,
    default_path,
    evaluate,
    fit_rules,
    reload_tuned,
    rule_matches,
    serving_bucket,
    tuned_candidate,
)


class _FakeKernel:
    num_regs = 64

    def __init__(self, defines):
        self.defines = defines

    def occupancy(self, threads, shared):
        return max(1, min(self.defines.get("MINB", 1), 2048 // threads, (228 * 1024) // (shared + 1024)))


@pytest.mark.parametrize("M", [1, 4, 16, 64, 256, 1024])
def test_search_space_families(M):
    cands = search_space(4, M, 5120, 25600)
    fams = {c.family for c in cands}
    assert fams == {f for f, ok in (("mma", M <= 256), ("large", M > 8), ("fused", M > 8),
                                    ("dequant_mm", M > 8)) if ok}
    assert len({c.key for c in cands}) == len(cands)  # no duplicates
    quick = search_space(4, M, 5120, 25600, quick=True)
    assert {c.key for c in quick} <= {c.key for c in cands} and len(quick) < len(cands)
    # on sm_90 the quick space keeps the families that came near the best (fused never; mma up to M = 64)
    assert {c.family for c in quick} == fams & {"mma", "large", "dequant_mm"} - ({"mma"} if M > 64 else set())
    assert ("dequant_mm" in {c.family for c in quick}) == (M > 8)  # dequantize + cuBLAS: always a candidate
    assert {c.family for c in search_space(4, M, 5120, 25600, quick=True, sm90=False)} == fams - {"large"}
    if M > 4:  # kernel 4 serves two or more token groups only
        assert any(c.family == "mma" and c.config.kernel == 4 for c in cands) == (M > 8 and M <= 256)


def test_search_space_backends_and_errors():
    assert {c.family for c in search_space(3, 1, 4096, 4096, cuda=False)} == {"gemv"}
    assert {c.family for c in search_space(3, 64, 4096, 4096, sm90=False)} == {"mma", "fused", "dequant_mm"}
    assert [c.family for c in search_space(2, 512, 4096, 4096, families=("dequant_mm",))] == ["dequant_mm"]
    with pytest.raises(ValueError, match="families"):
        search_space(4, 1, 64, 64, families=("cutlass",))
    with pytest.raises(ValueError, match="family"):
        Candidate("cutlass")
    with pytest.raises(TypeError, match="config"):
        Candidate("mma", GemmConfig())
    with pytest.raises(TypeError, match="config"):
        Candidate("dequant_mm", GemmConfig())


@pytest.mark.parametrize("k,M,N,K", [(2, 1, 5120, 25600), (4, 16, 2880, 2880), (5, 64, 28672, 4096),
                                     (3, 256, 4096, 14336), (4, 1024, 576, 7168)])
def test_search_space_plans(k, M, N, K):
    """Most CUDA configs of the space plan on an H100 (a refusal is a ValueError naming the config)."""
    planned = refused = 0
    for c in search_space(k, M, N, K):
        if c.family not in ("mma", "large"):
            continue
        m = min(M, 64) if c.family == "mma" else M
        try:
            make_plan(k, m, N, K, "log8", c.config, sms=132, build=lambda kernel, d: _FakeKernel(d))
            planned += 1
        except ValueError as e:
            assert "config" in str(e)
            refused += 1
    assert planned >= 4 * refused


def test_candidate_round_trip():
    for c in search_space(4, 64, 8192, 8192) + search_space(4, 2, 8192, 8192, cuda=False):
        d = json.loads(json.dumps(c.as_dict()))
        assert candidate_from_dict(d) == c and candidate_from_dict(d).key == c.key
    with pytest.raises(ValueError, match="family"):
        candidate_from_dict({"family": "x"})


def _cands():
    return [Candidate("mma", MmaConfig(1, 8, min_ctas=2)), Candidate("mma", MmaConfig(3, 8, min_ctas=2, ring=2)),
            Candidate("large", LargeConfig(warps=8, groups=4)), Candidate("dequant_mm")]


def _fake_us(cand: Candidate, N: int, K: int, M: int) -> float:
    """A made-up cost model: kernel 3 wins on big weights, kernel 1 on small, dequant_mm at large M."""
    base = N * K / 1e6
    if cand.family == "dequant_mm":
        return base + 50 + M * 0.01
    if cand.family == "large":
        return base * 1.2 + M * 0.02
    if cand.config.kernel == 3:
        return base * (0.9 if N * K >= 5 * 10**7 else 1.3) + M * 0.1
    if N == 4096 and K == 4096:
        raise RuntimeError("shared memory")
    return base + M * 0.1


def _table(shapes, ms=(1, 16, 1024)) -> TunedTable:
    t = TunedTable("h100", {"sms": 132})
    for N, K in shapes:
        for M in ms:
            trials = T.tune_entry(4, N, K, M, _cands(), lambda c, N=N, K=K, M=M: _fake_us(c, N, K, M))
            t.add(4, N, K, M, trials, current_us=1.1 * min(x.us for x in trials if x.us))
    return t


TUNE = [(28672, 4096), (4096, 14336), (6144, 4096), (2048, 2048), (57344, 8192)]
HELD = [(25600, 5120), (5120, 5120), (3072, 3072), (4096, 4096)]


def test_tune_entry_failures_and_deadline():
    trials = T.tune_entry(4, 4096, 4096, 1, _cands(), lambda c: _fake_us(c, 4096, 4096, 1))
    assert [t.us is None for t in trials] == [True, False, False, False]
    assert T.tune_entry(4, 64, 64, 1, _cands(), lambda c: 1.0, deadline=0.0) is None
    with pytest.raises(ValueError, match="trials"):
        TunedTable("h100").add(4, 64, 64, 1, [Trial(_cands()[0], None)])


def test_table_round_trip_and_lookup(tmp_path):
    t = _table(TUNE)
    fit_rules(t)
    path = t.save(tmp_path / "h100.json")
    u = TunedTable.load(path)
    assert u.as_dict() == t.as_dict() and u.meta["sms"] == 132
    # exact entry: the fastest trial of the tuned bucket that serves M (M = 9..16: bucket 16)
    best = min((x for x in t.trials((4, 28672, 4096, 16)) if x.us), key=lambda x: x.us).candidate
    assert u.lookup(4, 16, 28672, 4096) == best and u.lookup(4, 9, 28672, 4096) == best
    assert u.lookup(4, 1, 28672, 4096) == Candidate("mma", MmaConfig(3, 8, min_ctas=2, ring=2))
    assert u.lookup(3, 1, 28672, 4096) is None  # k = 3 never tuned, no rule
    assert u.lookup(4, 1, 1000, 1000) is not None  # untuned shape: the rule, never a search
    with pytest.raises(ValueError, match="format"):
        TunedTable.from_dict({"format": "other"})


def test_serving_bucket_and_rule_ranges():
    tuned = (1, 8, 16, 64, 1024, 4096)
    got = {M: serving_bucket(tuned, M) for M in (1, 2, 3, 8, 9, 16, 17, 33, 64, 65, 257, 1024, 1025, 5000)}
    assert got == {1: 1, 2: 8, 3: 8, 8: 8, 9: 16, 16: 16, 17: None, 33: 64, 64: 64, 65: None, 257: None,
                   1024: 1024, 1025: None, 5000: 4096}  # above 16 rows only M's own bucket
    assert serving_bucket((16, 256), 1) is None and serving_bucket((16, 256), 300) is None
    assert serving_bucket((1, 16), 2) == 16 and serving_bucket((1, 32), 2) is None
    t = _table(TUNE[:2], ms=(1, 8, 64, 4096))
    ranges = {(r["if"].get("M_min"), r["if"].get("M_max")) for r in fit_rules(t)}
    assert ranges == {(1, 1), (2, 8), (33, 64), (2049, None)}
    for M, b in ((1, 1), (2, 8), (5, 8), (40, 64), (3000, 4096), (9000, 4096), (9, None), (20, None), (100, None)):
        assert TunedTable("h100", {}).bucket(4, M) is None and t.bucket(4, M) == b
        rules = [r for r in t.rules if rule_matches(r["if"], 4, M, 28672, 4096)]  # the rules cover the same M
        assert bool(rules) == (b is not None)


def test_fit_and_evaluate_held_out():
    tune, held = _table(TUNE), _table(HELD)
    rules = fit_rules(tune)
    assert rules and all(set(r) >= {"if", "family", "config", "fit"} for r in rules)
    assert any(rule_matches(r["if"], 4, 1, 25600, 5120) for r in rules)
    ev = evaluate(rules, held)
    assert ev["entries"] == len(HELD) * 3 and ev["covered"] >= ev["entries"] - 1
    assert ev["median"] == pytest.approx(1.0) and ev["worst"] < 1.5 and ev["vs_current_median"] >= 1.0
    assert all(r["M"] in (1, 16, 1024) for r in ev["rows"])
    with pytest.raises(ValueError, match="condition"):
        rule_matches({"sm99": True}, 4, 1, 1, 1)


def test_summary_lines():
    lines = T.summary_lines(_table(TUNE[:1], ms=(1,)))
    assert len(lines) == 3 and "28672x4096" in lines[2] and "1.10x" in lines[2]
    assert T.evaluation_lines(evaluate([], _table(TUNE[:1])), "x")[0].startswith("fitted rule on x: 0 of 3")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kbit tune")
    T.configure(p)
    return p


def test_cli_shapes(tmp_path):
    args = _parser().parse_args(["--suite", "models", "--split", "held-out", "--families", "qwen3", "--k", "2,4",
                                 "--m", "1,16", "--max-shapes", "4", "--quick"])
    shapes = T.shapes_from_args(args)
    assert len(shapes) == 4 and (151936, 5120) in shapes and args.k == [2, 4] and args.quick
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 4096, "intermediate_size": 14336,
                                                   "num_attention_heads": 32, "num_key_value_heads": 8,
                                                   "vocab_size": 128256}))
    shapes = T.shapes_from_args(_parser().parse_args(["--model", str(model)]))
    assert set(shapes) == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)}
    with pytest.raises(ValueError, match="exactly one"):
        T.shapes_from_args(_parser().parse_args(["--shapes", "64x64", "--suite", "models"]))
    with pytest.raises(ValueError, match="config.json"):
        T.shapes_from_args(_parser().parse_args(["--model", str(tmp_path / "none")]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["--shapes", "64by64"])


def test_cli_fit(tmp_path, capsys):
    tune, held = tmp_path / "t.json", tmp_path / "h.json"
    _table(TUNE).save(tune)
    _table(HELD).save(held)
    args = _parser().parse_args(["--fit", str(tune), "--evaluate", str(held)])
    assert T.main(args) == 0
    out = capsys.readouterr().out
    assert f"fitted rule on {held}" in out and TunedTable.load(tune).rules


def test_cli_fit_bad_paths_name_the_option_and_leave_the_table(tmp_path):
    """A missing --fit or --evaluate file is a ValueError naming the option; a bad --evaluate is found before the
    fitted rule is written into --fit's file; --evaluate and --package without --fit are refused, not ignored."""
    tune = tmp_path / "t.json"
    _table(TUNE).save(tune)
    before = tune.read_bytes()
    with pytest.raises(ValueError, match=r"--fit: expected a tuned table JSON file .*none\.json"):
        T.main(_parser().parse_args(["--fit", str(tmp_path / "none.json")]))
    with pytest.raises(ValueError, match=r"--evaluate: expected a tuned table JSON file .*gone\.json"):
        T.main(_parser().parse_args(["--fit", str(tune), "--evaluate", str(tmp_path / "gone.json")]))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json"):
        T.main(_parser().parse_args(["--fit", str(tune), "--evaluate", str(tmp_path / "bad.json")]))
    assert tune.read_bytes() == before
    for extra in (["--evaluate", str(tune)], ["--package", str(tmp_path / "p.json")]):
        with pytest.raises(ValueError, match=f"{extra[0]}: only with --fit"):
            T.main(_parser().parse_args(["--shapes", "64x64", *extra]))


def test_default_path(tmp_path):
    with options.override(cache_dir=str(tmp_path)):
        assert default_path("h100") == tmp_path / "tuned" / "h100.json"


def test_families_constant():
    assert FAMILIES == ("mma", "large", "fused", "gemv", "dequant_mm")


def test_tuned_candidate_from_cache(tmp_path):
    """The dispatcher's hook on a GPU kbit ships no table for: None without a table; the table's entry, then its
    rule, once one is in the cache."""
    with options.override(cache_dir=str(tmp_path)):
        assert tuned_candidate(4, 16, 28672, 4096, "l40s") is None
        t = _table(TUNE)
        fit_rules(t)
        t.save(default_path("l40s"))
        reload_tuned()  # the table is read once a process
        want = t.lookup(4, 16, 28672, 4096)
        assert want is not None and tuned_candidate(4, 16, 28672, 4096, "l40s") == want
        assert tuned_candidate(4, 1, 777, 4096, "l40s") is not None  # the fitted rule
        assert tuned_candidate(4, 16, 28672, 4096, "a100") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_tune_small_shape(tmp_path):
    """The tuner on a GPU: every quick candidate of two M buckets is timed (or refused with a reason), the best is
    stored beside the dispatcher's time, and the table reloads (no speed is asserted)."""
    table = TunedTable("test")
    done = T.tune_shapes(table, [(4096, 4096)], [4], [1, 16], quick=True, reps=3,
                         save=lambda t: t.save(tmp_path / "t.json"))
    assert done == [(4, 4096, 4096, 1), (4, 4096, 4096, 16)]
    for key in done:
        e = table.entries[key]
        assert e["best"]["us"] > 0 and e["current_us"] > 0
        assert sum(t["us"] is not None for t in e["trials"]) >= len(e["trials"]) // 2
    assert TunedTable.load(tmp_path / "t.json").as_dict() == table.as_dict()


class _FakeMeasure:
    """Stands for :class:`kbit.bench.tune.Measure`: the made-up cost model instead of a GPU."""

    def __init__(self, N, K):
        self.N, self.K, self.M = N, K, None

    def set_m(self, M, seed):
        self.M = M
        return 1.25 * _fake_us(Candidate("dequant_mm"), self.N, self.K, M)

    def __call__(self, cand):
        if cand is None:  # the dispatcher
            return 1.25 * _fake_us(Candidate("dequant_mm"), self.N, self.K, self.M)
        return _fake_us(cand, self.N, self.K, self.M)


def test_tune_shapes_loop(tmp_path):
    """The driver's loop without a GPU: entries per (shape, k, M bucket), saved after each, skipped when present,
    measured again with ``retune``, none started past the budget."""
    saved = []
    kw = dict(measure_for=lambda N, K, k: _FakeMeasure(N, K), cuda=True, sm90=True, quick=True,
              save=lambda t: saved.append(len(t.entries)))
    table = TunedTable("h100")
    done = T.tune_shapes(table, [(28672, 4096), (2048, 2048)], [2, 4], [1, 3, 16], **kw)
    assert len(done) == 2 * 2 * 3 and saved == list(range(1, 13))
    assert (4, 28672, 4096, 4) in table.entries  # M = 3 is stored under its bucket
    assert all(e["current_us"] > 0 for e in table.entries.values())
    assert T.tune_shapes(table, [(28672, 4096)], [4], [1, 16], **kw) == []
    assert len(T.tune_shapes(table, [(28672, 4096)], [4], [1, 16], retune=True, **kw)) == 2
    assert T.tune_shapes(table, [(5120, 5120)], [4], [1], budget_s=-1, **kw) == []


def test_code_digests(tmp_path):
    """A family's digest covers its files and the CUDA headers they include: changing a shared header changes the
    CUDA families' digests and not the Triton ones'; every listed file exists; every CUDA kernel the small-M and
    kernel-7 plans build belongs to a family."""
    from kbit.tuning import code as C
    from kbit.tuning.mma_plan import KERNELS

    for fam in FAMILIES:
        assert all((C.PACKAGE / f).is_file() for f in C.code_files(fam)), fam
    assert "cuda/csrc/common.cuh" in C.code_files("mma") and "cuda/csrc/splitk.cuh" in C.code_files("large")
    assert {f"cuda/csrc/{f}" for f, _ in KERNELS.values()} <= set(C.code_files("mma")) | set(C.code_files("large"))
    for fam in FAMILIES:  # a copy of the package's files, one header then changed
        for rel in C.code_files(fam):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_bytes((C.PACKAGE / rel).read_bytes())
    before = {f: C.code_digest(f, tmp_path) for f in FAMILIES}
    assert before == {f: C.code_digest(f) for f in FAMILIES} == C.family_digests(FAMILIES)
    header = tmp_path / "cuda/csrc/common.cuh"
    header.write_text(header.read_text() + "\n#define KBIT_TEST_X 1\n")  # code: a comment would not count
    after = {f: C.code_digest(f, tmp_path) for f in FAMILIES}
    assert {f for f in FAMILIES if after[f] != before[f]} == {"mma", "large"}
    with pytest.raises(ValueError, match="family: expected one of"):
        C.code_digest("nope")


def _edit(path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) >= count, (path, old)
    path.write_text(text.replace(old, new, count))


def test_code_digests_follow_code_not_layout(tmp_path):
    """A family's digest covers what its code does: comments, docstrings and whitespace do not change it, in a CUDA
    source or in Python; a define's value, a statement or an asm string do. A ``//`` or ``/*`` inside a string
    literal is no comment (the literal stays whole), and a quote inside a comment opens no literal."""
    from kbit.tuning import code as C

    files = C.code_files("large")
    root = tmp_path / "kbit"
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes((C.PACKAGE / rel).read_bytes())
    cu, py = root / "cuda/csrc/wgmma.cu", root / "tuning/mma_plan.py"

    def digest():
        return C.code_digest("large", root)

    def reset():  # back to the package's files (an edit may have changed the includes: the list stays the package's)
        for rel in files:
            (root / rel).write_bytes((C.PACKAGE / rel).read_bytes())

    before = digest()
    same = [  # (file, old, new): comment, docstring and whitespace edits
        (cu, "#define GM 8 ", "#define GM 8 // the raster group, isn't it\n//\n "),
        (cu, "#define AB 2                /* A register buffers", "#define AB 2 /* a buffer's "),
        (cu, "kbit_wgmma: the large-M", "kbit_wgmma (edited): the large-M"),
        (cu, "#define LAG (AB / 2 + 1)", "\n\n  #define   LAG\t(AB /  2 + 1)   \n"),
        (cu, "  asm volatile(", "      asm volatile(", 3),
        (cu, "__device__ __forceinline__ void wg_fence()", "__device__\n__forceinline__   void wg_fence()"),
        (py, '    """(defines, dynamic shared bytes) of kernel 7', '    """Edited. (defines, bytes) of kernel 7'),
        (py, '"""', '"""A module docstring edited. '),
        (py, "from __future__", "# a comment\n\n\nfrom __future__"),
        (py, "def x_staged(k: int, M: int, S: int, cfg: MmaConfig) -> bool:",
         "def x_staged(k: int,\n              M: int, S: int,  cfg: MmaConfig)   -> bool:  # comment"),
    ]
    for edit in same:
        _edit(*edit)
        assert digest() == before, edit[1:]
    reset()
    changed = [  # a define's value, a statement, an asm string
        (cu, "#define GM 8 ", "#define GM 4 "),
        (cu, "#define AB 2 ", "#define AB 2 + 1 "),
        (cu, "#define SK 0 /*", "#define SK 0\n#define SK2 0 /*"),
        (cu, '"wgmma.fence.sync.aligned;"', '"wgmma.fence.sync.aligned; "'),
        (cu, '"wgmma.commit_group.sync.aligned;"', '"wgmma.commit_group.sync.aligned;//"'),
        (py, "    xc = 8 * cfg.groups * 128", "    xc = 8 * cfg.groups * 256"),
        (py, "from __future__ import annotations\n", "from __future__ import annotations\nX = 1\n"),
    ]
    for edit in changed:
        _edit(*edit)
        assert digest() != before, edit[1:]
        reset()
    assert digest() == before
    # "//" and "/*" inside string literals: were they comments, x and y (after them) would not count
    for line in ('void f() {{ asm volatile("a // {}"); }}', 'const char* s = "a /* {} */ b";'):
        _edit(cu, "#define GM 8 ", line.format("x") + "\n#define GM 8 ")
        one = digest()
        reset()
        _edit(cu, "#define GM 8 ", line.format("y") + "\n#define GM 8 ")
        assert digest() != one, line
        reset()
    # a quote as a character literal opens no string: the comment after it does not count
    _edit(cu, "#define GM 8 ", "char q = '\"'; // x\n#define GM 8 ")
    one = digest()
    reset()
    _edit(cu, "#define GM 8 ", "char q = '\"'; // y\n#define GM 8 ")
    assert digest() == one
    reset()
    # a quote in a comment opens no literal: the code after it still counts
    _edit(cu, "#define GM 8 ", "/* a warp's */ #define GM 8 ")
    assert digest() == before
    _edit(cu, "/* a warp's */ #define GM 8 ", "/* a warp's */ #define GM 9 ")
    assert digest() != before


def test_stale_entries_and_retune_stale(tmp_path, capsys):
    """An entry records the digests of the families it timed; it is stale when they differ from the files now or
    when it recorded none (a table from before the digests); ``retune_stale`` measures those again, and
    ``kbit tune --fit`` counts them. The packaged form keeps the digests; a malformed one is refused on load."""
    kw = dict(measure_for=lambda N, K, k: _FakeMeasure(N, K), cuda=True, sm90=True, quick=True)
    table = TunedTable("h100")
    T.tune_shapes(table, [(28672, 4096), (2048, 2048)], [4], [1, 16], **kw)
    keys = sorted(table.entries)
    fams = {t.candidate.family for t in table.trials(keys[0])}
    assert set(table.entries[keys[0]]["code"]) == fams and not any(table.stale(key) for key in keys)
    assert T.tune_shapes(table, [(28672, 4096), (2048, 2048)], [4], [1, 16], retune_stale=True, **kw) == []
    del table.entries[keys[0]]["code"]  # tuned before the digests
    fam = next(iter(table.entries[keys[1]]["code"]))
    table.entries[keys[1]]["code"][fam] = "0" * 16  # tuned on other kernel code
    assert [table.stale(key) for key in keys[:3]] == [True, True, False]
    packed = TunedTable.from_dict(table.packaged().as_dict())
    assert [packed.stale(key) for key in keys] == [table.stale(key) for key in keys]
    path = table.save(tmp_path / "t.json")
    assert T.main(_parser().parse_args(["--fit", str(path)])) == 0
    assert "2 of 4 entries were timed on other kernel code" in capsys.readouterr().out
    redone = T.tune_shapes(table, [(28672, 4096), (2048, 2048)], [4], [1, 16], retune_stale=True, **kw)
    assert sorted(redone) == keys[:2] and not any(table.stale(key) for key in keys)
    d = table.as_dict()
    d["entries"]["4"]["2048x2048"]["1"]["code"] = ["mma"]
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="expected code as"):
        TunedTable.load(tmp_path / "bad.json")

"""Tuned tables shipped with kbit and what ``kbit tune`` may try (CPU): the lookup order (the user's table, then the
shipped one, then none), a damaged shipped file, the packaged form; configs that cannot launch left out of the
space (kernel 3's x slices, the CTA-local fix-up's static shared slots); the shape order of a budgeted run; the
builds made ahead; the per-point dispatcher report."""
from __future__ import annotations

import argparse
import json
import types

import pytest
import torch

from kbit import options
from kbit.bench import dispatch_points as DP
from kbit.bench import suite as S
from kbit.bench import tune as T
from kbit.bench.tune_build import candidate_builds
from kbit.ops import gemv_mma
from kbit.tuning import mma_units as TU
from kbit.tuning import tuned
from kbit.tuning.mma import LargeConfig, MmaConfig
from kbit.tuning.mma_plan import check_config, make_plan, x_staged
from kbit.tuning.space import Candidate, candidate_from_dict, infeasible, search_space
from kbit.tuning.tables import gpu_key
from kbit.tuning.tuned import NK_EDGES, Trial, TunedTable, default_path, evaluate, reload_tuned, tuned_candidate
from kbit.utils import device as udev

K1 = Candidate("mma", MmaConfig(1, 8, min_ctas=2))
K3 = Candidate("mma", MmaConfig(3, 8, min_ctas=2, ring=2, x_smem=True))
K7 = Candidate("large", LargeConfig(warps=8, groups=16))
DQ = Candidate("dequant_mm")
XSLICE = MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True, x_slice=8)


class _FakeKernel:
    num_regs = 64

    def __init__(self, defines):
        self.defines = defines

    def occupancy(self, threads, shared):
        return max(1, min(self.defines.get("MINB", 1), 2048 // threads, (228 * 1024) // (shared + 1024)))


def _table(gpu: str, entries: dict, rules=()) -> TunedTable:
    t = TunedTable(gpu, {"sms": 132})
    for (k, M, N, K), (best, other) in entries.items():
        t.add(k, N, K, M, [Trial(best, 10.0), Trial(other, 20.0)], current_us=15.0)
    t.rules = list(rules)
    return t


def _rule(cand: Candidate, **cond) -> dict:
    return {"if": cond, **cand.as_dict(), "fit": {"shapes": 1, "geomean_slowdown": 1.0}}


@pytest.fixture
def shipped(monkeypatch, tmp_path):
    """``ship(table)`` writes a table as the one kbit ships for its GPU (package data in a temporary folder); the
    cache directory is a second temporary folder, empty."""
    configs, cache = tmp_path / "configs", tmp_path / "cache"
    configs.mkdir()
    monkeypatch.setattr(tuned, "_CONFIGS", configs)
    reload_tuned()

    def ship(table: TunedTable):
        table.packaged().save(tuned.packaged_path(table.gpu))
        reload_tuned()
        return tuned.packaged_path(table.gpu)

    with options.override(cache_dir=str(cache)):
        yield ship
    reload_tuned()


def test_lookup_order_user_then_shipped_then_none(shipped):
    assert tuned_candidate(4, 16, 28672, 4096, "h200") is None  # nothing shipped, no user table
    path = shipped(_table("h200", {(4, 16, 28672, 4096): (K3, K1), (4, 256, 28672, 4096): (K7, DQ)},
                          rules=[_rule(DQ, k=[4], M_min=129, M_max=256)]))
    assert path.name == "tuned-h200.json" and path.parent == tuned._CONFIGS
    assert tuned_candidate(4, 16, 28672, 4096, "h200") == K3  # the shipped entry
    assert tuned_candidate(4, 200, 5120, 5120, "h200") == K7  # a shape never tuned: the nearest tuned shape's pick
    assert tuned_candidate(2, 200, 5120, 5120, "h200") is None  # no k = 2 entry, no k = 2 rule
    assert tuned_candidate(4, 1, 5120, 5120, "h200") is None  # no entry of M's bucket, no rule
    assert tuned_candidate(4, 16, 28672, 4096, "h100") is None  # a GPU kbit ships no table for
    # the user's own table wins where it answers; an entry of the very shape (either table) before a generalisation
    _table("h200", {(4, 16, 28672, 4096): (K1, K3), (4, 1, 8192, 8192): (K3, K1)},
           rules=[_rule(DQ, k=[4], M_min=129, M_max=256, N_min=8192)]).save(default_path("h200"))
    reload_tuned()
    assert tuned_candidate(4, 16, 28672, 4096, "h200") == K1  # the user's entry
    assert tuned_candidate(4, 16, 7680, 5120, "h200") == K1  # the user's nearest shape
    assert tuned_candidate(4, 1, 5120, 5120, "h200") == K3  # the user's nearest shape (the shipped one has none)
    assert tuned_candidate(4, 200, 28672, 5120, "h200") == DQ  # the user's rule (N >= 8192)
    assert tuned_candidate(4, 200, 5120, 5120, "h200") == K7  # the user's rule does not match: the shipped nearest
    assert tuned_candidate(4, 256, 28672, 4096, "h200") == K7  # the shipped entry before the user's rule


@pytest.mark.parametrize("text", ['{"format": "kbit-tuned", "version": 1, "gpu": "h200", "entries": {"4": {', "[]",
                                  '{"format": "other", "version": 1, "gpu": "h200"}',
                                  '{"format": "kbit-tuned", "version": 1, "gpu": "h200", "rules": '
                                  '[{"if": {"k": [4], "color": 1}, "family": "dequant_mm", "config": null}]}',
                                  '{"format": "kbit-tuned", "version": 1, "gpu": "h200", "entries": {"4": {"64x64": '
                                  '{"16": {"best": {"family": "cutlass", "config": null}}}}}}',
                                  '{"format": "kbit-tuned", "version": 1, "gpu": "h200", "candidates": [], "entries": '
                                  '{"4": {"64x64": {"16": {"best": {"family": "dequant_mm", "config": null}, '
                                  '"times": [[3, 1.0]]}}}}}'])
def test_damaged_shipped_table_fails_loudly_with_its_path(shipped, text):
    path = tuned.packaged_path("h200")
    path.write_text(text)
    reload_tuned()
    with pytest.raises(ValueError, match=f"tuned table {path}"):
        tuned_candidate(4, 16, 28672, 4096, "h200")
    with pytest.raises(ValueError, match="tuned table"):
        tuned.packaged_table("h200")


def test_packaged_form(tmp_path):
    t = _table("h200", {(4, 16, 28672, 4096): (K3, K1)}, rules=[_rule(DQ, k=[4], M_min=129, M_max=256)])
    p = t.packaged().save(tmp_path / "p.json")
    back = TunedTable.load(p)
    e = back.entries[(4, 28672, 4096, 16)]
    assert set(e) == {"best", "current_us", "times", "builtin", "code"} and e["current_us"] == 15.0
    assert e["code"] == t.entries[(4, 28672, 4096, 16)]["code"] and back.rules == t.rules  # the kernel code kept
    assert back.lookup(4, 16, 28672, 4096) == K3 and back.meta == t.meta and back.candidates == [K3, K1]
    assert back.trials((4, 28672, 4096, 16)) == t.trials((4, 28672, 4096, 16))  # times by candidate index
    assert back.packaged().as_dict() == back.as_dict()
    assert "trials" in t.entries[(4, 28672, 4096, 16)]  # the original keeps them
    del back.entries[(4, 28672, 4096, 16)]["times"]
    with pytest.raises(ValueError, match="only the best"):
        back.trials((4, 28672, 4096, 16))
    assert back.nearest(4, 16, 20000, 4096) == K3  # without trials: the nearest shape's best


def test_cli_fit_package(tmp_path, capsys):
    src = tmp_path / "tuned-tune.json"
    _table("h200", {(4, 16, 28672, 4096): (K3, K1), (4, 16, 6144, 4096): (K1, K3)}).save(src)
    p = argparse.ArgumentParser()
    T.configure(p)
    assert T.main(p.parse_args(["--fit", str(src), "--package", str(tmp_path / "tuned-h200.json")])) == 0
    assert "tuned-h200.json" in capsys.readouterr().out
    pk = json.loads((tmp_path / "tuned-h200.json").read_text())
    assert pk["rules"] and all("trials" not in b for sh in pk["entries"]["4"].values() for b in sh.values())


def test_dispatcher_line():
    t = _table("h200", {(4, 16, 28672, 4096): (K3, K1), (4, 1, 6144, 4096): (K1, K3)})
    t.entries[(4, 6144, 4096, 1)]["current_us"] = 10.2
    line = T.dispatcher_line(t, sorted(t.entries))
    assert "over 2 entries" in line and "worst 1.500" in line and "within 5% on 1 of 2" in line
    assert "best config itself" not in line  # no entry says what the dispatcher ran
    t.entries[(4, 6144, 4096, 1)]["current"] = K1.as_dict()  # the best itself, timed twice: 1.02
    t.entries[(4, 28672, 4096, 16)]["current"] = K1.as_dict()  # another config than the best (K3): 1.5
    line = T.dispatcher_line(t, sorted(t.entries))
    assert "worst 1.500" in line and "on 1 the dispatcher ran the best config itself (timed twice: worst 1.020)" in line
    assert "worst where it ran another: 1.500" in line
    t.entries[(4, 28672, 4096, 16)]["current"] = K3.as_dict()
    assert "on all 2 the dispatcher ran the best config itself" in T.dispatcher_line(t, sorted(t.entries))


def test_tune_records_the_dispatchers_choice():
    """An entry keeps the candidate the dispatcher ran beside its time; the packaged table drops it."""
    t = TunedTable("h200")
    e = t.add(4, 6144, 4096, 1, [Trial(K1, 10.0), Trial(K3, 12.0)], current_us=12.1, current=K3)
    assert e["current"] == K3.as_dict() and e["best"]["us"] == 10.0
    assert "current" not in t.packaged().entries[(4, 6144, 4096, 1)]


# ------------------------------------------------------------------------------------------------ the space


def test_lfx_slots_fit_static_shared_memory():
    """The CTA-local fix-up keeps its slots in static shared memory (48 KiB a build at most): 8 warps x 2 slots x 8
    token groups (64 KiB) made NVRTC refuse the build; such a plan now goes without LFX."""
    assert TU.lfx_defines(1792, 16, 264, 8, 0, ng=8) is None
    assert TU.lfx_defines(1792, 16, 264, 8, 0, ng=4) is not None  # 32 KiB
    assert TU.lfx_defines(1792, 16, 264, 8, 0) == TU.lfx_defines(1792, 16, 264, 8, 0, ng=1)
    for M in (33, 64):
        p = make_plan(4, M, 28672, 4096, "log8", K3.config, sms=132, build=lambda kernel, d: _FakeKernel(d))
        assert "LFX" not in p.defines
        slots = p.defines["MAXW"] * p.defines.get("LFW", 0) * p.defines["NG"] * 512
        assert slots <= TU.LFX_MAX_SLOT_BYTES


def test_infeasible_configs_left_out():
    assert infeasible(Candidate("mma", XSLICE), 4, 64, 28672, 4096).startswith("config: x slices of 8 segments")
    assert infeasible(Candidate("mma", XSLICE), 4, 256, 28672, 4096) is not None  # chunks of 64 rows
    assert infeasible(Candidate("mma", XSLICE), 4, 16, 28672, 4096) is None
    assert infeasible(DQ, 4, 4096, 28672, 4096) is None
    with pytest.raises(ValueError, match="shared memory"):
        check_config(4, 64, 28672, 4096, XSLICE)
    assert check_config(4, 16, 28672, 4096, XSLICE) > 0
    for M in (1, 16, 64, 100, 256, 1024):
        for quick in (False, True):
            cands = search_space(4, M, 28672, 4096, quick=quick)
            assert all(infeasible(c, 4, M, 28672, 4096) is None for c in cands)
    assert Candidate("mma", XSLICE) in search_space(4, 16, 28672, 4096)
    assert Candidate("mma", XSLICE) not in search_space(4, 64, 28672, 4096)


@pytest.mark.parametrize("M", [256, 512, 1024, 4096])
def test_dequant_cublas_is_a_candidate_at_large_m(M):
    for quick in (False, True):
        for sm90 in (False, True):
            assert DQ in search_space(3, M, 5120, 25600, quick=quick, sm90=sm90)


def test_quick_large_space_is_eight_warps():
    large = [c for c in search_space(4, 1024, 5120, 25600, quick=True) if c.family == "large"]
    assert large and {c.config.warps for c in large} == {8}
    assert {c.config.groups for c in large} == {4, 8, 16, 32} and {c.config.stream_k for c in large} == {False, True}


def test_candidate_builds():
    b = candidate_builds(K3, 4, 1, 28672, 4096, 132)
    assert b and all(f == "gemv_mma_streamk.cu" for f, _ in b)
    assert {dict(d)["BF16"] for _, d in b} == {1}  # the plan's builds are the launch's (bf16 activations)
    assert {f for f, _ in candidate_builds(K7, 4, 256, 28672, 4096, 132)} == {"wgmma.cu"}
    assert candidate_builds(DQ, 4, 256, 28672, 4096, 132) == []
    assert candidate_builds(Candidate("mma", XSLICE), 4, 64, 28672, 4096, 132) == []  # refused by its plan
    assert len({d for _, d in candidate_builds(K1, 4, 200, 28672, 4096, 132)}) == 2  # chunks of 64 and 8 rows


# ------------------------------------------------------------------------------------------------ shape order


def test_by_bands_covers_bands_and_families_first():
    models = S.load_models("models")
    sel = S.select(models, split="tune")
    shapes, fam = S.dense_shapes(sel), S.shape_families(sel)
    order = S.by_bands(shapes, NK_EDGES, fam)
    assert sorted(order) == sorted(shapes)

    def band(s):
        return sum(s[0] * s[1] >= e for e in NK_EDGES)

    bands = {band(s) for s in shapes}
    assert {band(s) for s in order[:len(bands)]} == bands  # the first round: one shape a band, largest first
    assert [band(s) for s in order[:len(bands)]] == sorted(bands, reverse=True)
    first = [fam[s] for s in order[:len(bands)]]
    assert len(set(first)) >= len(bands) - 1  # families in turn
    assert S.by_bands([(64, 64), (8192, 8192), (64, 64)], NK_EDGES) == [(8192, 8192), (64, 64)]


def test_cli_order_bands():
    p = argparse.ArgumentParser()
    T.configure(p)
    args = p.parse_args(["--suite", "models", "--split", "held-out", "--order", "bands", "--max-shapes", "3"])
    shapes = T.shapes_from_args(args)
    assert len(shapes) == 3 and len({sum(n * k >= e for e in NK_EDGES) for n, k in shapes}) == 3
    args = p.parse_args(["--suite", "models", "--split", "tune", "--max-shapes", "3"])
    assert T.shapes_from_args(args)[0] == (128256, 16384)  # "size": evenly over the sizes, largest included


# ------------------------------------------------------------------------------------------------ report


def _row(kernel, N, K, M, k, us):
    return dict(kernel=kernel, N=N, K=K, M=M, k=k, E=1, us=us)


def test_dispatch_points(tmp_path, capsys):
    rows = [_row("kbit-linear", 5120, 25600, 1024, 4, 723.5), _row("dequant+cublas", 5120, 25600, 1024, 4, 459.3),
            _row("bf16", 5120, 25600, 1024, 16, 344.2), _row("humming", 5120, 25600, 1024, 4, 365.9),
            _row("kbit-linear", 5120, 25600, 1, 4, 40.0), _row("gemv", 5120, 25600, 1, 4, 41.0),
            _row("gemv", 4096, 4096, 1, 4, 9.0)]  # no dispatcher row: not a point
    pts = DP.dispatch_points(rows)
    assert [(p["M"], p["best_name"]) for p in pts] == [(1, "kbit-linear"), (1024, "dequant+cublas")]
    assert pts[1]["ratio"] == pytest.approx(723.5 / 459.3) and pts[1]["bf16"] == 344.2 and pts[1]["humming"] == 365.9
    md = DP.points_markdown(pts)
    assert "within 5% of the fastest kbit candidate at 1 of 2 points" in md and "5120x25600 M=1024 k=4" in md
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"header": {"gpu_name": "H200", "commit": "abc"}, "rows": rows}))
    assert DP.main([str(path)]) == 0
    assert "H200, commit abc" in capsys.readouterr().out
    assert "no point" in DP.points_markdown([])


def test_fit_prefers_no_far_off_shape():
    """Where no candidate is within 5% of the best on every shape of a band, the rule takes the smallest worst
    slowdown, not the smallest geometric mean (one shape 16% off outweighs 8% on three)."""
    t = TunedTable("h200")
    for i, a in enumerate([1.0, 1.0, 1.0, 1.25]):
        t.add(4, 4096 + 16 * i, 4096, 256, [Trial(K7, 100 * a), Trial(DQ, 108.0), Trial(K1, 100.0)])
    (band, catch_all) = tuned.fit_rules(t)
    assert band["family"] == catch_all["family"] == "mma" and band["fit"]["worst_slowdown"] == 1.0  # K1: best
    t = TunedTable("h200")
    for i, a in enumerate([1.0, 1.0, 1.0, 1.25]):
        t.add(4, 4096 + 16 * i, 4096, 256, [Trial(K7, 100 * a), Trial(DQ, 108.0), Trial(K1, 300.0 - 50 * a)])
    rule = tuned.fit_rules(t)[0]
    # kernel 7: 1.0, 1.0, 1.0, 125 / 108 (geomean 1.037, worst 1.157); dequantize + cuBLAS: 1.08 x 3, 1.0 (1.059)
    assert rule["family"] == "dequant_mm" and rule["fit"]["worst_slowdown"] == 1.08
    assert rule["fit"]["geomean_slowdown"] == pytest.approx(1.08 ** 0.75, abs=1e-4)


def test_nearest_weighs_the_builtin_choice(tmp_path):
    """The built-in rules' choice an entry records competes in the nearest-shapes pick: where it is within 5% on
    every nearest shape with the smallest geometric mean, the table answers that choice where it was one candidate
    on all of them, else "the built-in rules" (None from ``lookup``, and no fitted rule or other table after it);
    an entry that records none leaves the old pick."""
    def table(own_us):
        t = TunedTable("h200")
        for i in range(3):  # the built-in choice (K1 on shape 0, K3 on the others) against kernel 7 / dequantize
            own = K1 if i == 0 else K3
            t.add(4, 4096 + 16 * i, 4096, 64, [Trial(K7, 100.0), Trial(DQ, 103.0), Trial(own, own_us)], builtin=own)
        tuned.fit_rules(t)
        return t

    t = table(99.0)
    assert t.nearest(4, 64, 5000, 4096) == tuned.BUILTIN
    assert t.lookup(4, 64, 5000, 4096) is None and t.general_answer(4, 64, 5000, 4096) == (True, None)
    assert t.lookup(4, 64, 4096, 4096) == K1  # a tuned shape: its own best
    assert table(110.0).nearest(4, 64, 5000, 4096) == K7  # the built-in choice 10% off: the measured pick
    back = TunedTable.load(t.packaged().save(tmp_path / "p.json"))  # the packaged form keeps the record
    assert back.builtin_candidate((4, 4096 + 16, 4096, 64)) == K3 and back.nearest(4, 64, 5000, 4096) == tuned.BUILTIN
    for e in t.entries.values():
        e["builtin"] = None
    assert t.nearest(4, 64, 5000, 4096) == K7
    held = TunedTable("h200")  # an untuned shape: the lookup's "built-in" answer is timed as that entry's choice
    held.add(4, 5000, 4096, 64, [Trial(K7, 100.0), Trial(DQ, 103.0), Trial(K3, 99.0)], builtin=K3)
    ev = tuned.evaluate([], held, fitted=table(99.0))
    assert ev["covered"] == ev["entries"] == 1 and ev["rows"][0]["rule_us"] == 99.0
    same = TunedTable("h200")  # every nearest shape's built-in choice is K3: K3 itself, which was measured there
    for i in range(3):  # (the rules might choose otherwise at [5000, 4096]: nothing measured that)
        same.add(4, 4096 + 16 * i, 4096, 64, [Trial(K7, 100.0), Trial(DQ, 103.0), Trial(K3, 99.0)], builtin=K3)
    assert same.nearest(4, 64, 5000, 4096) == K3 and same.lookup(4, 64, 5000, 4096) == K3


def test_nearest_does_not_carry_kernel1_to_more_rounds():
    """At M = 1 a kernel-1 config's time is not carried from a tuned shape to one where its CTAs take more tiles in
    turn (132 SMs, 8 warps x 2 CTAs: 264 slots; 3584 rows are 224 tiles, one a CTA; 5120 rows are 320, two): there
    the stream-K kernel answers. Shapes of the same rounds still take it; other M buckets and tables without an SM
    count are as before; where the built-in rules won with that config, they choose at the shape."""
    def table(sms=132, bucket=1, builtin=None):
        t = TunedTable("h100", {"sms": sms} if sms else None)
        for K in (16384, 18944, 20480):  # kernel 1 9% ahead of kernel 3 on each
            t.add(4, 3584, K, bucket, [Trial(K1, 16.0), Trial(K3, 17.5)], builtin=builtin)
        return t

    assert tuned._k1_rounds(K1.config, 3584, 18944, 132) == 1 and tuned._k1_rounds(K1.config, 5120, 32768, 132) == 2
    assert table().nearest(4, 1, 5120, 32768) == K3  # two rounds there
    assert table().nearest(4, 1, 3840, 18944) == K1  # 240 tiles: still one round
    assert table(sms=None).nearest(4, 1, 5120, 32768) == K1  # no SM count: times carried as measured
    assert table(bucket=4).nearest(4, 4, 5120, 32768) == K1  # M = 1 only
    assert table(builtin=K1).nearest(4, 1, 5120, 32768) == tuned.BUILTIN  # the rules decide at the shape
    assert table(builtin=K1).nearest(4, 1, 3840, 18944) == K1


def test_nearest_reads_a_staged_x_config_as_run_where_x_does_not_fit():
    """Kernel 3 with x staged at two CTAs an SM: at M = 8 the rows of K = 4096 fit beside the table, those of
    K = 5376 do not, and the plan reads x from global memory there. So on such a shape the nearest tuned shapes'
    times of that x-from-global form stand for the config (which then loses to one CTA of 16 warps); on a shape
    where x fits, and where the form was not timed, the times stand as measured; the built-in choice likewise."""
    xg = Candidate("mma", MmaConfig(3, 8, min_ctas=2, ring=2))
    one = Candidate("mma", MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True))
    assert x_staged(4, 8, 16, K3.config) and not x_staged(4, 8, 21, K3.config)  # K = 4096, 5376: 16, 21 segments
    assert x_staged(4, 8, 21, one.config)  # one CTA an SM: the whole shared memory

    def table(with_xg=True, builtin=None):
        t = TunedTable("h200", {"sms": 132})
        for N in (128256, 151552, 152064):  # staged x 5% ahead of one CTA of 16 warps; x from global 15% behind
            trials = [Trial(K3, 95.0), Trial(one, 100.0)] + ([Trial(xg, 110.0)] if with_xg else [])
            t.add(4, N, 4096, 8, trials, builtin=builtin)
        return t

    key = (4, 128256, 4096, 8)
    assert tuned._x_stand_in(K3, key, 5376) == xg and tuned._x_stand_in(K3, key, 4096) == K3
    assert tuned._x_stand_in(K1, key, 5376) == K1
    assert table().nearest(4, 8, 262208, 5376) == one  # x does not fit there: K3 runs as xg, 10% behind
    assert table().nearest(4, 8, 262208, 4096) == K3  # x fits: as measured
    assert table(with_xg=False).nearest(4, 8, 262208, 5376) == K3  # the form not timed: as measured
    assert table(builtin=K3).nearest(4, 8, 262208, 5376) == one  # the built-in choice read the same way
    assert table(builtin=K3).nearest(4, 8, 262208, 4096) == K3


def test_a_k_slice_pick_stages_the_whole_x_where_it_fits():
    """A shape never tuned takes its nearest tuned shapes' pick; where that is kernel 3 with x in K slices (won where
    the whole x does not fit, K = 8192 at M = 16) and the whole x fits the shape asked (K = 5120), it answers the
    whole-x form, judged by that form's times where it fits a tuned shape and by the slices' where it does not.
    Exact entries answer as measured; rules' answers are read the same way; other candidates stand for themselves."""
    whole = Candidate("mma", MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True))
    sliced = Candidate("mma", MmaConfig(3, 16, min_ctas=1, ring=3, x_smem=True, x_slice=8))
    xg = Candidate("mma", MmaConfig(3, 16, min_ctas=1, ring=2))
    assert not x_staged(4, 16, 32, whole.config) and x_staged(4, 16, 20, whole.config)  # K = 8192, 5120
    assert tuned._x_form(sliced, 4, 16, 5120) == whole and tuned._x_form(sliced, 4, 16, 8192) == sliced
    assert tuned._x_form(sliced, 4, 4, 8192) == whole  # fewer rows: the whole x fits
    assert tuned._x_form(whole, 4, 16, 8192) == whole and tuned._x_form(xg, 4, 16, 5120) == xg
    assert tuned._x_form(K1, 4, 16, 5120) == K1 and tuned._x_form(None, 4, 16, 5120) is None
    assert tuned._x_stand_in(sliced, (4, 57344, 8192, 16), 5120) == sliced  # the whole x does not fit there
    assert tuned._x_stand_in(sliced, (4, 128256, 4096, 16), 5120) == whole
    assert tuned._x_stand_in(sliced, (4, 128256, 4096, 16), 8192) == sliced  # slices on the shape asked

    t = TunedTable("h200", {"sms": 132})
    for N in (57344, 59136):  # the slices ahead where the whole x does not fit
        t.add(4, N, 8192, 16, [Trial(sliced, 100.0), Trial(whole, 121.0), Trial(xg, 118.0)])
    t.add(4, 128256, 4096, 16, [Trial(sliced, 139.0), Trial(whole, 121.8), Trial(xg, 153.0)])
    assert t.nearest(4, 16, 65536, 5120) == sliced
    assert t.answer(4, 16, 65536, 5120) == (True, whole) and t.answer(4, 12, 65536, 5120) == (True, whole)
    assert t.answer(4, 16, 57344, 8192) == (True, sliced)  # an exact entry: as measured
    assert t.answer(4, 16, 65536, 9216) == (True, sliced)  # the whole x does not fit there either
    rules = TunedTable("h200")
    rules.rules = [{"if": {"k": [4]}, **json.loads(sliced.key)}]
    assert rules.answer(4, 16, 65536, 5120) == (True, whole)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_every_quick_candidate_runs(tmp_path):
    """No candidate of the quick space fails by design any more: at M = 64 kernel 3 (8 warps, 2 CTAs an SM) built
    with the CTA-local fix-up's 64 KiB of static slots (NVRTC refused it), and kernel 3's x slices went over the
    shared memory; both are now planned or pruned before anything is timed."""
    table = TunedTable("test")
    done = T.tune_shapes(table, [(28672, 4096)], [4], [1, 16, 64, 256], quick=True, reps=3)
    assert len(done) == 4
    for key in done:
        failed = [t for t in table.entries[key]["trials"] if t["us"] is None]
        assert not failed, (key, failed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_shipped_table_candidates_run():
    """Every candidate the table shipped for this GPU names (entries and rules) launches here and matches the
    dispatcher's output on a small weight."""
    table = tuned.packaged_table(gpu_key(torch.device("cuda")))
    if table is None:
        pytest.skip("kbit ships no tuned table for this GPU")
    cands = {json.dumps(e["best"], sort_keys=True): (e["best"], key[3]) for key, e in table.entries.items()}
    cands.update({json.dumps(r, sort_keys=True): (r, r["if"].get("M_max", 1024)) for r in table.rules})
    qw = T.quantized_weight(1024, 4096, 4)
    for d, M in cands.values():
        cand = candidate_from_dict(d)
        x = torch.randn(M, 4096, device="cuda").to(torch.bfloat16)
        y = T.candidate_call(cand, qw)(x).float()
        ref = T.candidate_call(None, qw)(x).float()
        assert float((y - ref).norm() / ref.norm()) < T.MAX_REL_ERR, (cand, M)


# ------------------------------------------------------------------------------------------------ measuring


class _Heating:
    """A made-up GPU that slows by 3% a call up to 10% (as a compute-bound H200 slows as it heats), over fixed true
    times."""

    def __init__(self, true: dict):
        self.true, self.calls = true, 0

    def __call__(self, cand):
        self.calls += 1
        return self.true[None if cand is None else cand.key] * min(1 + 0.03 * self.calls, 1.1)


def test_confirm_times_finalists_beside_the_dispatcher():
    true = {None: 100.0, K1.key: 100.0, K3.key: 97.0, K7.key: 150.0, DQ.key: 99.0}
    heat = _Heating(true)
    cur0 = heat(None)
    trials = T.tune_entry(4, 4096, 4096, 16, [K1, K7, DQ, K3], heat)
    assert min(trials, key=lambda t: t.us).candidate == K1 and cur0 < min(t.us for t in trials)  # order bias
    trials2, cur = T.confirm(trials, heat, top=3)
    assert [t.candidate for t in trials2] == [K1, K7, DQ, K3] and trials2[1].us == trials[1].us  # K7: no finalist
    assert min(trials2, key=lambda t: t.us).candidate == K3 and cur > min(t.us for t in trials2)
    assert cur == pytest.approx(110.0) and trials2[3].us == pytest.approx(97.0 * 1.1)
    assert T.confirm(trials, heat, top=3, deadline=0.0) == (trials, None)


def test_tune_shapes_adds_the_builtin_choice():
    class Meas:
        def set_m(self, M, seed):
            return 10.0

        def __call__(self, cand):
            return 5.0 if cand == K7 else 10.0

    table = TunedTable("h200")
    done = T.tune_shapes(table, [(28672, 4096)], [4], [1], measure_for=lambda N, K, k: Meas(), cuda=True,
                         sm90=True, quick=True, builtin_for=lambda k, M, N, K: K7,
                         current_for=lambda k, M, N, K: K3)
    e = table.entries[done[0]]
    assert e["best"]["family"] == "large" and e["current_us"] == 10.0  # kernel 7 is not in the M = 1 space
    assert e["current"] == K3.as_dict()  # what the dispatcher's time was measured on
    assert sum(t["family"] == "large" for t in e["trials"]) == 1
    assert table.builtin_candidate(done[0]) == K7  # recorded for the nearest-shape pick


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_shipped_tables_record_the_builtin_choice_and_rules_cover_served_rows(gpu):
    table = tuned.packaged_table(gpu)
    assert table is not None and table.entries
    assert all(table.builtin_candidate(key) is not None for key in table.entries)
    for rule in table.rules:
        cond, k = rule["if"], rule["if"]["k"][0]
        for M in {cond["M_min"], cond.get("M_max", 8192)}:  # a rule answers only rows its bucket serves
            assert tuned.serving_bucket(table.buckets(k), M) is not None, (gpu, cond)


@pytest.fixture
def fake_h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=132, name="H200"))
    monkeypatch.setattr(T, "kernels_available", lambda device: True)
    udev._sm_count.cache_clear()
    yield torch.device("cuda", 0)
    udev._sm_count.cache_clear()


def test_builtin_candidate(fake_h200):
    with options.override(cache_dir=None):  # the built-in rules, never a tuned table (kbit may ship one for h200)
        want = gemv_mma._tmma.default_config(4, 1, 28672, 4096, sm90=True, sms=132, gpu="h200")
        assert T.builtin_candidate(4, 1, 28672, 4096, fake_h200) == Candidate("mma", want)
        big = T.builtin_candidate(4, 256, 28672, 4096, fake_h200)
        assert big.family == "large" and big.config == gemv_mma.large_config(4, 256, 28672, 4096)
        assert T.builtin_candidate(4, 128, 2048, 2048, fake_h200).family in ("dequant_mm", "fused")


def test_nearest_shapes_pick():
    """An untuned shape takes, over the 3 nearest tuned shapes (log N, log K), the candidate within 5% of the best
    on each, else the one with the smallest worst slowdown."""
    t = TunedTable("h200")
    for (N, K), us in {(4096, 4096): (10, 10.4, 30), (8192, 4096): (10, 10.3, 30), (4096, 8192): (12, 10, 30),
                       (65536, 16384): (30, 30, 10)}.items():
        t.add(4, N, K, 16, [Trial(K1, us[0]), Trial(K3, us[1]), Trial(DQ, us[2])])
    assert t.nearest(4, 16, 6000, 5000) == K3  # K1 is 20% off on 4096x8192
    assert t.nearest(4, 16, 60000, 16384) == K3  # the three nearest include the far-off small shapes too
    assert t.nearest(4, 1, 6000, 5000) is None and t.nearest(2, 16, 6000, 5000) is None
    assert t.lookup(4, 9, 4096, 4096) == K1  # an entry of the very shape
    fitted = TunedTable("h200")
    fitted.entries = {key: e for key, e in t.entries.items() if key[1] != 8192}
    held = TunedTable("h200")
    held.entries = {key: e for key, e in t.entries.items() if key[1] == 8192}
    ev = evaluate([], held, fitted=fitted)
    assert ev["covered"] == 1 and ev["rows"][0]["slowdown"] == pytest.approx(10.3 / 10)

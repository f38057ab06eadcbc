"""The MoE path chooses the kernels the code before the restructuring chose (tests/data/moe_plans.json, written by
lab/moe_plan_fixture.py from commit 64014d4): plans, routing, block rows, grouped kernel and its launch build,
kernel 7 and its config, tail split, fused SiLU, on a grid of MoE shapes, token counts, dtypes and GPU
profiles. CPU only: device facts are patched per profile."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kbit.dispatch.moe as D
import kbit.ops.grouped_mma as G
from kbit.tuning.moe import (
    WgmmaGroupedConfig,
    grouped_kernel,
    grouped_mma_config,
    pairs_rereads,
    rows_per_expert,
    wgmma_config,
)

DATA = json.loads((Path(__file__).parent / "data" / "moe_plans.json").read_text())
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _segments(K: int) -> int:
    return -(-K // 256)


def _patch(monkeypatch, profile: str) -> str:
    dev, cuda, cap, probe = DATA["profiles"][profile]
    cap = tuple(cap) if cap else None

    def available(device=None):
        return cuda and torch.device(device or "cuda").type == "cuda"

    monkeypatch.setattr(G, "kernels_available", available)
    monkeypatch.setattr(D, "kernels_available", available)
    monkeypatch.setattr(G, "large_ok", lambda device: cap == (9, 0))
    monkeypatch.setattr(D, "_capability", lambda device: cap)
    monkeypatch.setattr(D, "_grouped_mm_probe", lambda device, dtype: probe)
    return dev


def _plan_str(fn, *args, **kwargs) -> str:
    try:
        p = fn(*args, **kwargs)
    except ValueError:
        return "error"
    return f"{p.gate_up},{p.down}"


def _pairs_since(want: str, T: int, top_k: int, E: int, H: int, I: int) -> str:
    """The fixture's plans with one change made since: a few tokens on a repacked stack run the pairs' dense GEMV
    (``"pairs"``) where the grouped GEMM ran, for N a multiple of 16 (gate_up 2I, down H), at most 64 pairs and at
    most 1.25 expected reads a touched expert."""
    if T * top_k > 64 or pairs_rereads(T, top_k, E) > 1.25:
        return want
    cols = want.split(";")
    if cols[2] != "error":
        cols[2] = ",".join("pairs" if kn == "gemm" and N % 16 == 0 else kn
                           for kn, N in zip(cols[2].split(","), (2 * I, H), strict=True))
    return ";".join(cols)


@pytest.mark.parametrize("profile", sorted(DATA["profiles"]))
def test_plans_as_before(monkeypatch, profile):
    dev = _patch(monkeypatch, profile)
    diff = []
    for sname, (E, top_k, H, I) in DATA["shapes"].items():
        for T in DATA["tokens"]:
            for dname, dt in DTYPES.items():
                got = ";".join((
                    _plan_str(D.choose_plan, T, top_k, E, H, I, dt, dev),
                    _plan_str(D.choose_plan, T, top_k, E, H, I, dt, dev, gemm=False),
                    _plan_str(D.plan_for_layout, T, top_k, E, H, I, dt, dev, repacked=True, auto_repack=True),
                    _plan_str(D.plan_for_layout, T, top_k, E, H, I, dt, dev, repacked=False, auto_repack=False)))
                key = f"{profile}|{sname}|{T}|{dname}"
                want = _pairs_since(DATA["plans"][key], T, top_k, E, H, I)
                if got != want:
                    diff.append((key, want, got))
    assert not diff, diff[:10]


@pytest.mark.parametrize("profile", [p for p, v in sorted(DATA["profiles"].items()) if v[1]])
def test_grouped_choices_as_before(monkeypatch, profile):
    dev = _patch(monkeypatch, profile)
    rw = SimpleNamespace(layout="mma-v1")
    hidden = SimpleNamespace(device=torch.device(dev))
    diff = []
    for sname, (E, top_k, H, I) in DATA["shapes"].items():
        for T in DATA["tokens"]:
            P = T * top_k
            large = G.large_rows(P, E, dev)
            c = wgmma_config(rows_per_expert(P, E))
            cfg = [7, c.warps, c.groups, c.stages, c.raster, int(c.x_swizzle), c.x_bulk] if large else None
            assert not large or large == 8 * c.groups
            rec = {"large": large, "cfg": cfg}
            for sort in (False, True):
                ng = G.choose_ng(P, E, dev, sort)
                rec[f"ng{int(sort)}"] = ng
                rec[f"kern{int(sort)}"] = [grouped_kernel(ng, _segments(K)) for K in (H, I)]
            routing = SimpleNamespace(sorted=True, has_groups=True, P=P, E=E)
            rec["tail"] = D._tail_split_rows(hidden, routing, rw, rw)
            gu = SimpleNamespace(stride=lambda d, I=I: (2 * I, 1)[d], data_ptr=lambda: 1 << 20,
                                 device=torch.device(dev))
            rec["silu"] = G.fused_silu_ok(gu, P, E, None)
            key = f"{profile}|{sname}|{T}"
            if rec != DATA["grouped"][key]:
                diff.append((key, DATA["grouped"][key], rec))
    assert not diff, diff[:10]


def test_routing_as_before(monkeypatch):
    _patch(monkeypatch, "h100")
    label = {}
    monkeypatch.setattr(D, "select_experts", lambda *a, **k: (None, None))
    monkeypatch.setattr(D, "route_pairs", lambda *a, **k: (None, None, None, None))
    for name in ("align", "pair_order", "sort_pairs"):
        monkeypatch.setattr(D, name, lambda *a, name=name, **k: label.__setitem__("r", name))
    plans = {"none": None, "gemv": D.MoePlan("gemv", "gemv"), "gemm": D.MoePlan("gemm", "gemm"),
             "gemv-gemm": D.MoePlan("gemv", "gemm"), "grouped_mm": D.MoePlan("grouped_mm", "grouped_mm")}
    for T in DATA["tokens"]:
        for name, plan in plans.items():
            D.route(torch.empty(T, 8, device="meta"), plan, top_k=2, E=8)
            assert label["r"] == DATA["routes"][f"{T}|{name}"], (T, name)


def test_launch_builds_as_before():
    diff = []
    for k in (2, 3, 4, 5):
        for sf in ("log8", "fp16"):
            for bf16 in (False, True):
                for ng in (1, 2, 4, 8):
                    for S in DATA["segments"]:
                        b = G.grouped_mma_build(k, grouped_mma_config(ng, S), sf, bf16)
                        key = f"{k}|{sf}|{int(bf16)}|{ng}|{S}"
                        got = [b.file, b.name, b.warps, b.shared, dict(sorted(b.defines.items()))]
                        if got != DATA["launch"][key]:
                            diff.append((key, DATA["launch"][key], got))
                for cfg in DATA["wgmma_cfgs"]:
                    if cfg[6] != 1:  # x_bulk 2: a variant kernel 7 is no longer built with, refused
                        with pytest.raises(ValueError, match="x_bulk"):
                            WgmmaGroupedConfig(warps=cfg[1], groups=cfg[2], x_bulk=cfg[6])
                        continue
                    c = WgmmaGroupedConfig(warps=cfg[1], groups=cfg[2], stages=cfg[3], raster=cfg[4],
                                           x_swizzle=bool(cfg[5]), x_bulk=cfg[6])
                    b = G.wgmma_build(k, c, sf, bf16)
                    key = f"{k}|{sf}|{int(bf16)}|" + ",".join(map(str, cfg))
                    got = [b.file, b.name, b.warps, b.shared, dict(sorted(b.defines.items()))]
                    if got != DATA["launch"][key]:
                        diff.append((key, DATA["launch"][key], got))
    assert not diff, diff[:10]


@pytest.mark.parametrize("T,top_k,E", [(1, 8, 128), (4, 8, 128), (8, 8, 128), (2, 2, 8), (4, 2, 8), (3, 6, 6)])
def test_pairs_rereads_matches_sampled_routing(T, top_k, E):
    """The expected reads a touched expert against 4000 sampled steps of T tokens, each choosing top_k distinct
    experts uniformly: the mean touched experts within 1% (sampling error ~0.2%)."""
    g = torch.Generator().manual_seed(T * 1000 + E)
    picks = torch.rand(4000, T, E, generator=g).topk(top_k, dim=-1).indices  # top_k distinct experts a token
    touched = torch.zeros(4000, E).scatter_(1, picks.flatten(1), 1.0).sum(1).mean().item()
    assert pairs_rereads(T, top_k, E) == pytest.approx(T * top_k / touched, rel=0.01)
    assert pairs_rereads(1, top_k, E) == 1.0

"""benchmarks/bench_moe.py on the CPU (its timing replaced): the rows it writes, the layer's own plan for ``auto``,
the layout a pinned plan is held in, and independent weight copies of a layer in layout "mma-v1"."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_moe_cpu", ROOT / "benchmarks" / "bench_moe.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "l2_bytes", lambda: 1 << 16)
    monkeypatch.setattr(mod, "MAX_COPIES", 3)  # each copy runs once (in Triton's interpreter in CI)

    def time_calls(calls):  # each call once (they must run), a fixed time
        for c in calls:
            c()
        return SimpleNamespace(us=1.0, us_min=1.0, us_max=1.0, calls=len(calls), mode="eager")

    monkeypatch.setattr(mod, "time_calls", time_calls)
    return mod


def test_rows_auto_is_the_layers_plan(bench):
    m = bench.Model("tiny", 8, 2, 64, 32, True)
    layer, w_gu, w_dn = bench.make_model(m, 4)
    for T, name in ((1, "auto"), (3, "auto"), (3, "gemv"), (3, "grouped_mm")):
        row = bench.run_case(m, 4, T, name, layer, w_gu, w_dn)
        plan = bench.PLANS.get(name) or layer.plan_for(T, dtype=torch.bfloat16)
        assert row["kernels"] == f"{plan.gate_up}/{plan.down}" and row["plan"] == name
        assert row["rel_diff_vs_bf16"] < 2e-2, row  # the bf16 side multiplies the dequantized kbit weights
        assert row["kbit_copies"] >= 2 and row["speedup"] == 1.0
        assert layer.layout == "canonical"  # no grouped kernels on the CPU: nothing repacked


def test_copy_of_a_repacked_layer_is_independent(bench):
    m = bench.Model("tiny", 8, 2, 64, 32, True)
    layer = bench.make_model(m, 4)[0].repack_for_kernels()
    c = bench.kbit_copy(layer)
    assert c.layout == layer.layout == "mma-v1"
    for (n, a), (_, b) in zip(layer.named_buffers(), c.named_buffers(), strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), n
    assert bench.layer_bytes(c) == bench.layer_bytes(layer) > 0
    bench.hold_layout(layer, bench.PLANS["gemv"])  # a GEMV plan reads the canonical stacks
    assert layer.layout == "canonical"

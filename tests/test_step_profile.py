"""kbit.bench.step_trace / step_report / step_profile: synthetic profiler traces (attribution, order transfer, gaps,
bytes, totals, the table, the plot) and the instrumented step of tiny models on the CPU (ranges and their bytes);
benchmarks/bench_e2e.py --profile on a tiny config."""
import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from kbit.bench import step_profile as sp
from kbit.bench.step_report import (
    by_kind,
    critical_us,
    format_kernels,
    format_report,
    from_dict,
    plot_timeline,
    short_name,
    to_dict,
    top_rows,
)
from kbit.bench.step_trace import (
    NO_RANGE,
    Kernel,
    Range,
    attribute,
    build_profile,
    drop_far,
    gaps_before,
    gpu_kernels,
    kernel_bytes,
    parse_range_name,
    range_name,
    role,
    split_run,
    trace_events,
    transfer,
)
from kbit.hf.decode import StaticDecoder

ROOT = Path(__file__).resolve().parents[1]
CPU_THREAD, GPU_STREAM = (1, 11), (0, 7)


# ------------------------------------------------------------------------------------------------ synthetic traces


def _annotation(rid, label, ts, dur, cat="user_annotation", where=CPU_THREAD):
    return {"ph": "X", "cat": cat, "name": range_name(rid, label), "pid": where[0], "tid": where[1], "ts": ts,
            "dur": dur}


def _launch(corr, ts, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "pid": CPU_THREAD[0], "tid": CPU_THREAD[1],
            "ts": ts, "dur": 1.0, "args": {"correlation": corr}}


def _kernel(name, corr, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": GPU_STREAM[0], "tid": GPU_STREAM[1], "ts": ts, "dur": dur,
            "args": {"correlation": corr}}


def _eager_trace():
    """step(0) [0, 100] holds gemv(1) [10, 20] and moe(2) [30, 70], which holds experts(3) [40, 50]. Kernels:
    a: launched in gemv, b: in moe (outside experts), c: in experts (driver launch), d: outside every range,
    e: no launch event (GPU-side range of experts holds it), plus a memset in step."""
    return {"traceEvents": [
        _annotation(0, "step", 0.0, 100.0), _annotation(1, "layers.0.o_proj", 10.0, 10.0),
        _annotation(2, "layers.0.mlp", 30.0, 40.0), _annotation(3, "layers.0.mlp.experts", 40.0, 10.0),
        _annotation(3, "layers.0.mlp.experts", 1030.0, 40.0, cat="gpu_user_annotation", where=GPU_STREAM),
        {"ph": "X", "cat": "user_annotation", "name": "not ours", "pid": 1, "tid": 11, "ts": 41.0, "dur": 1.0},
        _launch(1, 12.0), _launch(2, 31.0), _launch(3, 45.0, cat="cuda_driver"), _launch(4, 150.0), _launch(6, 5.0),
        _kernel("void gemv<4>(int)", 1, 1000.0, 20.0), _kernel("router", 2, 1025.0, 5.0),
        _kernel("experts", 3, 1031.0, 30.0), _kernel("argmax", 4, 1100.0, 2.0),
        _kernel("lonely", 5, 1059.0, 3.0), _kernel("Memset (Device)", 6, 990.0, 1.0, cat="gpu_memset"),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0.0},
    ]}


def _ranges():
    return {0: Range(0, "step", "other"), 1: Range(1, "layers.0.o_proj", "k-bit GEMV", 40_000_000, 0),
            2: Range(2, "layers.0.mlp", "MoE routing", 1_000_000, 0),
            3: Range(3, "layers.0.mlp.experts", "k-bit GEMV", 90_000_000, 2)}


def test_range_names_round_trip():
    assert parse_range_name(range_name(17, "layers.3.mlp:x")) == 17
    assert parse_range_name("kbit.step:x:y") is None and parse_range_name("aten::mm") is None


def test_trace_events_checks_its_input():
    assert len(trace_events(_eager_trace())) == 17  # the instant event is dropped
    with pytest.raises(TypeError, match="trace: expected a dict with a 'traceEvents' list"):
        trace_events("trace.json")


def test_attribute_innermost_range_of_the_launch():
    ks = attribute(trace_events(_eager_trace()))
    got = {k.name: k.range_id for k in ks}
    assert got == {"Memset (Device)": 0, "void gemv<4>(int)": 1, "router": 2, "experts": 3, "lonely": 3,
                   "argmax": None}
    assert [k.name for k in ks][:2] == ["Memset (Device)", "void gemv<4>(int)"]  # start order
    assert [k.name for k in gpu_kernels(trace_events(_eager_trace()))] == [k.name for k in ks]


def test_attribute_through_the_cpu_op_and_other_threads():
    events = [_annotation(0, "step", 0.0, 100.0), _annotation(1, "layers.0.o_proj", 10.0, 10.0),
              {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "pid": 1, "tid": 11, "ts": 12.0, "dur": 2.0,
               "args": {"External id": 77}},
              {**_annotation(2, "replay", 50.0, 10.0), "args": {"External id": 78}},
              {**_launch(5, 15.0), "tid": 99},  # a launch recorded under another thread id
              {**_kernel("add", None, 500.0, 1.0), "args": {"External id": 77}},
              {**_kernel("graph kernel", None, 600.0, 1.0), "args": {"External id": 78}},
              _kernel("moved", 5, 700.0, 1.0)]
    assert [k.range_id for k in attribute(trace_events(events))] == [1, 2, 1]


def test_gaps_before_uses_the_latest_end():
    ks = [Kernel("a", 0.0, 10.0), Kernel("b", 2.0, 3.0), Kernel("c", 14.0, 1.0), Kernel("d", 14.5, 2.0)]
    assert gaps_before(ks) == [0.0, -8.0, 4.0, -0.5]
    assert gaps_before([]) == []


def test_gaps_add_up_for_serial_kernels():
    rnd = random.Random(0)
    for _ in range(20):
        t, ks = rnd.uniform(0, 5), []
        for i in range(rnd.randint(1, 30)):
            d = rnd.uniform(0.1, 20)
            ks.append(Kernel(f"k{i}", t, d))
            t += d + rnd.choice([0.0, rnd.uniform(0, 9)])
        p = build_profile(ks, {}, ceiling_tbps=3.0)
        assert p.span_us == pytest.approx(p.kernel_us + p.gap_us) and p.overlap_us == 0


def test_transfer_by_order_keeps_unmatched_apart():
    eager = [Kernel("a", 0, 1, 5), Kernel("b", 9, 1, 6), Kernel("a", 20, 1, 7), Kernel("c", 40, 1, 8)]
    timed = [Kernel("a", 0, 2), Kernel("b", 2, 2), Kernel("memcpy", 4, 1), Kernel("a", 5, 2), Kernel("c", 7, 2)]
    got, matched = transfer(eager, timed)
    assert matched == 4
    assert [k.range_id for k in got] == [5, 6, None, 7, 8]
    assert [(k.start_us, k.dur_us) for k in got] == [(k.start_us, k.dur_us) for k in timed]


def _run_trace(graph_correlation=True):
    """One profiler run: head(0) [0, 10], replay(1) [10, 20], reset(2) [20, 25], step(3) [25, 60] holding gemv(4)
    [30, 40]. The first head kernel's record is on a broken clock; the graph's three kernels share the
    correlation of the graph launch (or have none)."""
    g = 10 if graph_correlation else None
    events = [_annotation(0, "head", 0, 10), _annotation(1, "replay", 10, 10), _annotation(2, "reset", 20, 5),
              _annotation(3, "step", 25, 35), _annotation(4, "layers.0.o_proj", 30, 10),
              _launch(1, 1), _launch(2, 2), _launch(10, 12), _launch(20, 21), _launch(30, 27), _launch(31, 32),
              _kernel("add", 1, 1e11, 1), _kernel("add", 2, 1000, 1), _kernel("gemv", g, 1100, 4),
              _kernel("norm", g, 1105, 2), _kernel("argmax", g, 1108, 1), _kernel("fill", 20, 1200, 1),
              _kernel("norm", 30, 1300, 2), _kernel("gemv", 31, 1310, 9)]
    ranges = {0: Range(0, "head", "other"), 1: Range(1, "replay", "other"), 2: Range(2, "reset", "other"),
              3: Range(3, "step", "other"), 4: Range(4, "layers.0.o_proj", "k-bit GEMV", 1000, 3)}
    return events, ranges


@pytest.mark.parametrize("graph_correlation", [True, False])
def test_split_run_keeps_the_step_and_the_replay(graph_correlation):
    events, ranges = _run_trace(graph_correlation)
    kernels = attribute(trace_events(events))
    assert len(kernels) == 8 and len(drop_far(kernels)) == 7 and drop_far([]) == []
    eager, replay = split_run(drop_far(kernels), ranges, 3, 1)
    assert [(k.name, k.range_id) for k in eager] == [("norm", 3), ("gemv", 4)]
    assert [k.name for k in replay] == ["gemv", "norm", "argmax"]
    assert transfer(eager, replay)[1] == 1  # the graph ran gemv, norm; the eager step norm, gemv: one in order
    assert split_run(kernels, ranges, 3)[1] is None


def test_kernel_bytes_by_time_then_descendants():
    ranges = {0: Range(0, "step", "other", 50), 1: Range(1, "moe", "MoE routing", 300, 0),
              2: Range(2, "moe.experts", "k-bit GEMV", 900, 1), 3: Range(3, "moe.route", "MoE routing", 0, 1),
              4: Range(4, "host only", "other", 7, 0), 5: Range(5, "wrapper", "k-bit GEMV", 60, 0),
              6: Range(6, "inner", "k-bit GEMV", 0, 5)}
    ks = [Kernel("router", 0, 1, 1), Kernel("gate_up", 1, 20, 2), Kernel("down", 21, 10, 2),
          Kernel("topk", 31, 0, 3), Kernel("x", 40, 5, 6), Kernel("y", 45, 15, 6), Kernel("copy", 60, 2, 0)]
    shares, lost = kernel_bytes(ks, ranges)
    assert shares == pytest.approx([300, 600, 300, 0, 15, 45, 50])
    assert lost == 7
    ks0 = [Kernel("a", 0, 0, 2), Kernel("b", 0, 0, 2)]
    assert kernel_bytes(ks0, {2: ranges[2]})[0] == [450, 450]  # no time: equal shares


def test_build_profile_totals_and_kinds():
    ks = attribute(trace_events(_eager_trace()))
    p = build_profile(ks, _ranges(), ceiling_tbps=2.0, step_ms=0.1, meta={"title": "synthetic"})
    assert [r.kind for r in p.rows] == ["other", "k-bit GEMV", "MoE routing", "k-bit GEMV", "k-bit GEMV", "other"]
    assert p.rows[0].start_us == 0 and p.span_us == 112.0 and p.kernel_us == 61.0
    assert p.gap_us == pytest.approx(9 + 5 + 1 + 38) and p.overlap_us == pytest.approx(2.0)
    assert p.nbytes == 131_000_000 and p.unassigned_bytes == 0
    assert p.roofline_ms == pytest.approx(0.0655) and p.pct_roofline == pytest.approx(65.5)
    experts = [r for r in p.rows if r.label.endswith("experts")]
    assert sum(r.nbytes for r in experts) == pytest.approx(90e6) and experts[0].nbytes == pytest.approx(90e6 * 30 / 33)
    assert build_profile(ks, {}, ceiling_tbps=1.0).step_ms == pytest.approx(0.112)  # no step time: the span
    with pytest.raises(ValueError, match="ceiling_tbps: expected > 0, got 0"):
        build_profile(ks, {}, ceiling_tbps=0)
    with pytest.raises(ValueError, match="kind: expected one of"):
        Range(0, "x", "gemv")


def test_report_table_json_and_plot(tmp_path):
    p = build_profile(attribute(trace_events(_eager_trace())), _ranges(), ceiling_tbps=2.0, step_ms=0.1,
                      meta={"title": "synthetic", "timeline": "test", "eager_ms": 1.5})
    kinds = {g["kind"]: g for g in by_kind(p)}
    assert list(kinds) == ["k-bit GEMV", "MoE routing", "other"]
    assert kinds["k-bit GEMV"]["kernels"] == 3 and kinds["k-bit GEMV"]["us"] == pytest.approx(53.0)
    top = top_rows(p, "us", 2)
    assert [(g["role"], g["name"]) for g in top] == [("layers.*.mlp.experts", "experts"),
                                                     ("layers.*.o_proj", "void gemv<4>(int)")]
    assert top_rows(p, "gap_us", 1)[0]["name"] == "argmax"  # 38 us idle before it
    # the critical path: each end past the latest earlier end (the lonely kernel ends 1 us after the experts)
    assert critical_us(p.rows) == pytest.approx([1, 29, 10, 31, 1, 40]) and sum(critical_us(p.rows)) == p.span_us
    assert [(g["name"], g["crit_us"]) for g in top_rows(p, "crit_us", 2)] == [("argmax", 40), ("experts", 31)]
    assert {g["kind"]: g["crit_us"] for g in by_kind(p)} == pytest.approx({"k-bit GEMV": 61, "MoE routing": 10,
                                                                          "other": 41})
    text = format_report(p, top=3)
    assert "step profile: synthetic" in text and "eager step unprofiled 1.500 ms" in text
    assert "65.5% of the step" in text  # 131 MB at 2 TB/s = 65.5 us of a 100 us step
    # the ceiling for the 4 byte-reading kernels (65.5 us) + the other two as measured (1 + 2 us), all 4 in layer 0
    assert "others as now 0.069 ms (kernels reading nothing: 0.003 ms); 4.0 kernels a layer over 1 layers" in text
    gemv = next(line for line in text.splitlines() if line.startswith("layers.*.o_proj"))
    assert "2.00" in gemv.split() and "100.0" in gemv.split()  # 40 MB in 20 us: the whole ceiling
    listing = format_kernels(p).splitlines()
    assert len(listing) == 7 and listing[2].split()[:6] == ["1", "10.0", "20.00", "9.00", "40.000", "2.00"]
    d = json.loads(json.dumps(to_dict(p)))
    assert from_dict(d) == p  # read back from its JSON
    assert len(d["kernels"]) == 6 and d["nbytes"] == 131_000_000
    pytest.importorskip("matplotlib")
    out = plot_timeline(p, tmp_path / "t.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_short_name_and_role():
    assert short_name("void at::native::vectorized_elementwise_kernel<4, Foo>(int, Bar)") == \
        "vectorized_elementwise_kernel"
    assert short_name("kbit_gemv_mma_streamk") == "kbit_gemv_mma_streamk"
    assert short_name("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64>(Params)", 60) == \
        "cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64>"
    assert short_name("void internal::gemvx::kernel<int, float>(T)") == "gemvx::kernel<int>"
    assert short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
    assert len(short_name("x" * 80, 20)) == 20
    assert role("layers.12.mlp.experts") == "layers.*.mlp.experts" and role("lm_head") == "lm_head"


def test_recorder_moves_a_weight_to_the_innermost_range_and_counts_experts():
    rec = sp.StepRecorder()
    key = object()
    with rec.range("outer+norm", "k-bit GEMV", 1000 + 8, key):
        with rec.range("inner", "k-bit GEMV", 1000, key):
            pass
        r = rec.open("experts", "k-bit GEMV")
        rec.defer_experts(r, torch.tensor([[3, 1], [3, 7]]), 100, 5)
        rec.close()
    ranges = rec.finish()
    assert [(x.label, x.nbytes, x.parent) for x in ranges.values()] == [
        ("outer+norm", 8, None), ("inner", 1000, 0), ("experts", 305, 0)]


# ------------------------------------------------------------------------------------------------ tiny models


def _bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "benchmarks" / "bench_e2e.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _instrumented_step(model, B=2, T=5):
    dec = StaticDecoder(model, B, T + 4, fast=True)
    dec.prefill(torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)))
    with sp.instrument(dec, T + 1) as rec:
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with rec.range("step", "other"):
                dec._step_body()
        ranges = rec.finish()
    return dec, ranges, sp._export(prof)


def test_instrumented_dense_step_ranges_and_bytes():
    import kbit.hf.fast_decode as fd

    bench = _bench()
    cfg = bench.configs(tiny=True)["llama-tiny"]
    model = bench.build_kbit(cfg, "cpu", 4, fuse_proj=True)
    originals = {n: getattr(fd, n) for n in (*sp.GLUE, "add_rms_norm_linear")}
    dec, ranges, events = _instrumented_step(model)
    by_label = {r.label: r for r in ranges.values()}
    qkv = dec._fast.qkv[0][0]
    assert by_label["layers.0.self_attn.qkv(fused)"].nbytes == sp.module_bytes(qkv) > 0
    assert by_label["lm_head"].kind == "lm_head" and by_label["lm_head"].nbytes == sp.module_bytes(model.lm_head)
    D, size = cfg.hidden_size // cfg.num_attention_heads, dec.cache.layers[0].keys.element_size()
    assert by_label["layers.1.attention"].nbytes == 2 * 2 * cfg.num_key_value_heads * 6 * D * size  # K and V
    assert by_label["embed_tokens"].nbytes == 2 * cfg.hidden_size * size  # two rows looked up
    assert by_label["sample"].kind == "sampling" and by_label["layers.1.mlp.down_proj"].kind == "k-bit GEMV"
    names = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert all(range_name(r.id, r.label) in names for r in ranges.values())
    assert {n: getattr(fd, n) for n in originals} == originals and "_pick" not in vars(dec)
    assert "_attend" not in vars(dec._fast)


def test_instrumented_moe_step_counts_touched_experts():
    bench = _bench()
    cfg = bench.with_layers(bench.configs(tiny=True)["qwen3moe-tiny"], 1)  # one layer: the interpreter is slow
    model = bench.build_kbit(cfg, "cpu", 4)
    dec, ranges, _ = _instrumented_step(model, B=3, T=3)
    moe = model.model.layers[0].mlp
    per, once = sp._expert_bytes(moe, moe.num_experts)
    experts = [r for r in ranges.values() if r.label.endswith("mlp.experts")]
    assert len(experts) == cfg.num_hidden_layers == 1
    for r in experts:
        touched, rest = divmod(r.nbytes - once, per)
        assert rest == 0 and cfg.num_experts_per_tok <= touched <= 3 * cfg.num_experts_per_tok
        router = moe.router_weight.numel() * moe.router_weight.element_size()
        assert ranges[r.parent].kind == "MoE routing" and ranges[r.parent].nbytes == router


def test_bench_e2e_profile_tiny(tmp_path):
    bench = _bench()
    rows = bench.run(bench.parse(["--tiny", "--device", "cpu", "--models", "llama-tiny", "--k", "4", "--batch", "1",
                                  "--ctx", "6", "--steps", "1", "--reps", "1", "--skip-bf16", "--profile",
                                  "--layers", "1", "--ceiling-tbps", "2.5", "--out", str(tmp_path)]))
    assert "profile_error" not in rows[0] and "step profile: llama-tiny kbit k=4 B=1" in rows[0]["profile"]
    stem = tmp_path / "step-llama-tiny-kbit-k4-b1"
    assert json.loads(Path(f"{stem}.json").read_text())["ceiling_tbps"] == 2.5
    assert Path(f"{stem}.txt").exists() and Path(f"{stem}.kernels.txt").exists() and (tmp_path / "profile.txt").exists()


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3moe-tiny"])
def test_gpu_profile_of_a_graph_replay(name, tmp_path):
    bench = _bench()
    cfg = bench.configs(tiny=True)[name]
    model = bench.build_kbit(cfg, "cuda", 4, fuse_proj=True)
    dec = StaticDecoder(model, 2, 32)
    dec.prefill(torch.randint(0, cfg.vocab_size, (2, 8), device="cuda"))
    dec.capture()
    ids = dec.ids.clone()
    p = sp.profile_decoder(dec, 8, ceiling_tbps=3.0, step_ms=0.5)
    assert torch.equal(dec.ids, ids) and dec.length == 8  # left as it was
    assert "CUDA-graph replay" in p.meta["timeline"], p.meta
    matched = p.meta["matched"]
    assert matched >= 0.9 * len(p.rows) and p.meta["eager_kernels"] >= matched, p.meta
    assert {"k-bit GEMV", "attention", "lm_head", "sampling"} <= {r.kind for r in p.rows}
    assert p.nbytes > 0 and 0 < p.span_us < 1e5 and p.kernel_us > 0
    if matched == len(p.rows):
        assert p.unassigned_bytes == 0 and all(r.label != NO_RANGE for r in p.rows)
    eager = sp.profile_decoder(dec, 8, ceiling_tbps=3.0, graph=False)
    assert "eager step" in eager.meta["timeline"] and len(eager.rows) == eager.meta["eager_kernels"]
    assert eager.nbytes == p.nbytes
    text = format_report(p)
    assert "step 0.500 ms" in text
    plot_timeline(p, tmp_path / "t.png")

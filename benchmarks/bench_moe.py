"""Benchmark of the whole k-bit MoE layer (``kbit.nn.KbitMoE``: router logits in, hidden out) against a bf16
layer with the same routing on ``torch._grouped_mm``.

Models (experts E, top-k, hidden H, expert intermediate I): Qwen3-30B-A3B (128, 8, 2048, 768), Qwen3-Next
(512, 10, 2048, 512), Mixtral-8x7B (8, 2, 4096, 14336); tokens T in {1, 4, 16, 64, 256, 1024, 4096}.

The bf16 side: expert choice (softmax top-k), the device-side sort (``kbit.ops.moe_align.align``), the
fused SwiGLU and combine kernels, ``torch._grouped_mm`` for the two expert matmuls. The kbit side is the
layer's own forward: the same steps for a ``grouped_mm`` plan; for a GEMV-only plan the routing is one
fused launch (``kbit.ops.moe_router.route_pairs``, + ``sort_pairs`` above ``PAIR_ORDER_MAX_T`` tokens;
column ``routing``). The bf16 side multiplies with
``torch._grouped_mm`` on bf16 weights that are the dequantized kbit weights (so the two outputs must agree:
the relative difference is recorded per case as a correctness check). Times: ``kbit.bench.timing.time_calls``
(CUDA graph of one call per weight copy, median of replays; enough copies that the experts a call touches,
all copies together, exceed 8 x L2, within a memory budget: ``cold`` says whether that was reached).

One script for the device machine; writes ``moe.json`` and ``moe.md`` to ``$OUT`` (default
benchmarks/results/h100/) and prints a short table last. Each model has a time budget; a case that fails
(OOM, capture error, ...) is recorded with its error and the run goes on.

    PYTHONUNBUFFERED=1 python benchmarks/bench_moe.py [--models qwen3-30b-a3b,qwen3-next,mixtral-8x7b]
        [--tokens 1,4,16,64,256,1024,4096] [--k 4] [--plans auto] [--budget-s 150] [--quick] [--tests]

``auto`` is the layer's own plan (``KbitMoE.plan_for``) on stacks held in layout "mma-v1" where the grouped kernels
run (as a served model holds them). ``--plans auto,gemv,grouped_mm,gemm,pairs`` also times the layer with each kernel
pinned (to place the thresholds of ``kbit.dispatch.moe``); ``gemv<=16`` limits a pinned plan to T <= 16 (``>=``
likewise).
``--tests`` first runs ``pytest -m gpu tests/test_moe.py``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# this checkout's kbit, unless PYTHONPATH names another tree that has one (an A/B of two trees runs this file with
# PYTHONPATH at each)
if not any((Path(p) / "kbit").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(ROOT / "src"))

from kbit.bench.timing import L2_FACTOR, l2_bytes, time_calls  # noqa: E402
from kbit.dispatch.moe import MoePlan, gemm_supported  # noqa: E402
from kbit.format.spec import KbitWeight  # noqa: E402
from kbit.nn.moe import KbitMoE  # noqa: E402
from kbit.ops.dequant import dequantize_triton  # noqa: E402
from kbit.ops.moe import combine, relative_error, silu_mul_gate_up  # noqa: E402
from kbit.ops.moe_align import MoeRouting  # noqa: E402
from kbit.tuning.moe import PAIR_ORDER_MAX_T, SORT_PAIRS_MAX_T  # noqa: E402


@dataclass(frozen=True)
class Model:
    name: str
    E: int
    top_k: int
    H: int
    I: int
    renormalize: bool


MODELS = {m.name: m for m in (
    Model("qwen3-30b-a3b", 128, 8, 2048, 768, True),
    Model("qwen3-next", 512, 10, 2048, 512, True),
    Model("mixtral-8x7b", 8, 2, 4096, 14336, True),
)}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
PLANS = {"gemv": MoePlan("gemv", "gemv"), "grouped_mm": MoePlan("grouped_mm", "grouped_mm"),
         "gemm": MoePlan("gemm", "gemm"), "pairs": MoePlan("pairs", "pairs")}
MEMORY_BUDGET = 24 << 30  # bytes of weight copies per side (the H100 has ~80 GB)
MAX_COPIES = 64
DEVICE = "cuda"  # tests of the script itself set "cpu" (and replace time_calls)


def git_commit() -> str:
    if os.environ.get("KBIT_COMMIT"):
        return os.environ["KBIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


# ------------------------------------------------------------------------------------------------ layers


class Bf16MoE:
    """The baseline: the same routing and element-wise kernels as KbitMoE, expert matmuls on bf16 weights
    with ``torch._grouped_mm`` (every expert's weight passed; untouched experts have empty groups)."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, kbit_layer: KbitMoE):
        self.gu_t = w_gate_up.transpose(-2, -1)  # [E, H, 2I], column-major matrices as _grouped_mm wants
        self.dn_t = w_down.transpose(-2, -1)
        self.route = kbit_layer.route  # the same expert choice and sort (no weights involved)

    def __call__(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        r: MoeRouting = self.route(logits)
        xs = x.index_select(0, r.token_ids)
        gu = torch._grouped_mm(xs, self.gu_t, offs=r.offsets)
        y = torch._grouped_mm(silu_mul_gate_up(gu), self.dn_t, offs=r.offsets)
        return combine(y, r, x.dtype)


def kbit_copy(layer: KbitMoE) -> KbitMoE:
    """An independent copy of the layer's weights (cloned tensors) sharing its settings: the module deep-copied when
    it holds layout "mma-v1"; else its canonical stacks cloned, with clones of the grouped GEMM's cached repacked
    stacks when it has them (repacking every copy would cost ~0.1 s each)."""
    from kbit.ops.grouped_mma import copy_repacked

    if layer.layout != "canonical":
        return copy.deepcopy(layer)

    gu, dn = layer.gate_up_weight(), layer.down_weight()
    clone = [KbitWeight(*(t.clone() for t in (w.codes, w.scales, w.tensor_scale, w.codebook)), w.shape, w.k,
                        w.blocksize, w.scale_format, w.codebook_name) for w in (gu, dn)]
    for w, c in zip((gu, dn), clone, strict=True):
        copy_repacked(w.codes, w.scales, c.codes, c.scales)
    return KbitMoE.from_weights(*clone, layer.top_k, norm_topk_prob=layer.norm_topk_prob, dtype=layer.dtype)


def stack_bytes(w) -> int:
    if isinstance(w, KbitWeight):
        return w.nbytes
    return w.numel() * w.element_size()


def copies(touched_bytes: int, full_bytes: int) -> tuple[int, bool]:
    """(weight copies, cold): enough copies that the touched bytes of all exceed L2_FACTOR x L2, capped by
    MEMORY_BUDGET / full_bytes and MAX_COPIES (then ``cold`` is False)."""
    want = max(2, L2_FACTOR * l2_bytes() // max(1, touched_bytes) + 1)
    cap = max(2, min(MAX_COPIES, MEMORY_BUDGET // max(1, full_bytes)))
    return int(min(want, cap)), want <= cap


# ------------------------------------------------------------------------------------------------ cases


def make_model(m: Model, k: int, seed: int = 0):
    """(KbitMoE, bf16 dequantized stacks) with random weights (std 1/sqrt(fan-in))."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    gu = torch.randn(m.E, 2 * m.I, m.H, device=DEVICE, generator=g, dtype=torch.bfloat16) / m.H**0.5
    dn = torch.randn(m.E, m.H, m.I, device=DEVICE, generator=g, dtype=torch.bfloat16) / m.I**0.5
    layer = KbitMoE.from_float(gu, dn, top_k=m.top_k, k=k, norm_topk_prob=m.renormalize, dtype=torch.bfloat16)
    del gu, dn
    w_gu = dequantize_triton(layer.gate_up_weight(), torch.bfloat16)
    w_dn = dequantize_triton(layer.down_weight(), torch.bfloat16)
    return layer, w_gu, w_dn


def hold_layout(layer: KbitMoE, plan: MoePlan | None) -> None:
    """The layer in the layout its plan reads as it is: canonical for a plan with the GEMV (it would unrepack a
    stack held in layout "mma-v1" every call); else "mma-v1" where the grouped kernels run, as a served model holds
    it (kbit.hf.decode repacks while warming up), which the layer's own plan (``plan`` None) then reflects."""
    if plan is not None and "gemv" in (plan.gate_up, plan.down):
        layer.to_canonical()
    elif gemm_supported(torch.device(DEVICE), torch.bfloat16):
        layer.repack_for_kernels()


def layer_bytes(layer: KbitMoE) -> int:
    """Bytes of the layer's expert stacks (codes, scales, tensor scales, codebooks) as held."""
    return sum(b.nbytes for n, b in layer.named_buffers() if n.startswith(("gate_up_", "down_")))


def inputs(m: Model, T: int, seed: int = 1):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, m.H, device=DEVICE, generator=g, dtype=torch.bfloat16)
    logits = torch.randn(T, m.E, device=DEVICE, generator=g, dtype=torch.bfloat16)
    return x, logits


def time_side(make_layers, call, touched: int, full: int) -> dict:
    n, cold = copies(touched, full)
    layers = make_layers(n)
    t = time_calls([(lambda lay=lay: call(lay)) for lay in layers])
    del layers
    return {"us": t.us, "us_min": t.us_min, "us_max": t.us_max, "copies": t.calls, "mode": t.mode, "cold": cold}


def routing_kind(plan: MoePlan, T: int) -> str:
    """How ``KbitMoE.route`` sorts the pairs for ``plan`` (mirrors it; a label for the table)."""
    if plan.needs_groups or T > SORT_PAIRS_MAX_T:
        return "align"
    if T == 1 or (T <= PAIR_ORDER_MAX_T and "gemm" not in (plan.gate_up, plan.down)):
        return "pairs"
    return "sort_pairs"


def run_case(m: Model, k: int, T: int, plan_name: str, layer: KbitMoE, w_gu, w_dn) -> dict:
    x, logits = inputs(m, T)
    hold_layout(layer, PLANS.get(plan_name))
    plan = PLANS.get(plan_name) or layer.plan_for(T, dtype=torch.bfloat16)  # "auto": the layer's own pick
    r = layer.route(logits)
    touched_experts = int(r.touched)  # host read outside any timing
    per_expert_kbit = layer_bytes(layer) / m.E
    per_expert_bf16 = (stack_bytes(w_gu) + stack_bytes(w_dn)) / m.E
    row = {"model": m.name, "k": k, "T": T, "pairs": T * m.top_k, "touched_experts": touched_experts,
           "plan": plan_name, "kernels": f"{plan.gate_up}/{plan.down}",
           "routing": routing_kind(plan, T)}
    bf16 = Bf16MoE(w_gu, w_dn, layer)
    with torch.no_grad():
        out = layer(x, logits, plan=plan)
        ref = bf16(x, logits)
        if x.is_cuda:
            torch.cuda.synchronize()
        row["rel_diff_vs_bf16"] = relative_error(out, ref)
        kb = time_side(lambda n: [layer] + [kbit_copy(layer) for _ in range(n - 1)],
                       lambda lay: lay(x, logits, plan=plan), int(touched_experts * per_expert_kbit),
                       layer_bytes(layer))
        torch.cuda.empty_cache()
        bf = time_side(lambda n: [bf16] + [Bf16MoE(w_gu.clone(), w_dn.clone(), layer) for _ in range(n - 1)],
                       lambda lay: lay(x, logits), int(touched_experts * per_expert_bf16),
                       stack_bytes(w_gu) + stack_bytes(w_dn))
    row.update({f"kbit_{key}": v for key, v in kb.items()})
    row.update({f"bf16_{key}": v for key, v in bf.items()})
    row["speedup"] = bf["us"] / kb["us"]
    row["kbit_TBps"] = touched_experts * per_expert_kbit / (kb["us"] * 1e-6) / 1e12
    row["bf16_TBps"] = touched_experts * per_expert_bf16 / (bf["us"] * 1e-6) / 1e12
    return row


def plan_for_tokens(spec: str, T: int) -> tuple[str, bool]:
    """``"gemv"`` -> (gemv, True); ``"gemv<=16"`` / ``"grouped_mm>=256"``: whether T is in range."""
    for op in ("<=", ">="):
        if op in spec:
            name, bound = spec.split(op)
            return name, (T <= int(bound)) if op == "<=" else (T >= int(bound))
    return spec, True


def run_model(m: Model, k: int, tokens, plans, budget_s: float, rows: list) -> None:
    start = time.time()
    try:
        layer, w_gu, w_dn = make_model(m, k)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on with the next model
        rows.append({"model": m.name, "k": k, "error": f"setup: {type(e).__name__}: {e}"})
        print(f"[{m.name}] setup failed: {e}", flush=True)
        return
    for T in tokens:
        for spec in plans:
            plan_name, ok = plan_for_tokens(spec, T)
            if not ok:
                continue
            if time.time() - start > budget_s:
                rows.append({"model": m.name, "k": k, "T": T, "plan": plan_name, "error": "skipped: model budget"})
                continue
            t0 = time.time()
            try:
                row = run_case(m, k, T, plan_name, layer, w_gu, w_dn)
                print(f"[{m.name} k={k} T={T} {plan_name}] kbit {row['kbit_us']:.1f} us ({row['kernels']}), bf16 "
                      f"{row['bf16_us']:.1f} us, x{row['speedup']:.2f}, diff {row['rel_diff_vs_bf16']:.2e} "
                      f"({time.time() - t0:.0f} s)", flush=True)
            except Exception as e:  # noqa: BLE001 - one failing case must not end the run
                row = {"model": m.name, "k": k, "T": T, "plan": plan_name, "error": f"{type(e).__name__}: {e}"}
                print(f"[{m.name} k={k} T={T} {plan_name}] FAILED: {e}\n{traceback.format_exc(limit=3)}", flush=True)
            rows.append(row)
            gc.collect()
            torch.cuda.empty_cache()
    del layer, w_gu, w_dn
    gc.collect()
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ report


def markdown(meta: dict, rows: list) -> str:
    lines = [f"# KbitMoE vs bf16 grouped_mm ({meta['device']}, {meta['date']})", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}. Whole layer (router logits "
             "in, hidden out), CUDA graphs, weight copies rotated for a cold L2 (`cold` = 8 x L2 reached).", "",
             "| model | k | T | plan | kernels | routing | experts | kbit us | bf16 us | speedup | kbit TB/s | cold "
             "| diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r.get('k', '')} | {r.get('T', '')} | {r.get('plan', '')} | "
                         f"error: {r['error'][:80]} | | | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['k']} | {r['T']} | {r['plan']} | {r['kernels']} | {r.get('routing', '')} | "
                     f"{r['touched_experts']} | "
                     f"{r['kbit_us']:.1f} | {r['bf16_us']:.1f} | {r['speedup']:.2f} | {r['kbit_TBps']:.2f} | "
                     f"{'y' if r['kbit_cold'] and r['bf16_cold'] else 'n'} | {r['rel_diff_vs_bf16']:.1e} |")
    return "\n".join(lines) + "\n"


def short_table(rows: list) -> str:
    out = [f"{'model':<14} {'k':>1} {'T':>5} {'plan':<10} {'kbit us':>9} {'bf16 us':>9} {'x':>5}"]
    for r in rows:
        if "error" in r:
            out.append(f"{r['model']:<14} {r.get('k', ''):>1} {r.get('T', ''):>5} {r.get('plan', ''):<10} "
                       f"{r['error'][:40]}")
        else:
            out.append(f"{r['model']:<14} {r['k']:>1} {r['T']:>5} {r['plan']:<10} {r['kbit_us']:>9.1f} "
                       f"{r['bf16_us']:>9.1f} {r['speedup']:>5.2f}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--k", default="4", help="comma-separated bits per weight")
    p.add_argument("--plans", default="auto", help="comma-separated: auto, gemv, grouped_mm, gemm, pairs; a plan "
                   "may carry a token range: gemv<=16, grouped_mm>=256")
    p.add_argument("--budget-s", type=float, default=150.0, help="seconds per (model, k)")
    p.add_argument("--quick", action="store_true", help="T in {1, 64, 1024} only")
    p.add_argument("--tests", action="store_true", help="run pytest -m gpu tests/test_moe.py first")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA GPU")
    out_dir = Path(os.environ.get("OUT") or ROOT / "benchmarks/results/h100")
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.tests:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_moe.py"], cwd=ROOT,
                             capture_output=True, text=True)
        (out_dir / "moe_gpu_tests.log").write_text(res.stdout + res.stderr)
        print(res.stdout[-3000:], flush=True)
    tokens = (1, 64, 1024) if a.quick else tuple(int(t) for t in a.tokens.split(","))
    plans = [s.strip() for s in a.plans.split(",") if s.strip()]
    for s in plans:
        name = plan_for_tokens(s, 1)[0]
        if name != "auto" and name not in PLANS:
            sys.exit(f"--plans: expected auto, gemv, grouped_mm, gemm or pairs (optionally <=T / >=T), got {s!r}")
    import triton

    meta = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
            "l2_bytes": l2_bytes(), "models": {n: asdict(m) for n, m in MODELS.items()},
            "command": "python3 benchmarks/bench_moe.py " + " ".join(sys.argv[1:])}
    rows: list = []
    for name in a.models.split(","):
        if name not in MODELS:
            rows.append({"model": name, "error": f"unknown model (expected one of {list(MODELS)})"})
            continue
        for k in (int(v) for v in a.k.split(",")):
            run_model(MODELS[name], k, tokens, plans, a.budget_s, rows)
            (out_dir / "moe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            (out_dir / "moe.md").write_text(markdown(meta, rows))  # after each model: a cut-off run keeps these
    print("\n" + short_table(rows), flush=True)


if __name__ == "__main__":
    main()

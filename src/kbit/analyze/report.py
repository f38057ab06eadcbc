"""Workload report from committed benchmark results (no GPU, no new measurements).

(a) Per-transformer-block cost: a Llama-3-8B-like dense block built from the measured shapes
    (``PROJECTIONS`` says which measured shape stands for which projection). Per M and k: the sum over the
    projections of the best kbit kernel time, against the sum of bf16 cuBLAS times.
(b) Workload-weighted kbit/bf16 time ratio by number of concurrent users under a continuous-batching
    scheduler with chunked prefill (see ``step_weights``), weighted by the token distributions shipped in
    ``token_distributions.json``. Times between measured M are interpolated linearly in log(time) vs log(M).
(c) Whole MoE layer rows (kbit vs bf16) as measured.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections import defaultdict
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path

# kbit kernels from the kbit-bench file (gemv-*.json): the best of these is "best kbit" at M = 1..8.
# kbit-linear (the dispatching module) is left out: it runs one of these plus Python overhead.
GEMV_KBIT_KERNELS = ("gemv", "gemm-fused", "dequant+cublas")
# kbit rows in the gemm-lab file: two fused-GEMM configurations and dequant + cuBLAS.
LAB_KBIT_KERNELS = {"fused0": "gemm-fused(cfg0)", "fused1": "gemm-fused(cfg1)", "dequant_mm": "dequant+cublas"}

# projection -> measured (N, K) standing for it in a Llama-3-8B-like block (hidden 4096, MLP 14336, GQA 8 kv).
# gate_up is the fused gate+up projection (2 * 14336 x 4096 = 28672 x 4096). k_proj/v_proj (1024 x 4096 each,
# ~4% of the block's weights) were not measured and are left out.
PROJECTIONS: tuple[tuple[str, tuple[int, int]], ...] = (
    ("q_proj", (4096, 4096)),
    ("o_proj", (4096, 4096)),
    ("gate_up_proj", (28672, 4096)),
    ("down_proj", (4096, 14336)),
)
MLP = ("gate_up_proj", "down_proj")
USERS = (1, 4, 8, 16, 32, 64)
CHUNKS = (512, 2048)

DEFAULT_GEMV = "benchmarks/results/h100/gemv-2026-11-21.json"
DEFAULT_LAB = "benchmarks/results/h100/gemm-lab-2026-11-21.json"
DEFAULT_MOE = "benchmarks/results/h100/moe-quick-2026-11-21-fused-routing.json"
DEFAULT_QUALITY = "benchmarks/results/cpu/quality-minilm-2026-11-21.json"


# ---------------------------------------------------------------------------------------------- inputs
def load_json(path: str | Path) -> dict:
    with open(path) as f:
        return json.load(f)


def token_distributions(path: str | Path | None = None) -> dict:
    if path is not None:
        return load_json(path)
    return json.loads(resources.files("kbit.analyze").joinpath("token_distributions.json").read_text())


def git_commit_of(path: str | Path) -> str | None:
    """The last commit that touched ``path`` (for files that carry no commit of their own)."""
    try:
        p = Path(path).resolve()
        out = subprocess.run(["git", "log", "-1", "--format=%h", "--", p.name], capture_output=True,
                             text=True, timeout=10, cwd=p.parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_info(path: str | Path, data: dict) -> dict:
    head = data.get("header") or data.get("meta") or {}
    commit = head.get("commit")
    return {"path": str(path), "commit": commit, "committed_in": git_commit_of(path),
            "gpu": head.get("gpu_name") or head.get("device"), "date": head.get("date")}


Series = dict[int, tuple[float, str]]  # M -> (us, kernel)


def measured(gemv: dict | None, lab: dict | None):
    """-> (kbit, bf16): kbit[(N, K)][k][M] = (best us, kernel name); bf16[(N, K)][M] = us.

    The gemv file covers M = 1..8 (all k); the gemm-lab file M = 16..4096 (k = 2, 4). Where both have an M,
    the gemv file wins (not the case for the committed files)."""
    kbit: dict = defaultdict(lambda: defaultdict(dict))
    bf16: dict = defaultdict(dict)

    def put_kbit(shape, k, m, us, name, overwrite):
        cur = kbit[shape][k].get(m)
        if cur is None or us < cur[0] or overwrite:
            kbit[shape][k][m] = (float(us), name)

    for src_i, data in enumerate((lab, gemv)):  # gemv last, so it overrides
        if not data:
            continue
        seen: set = set()
        for r in data["rows"]:
            if r.get("E", 1) != 1 or r.get("us") is None:
                continue
            shape = (int(r["N"]), int(r["K"]))
            name = r.get("kernel") if src_i == 1 else LAB_KBIT_KERNELS.get(r.get("what"))
            is_bf16 = (r.get("kernel") == "bf16") if src_i == 1 else (r.get("what") == "bf16")
            if is_bf16:
                bf16[shape][int(r["M"])] = float(r["us"])
            elif name and (src_i == 0 or name in GEMV_KBIT_KERNELS):
                key = (shape, int(r["k"]), int(r["M"]))
                put_kbit(shape, int(r["k"]), int(r["M"]), r["us"], name, overwrite=key not in seen)
                seen.add(key)
    return kbit, bf16


# ---------------------------------------------------------------------------------------------- interpolation
def interp_loglog(points: Mapping[int, float], m: float) -> tuple[float, bool]:
    """Time at ``m`` from measured ``{M: us}``: linear in log(us) vs log(M) between neighbours; outside the
    measured range, the end segment's slope is extended. -> (us, extrapolated)."""
    xs = sorted(points)
    if not xs:
        raise ValueError("no points")
    if m in points:
        return float(points[m]), False
    if len(xs) == 1:
        return float(points[xs[0]]), True
    if m < xs[0]:
        a, b, extra = xs[0], xs[1], True
    elif m > xs[-1]:
        a, b, extra = xs[-2], xs[-1], True
    else:
        i = next(i for i in range(1, len(xs)) if xs[i] > m)
        a, b, extra = xs[i - 1], xs[i], False
    la, lb = math.log(a), math.log(b)
    ya, yb = math.log(points[a]), math.log(points[b])
    t = (math.log(m) - la) / (lb - la)
    return math.exp(ya + t * (yb - ya)), extra


# ---------------------------------------------------------------------------------------------- (a) block
def block_table(kbit, bf16, projections=PROJECTIONS) -> dict:
    """Per measured M: for the full block where every projection's shape is measured at M (else the MLP part
    only), bf16 and best-kbit sums per k."""
    ks = sorted({k for shape in kbit.values() for k in shape})
    ms = sorted({m for s in bf16.values() for m in s})
    rows = []
    for m in ms:
        for scope_name, names in (("block", [p for p, _ in projections]), ("mlp", list(MLP))):
            shapes = [dict(projections)[p] for p in names if p in dict(projections)]
            if not shapes or any(m not in bf16.get(s, {}) for s in shapes):
                continue
            row = {"M": m, "scope": scope_name, "projections": names,
                   "bf16_us": sum(bf16[s][m] for s in shapes), "k": {}}
            for k in ks:
                if all(m in kbit.get(s, {}).get(k, {}) for s in shapes):
                    us = sum(kbit[s][k][m][0] for s in shapes)
                    row["k"][k] = {"us": us, "speedup": row["bf16_us"] / us,
                                   "kernels": {p: kbit[dict(projections)[p]][k][m][1] for p in names}}
            rows.append(row)
            break  # the full block when it is measured, else the MLP part
    return {"ks": ks, "rows": rows}


# ---------------------------------------------------------------------------------------------- (b) workload
def mean_tokens(freq: Mapping[str, float]) -> float:
    return sum(float(t) * f for t, f in freq.items())


def step_weights(users: int, chunk: int, dists: dict) -> dict[int, float]:
    """Fraction of scheduler steps at each M (sums to 1) for ``users`` concurrent users, each running turns
    drawn from the token distributions, under continuous batching with chunked prefill of ``chunk`` tokens:

    * decode: the users' generations are batched, so a turn-round costs E[generated] steps at M = users;
    * prefill: each user's input of I tokens is split into I // chunk chunks of ``chunk`` plus one of the
      remainder; each chunk is one step at M = chunk_tokens + (users - 1) (the other users decode alongside).
    """
    gen = dists["generated_tokens_per_turn"]["freq"]
    inp = dists["input_tokens_per_turn"]["freq"]
    counts: dict[int, float] = defaultdict(float)
    counts[users] += mean_tokens(gen)
    for tok, f in inp.items():
        n_tok = int(float(tok))
        full, rem = divmod(n_tok, chunk)
        if full:
            counts[chunk + users - 1] += users * f * full
        if rem:
            counts[rem + users - 1] += users * f
    total = sum(counts.values())
    return {m: c / total for m, c in sorted(counts.items())}


def workload_table(kbit, bf16, dists, users=USERS, chunks=CHUNKS, names=MLP, projections=PROJECTIONS) -> dict:
    shapes = [dict(projections)[p] for p in names]
    # only the k measured at every M where bf16 was (k = 3, 5 stop at M = 8: not extrapolated to 2000)
    ks = sorted(k for k in set.intersection(*[set(kbit[s]) for s in shapes])
                if all(set(bf16[s]) <= set(kbit[s][k]) for s in shapes)) if shapes else []
    e_in = mean_tokens(dists["input_tokens_per_turn"]["freq"])
    e_gen = mean_tokens(dists["generated_tokens_per_turn"]["freq"])
    rows = []
    for chunk in chunks:
        for u in users:
            w = step_weights(u, chunk, dists)
            t_bf16, extra_bf16 = 0.0, False
            t_dec_bf16 = 0.0
            for m, wm in w.items():
                for s in shapes:
                    us, ex = interp_loglog(bf16[s], m)
                    t_bf16 += wm * us
                    t_dec_bf16 += wm * us if m == u else 0.0
                    extra_bf16 |= ex
            cell = {"users": u, "chunk": chunk, "decode_step_share": w.get(u, 0.0),
                    "decode_time_share_bf16": t_dec_bf16 / t_bf16, "k": {}}
            for k in ks:
                t_k, extra, time_by_kernel = 0.0, extra_bf16, defaultdict(float)
                for m, wm in w.items():
                    for s in shapes:
                        pts = {mm: v[0] for mm, v in kbit[s][k].items()}
                        us, ex = interp_loglog(pts, m)
                        t_k += wm * us
                        extra |= ex
                        time_by_kernel[_nearest_kernel(kbit[s][k], m)] += wm * us
                cell["k"][k] = {"ratio": t_k / t_bf16, "extrapolated": extra,
                                "kernel_time_share": {n: v / t_k for n, v in
                                                      sorted(time_by_kernel.items(), key=lambda x: -x[1])}}
            rows.append(cell)
    return {"ks": ks, "projections": list(names), "mean_input_tokens": e_in, "mean_generated_tokens": e_gen,
            "input_token_share": e_in / (e_in + e_gen), "rows": rows}


def _nearest_kernel(series: Series, m: float) -> str:
    best = min(series, key=lambda x: abs(math.log(x) - math.log(m)))
    return series[best][1]


# ---------------------------------------------------------------------------------------------- (c) MoE
def moe_rows(moe: dict | None) -> list[dict]:
    if not moe:
        return []
    keep = ("model", "k", "T", "kernels", "kbit_us", "bf16_us", "speedup")
    return [{k: r.get(k) for k in keep} for r in moe.get("rows", [])]


# ---------------------------------------------------------------------------------------------- build + render
def build(gemv_path=DEFAULT_GEMV, lab_path=DEFAULT_LAB, moe_path=DEFAULT_MOE, dists_path=None) -> dict:
    gemv = load_json(gemv_path) if gemv_path and Path(gemv_path).exists() else None
    lab = load_json(lab_path) if lab_path and Path(lab_path).exists() else None
    moe = load_json(moe_path) if moe_path and Path(moe_path).exists() else None
    dists = token_distributions(dists_path)
    kbit, bf16 = measured(gemv, lab)
    sources = [source_info(p, d) for p, d in ((gemv_path, gemv), (lab_path, lab), (moe_path, moe)) if d]
    return {
        "sources": sources,
        "projections": {p: f"{n}x{k}" for p, (n, k) in PROJECTIONS},
        "block": block_table(kbit, bf16),
        "workload": workload_table(kbit, bf16, dists),
        "moe": moe_rows(moe),
    }


def _src_line(sources: Iterable[dict], which: Iterable[int]) -> str:
    out = []
    srcs = list(sources)
    for i in which:
        if i < len(srcs):
            s = srcs[i]
            c = f"measured at commit {s['commit']}" if s["commit"] else "the file records no commit"
            gpu = f"; {s['gpu']}" if s["gpu"] else ""
            out.append(f"`{s['path']}` ({c}; added to the repo in {s['committed_in'] or '?'}{gpu})")
    return "Source: " + "; ".join(out) + "."


def render_markdown(rep: dict, plots: Iterable[str] = ()) -> str:
    L: list[str] = []
    L += ["# kbit workload analysis (H100)", "",
          "Generated by `kbit analyze` from committed result files only; no new measurements. "
          "Times are CUDA-graph replays (µs) as recorded in the files.", ""]
    L += ["## (a) Cost per transformer block", "",
          "A Llama-3-8B-like dense block (hidden 4096, MLP 14336) from the measured shapes: " +
          ", ".join(f"{p} = {s}" for p, s in rep["projections"].items()) +
          " (gate_up is the fused gate+up projection, 2 x 14336 rows). k_proj/v_proj (1024 x 4096 each, ~4% of "
          "the block's weights) were not measured and are left out. Per cell: the sum over projections of the "
          "best kbit kernel's time (gemv, gemm-fused, dequant+cuBLAS) and the speedup vs the sum of bf16 "
          "cuBLAS times. At M >= 16 the 4096x4096 shape was not measured, so those rows are the MLP part "
          "(gate_up + down) only (scope `mlp`); the gemm-lab file has k = 2 and 4 only.", ""]
    ks = rep["block"]["ks"]
    L.append("| M | scope | bf16 µs | " + " | ".join(f"k={k} µs (x)" for k in ks) + " | best kernels (k=4) |")
    L.append("|--:|---|--:|" + "--:|" * len(ks) + "---|")
    for r in rep["block"]["rows"]:
        cells = []
        for k in ks:
            c = r["k"].get(k) or r["k"].get(str(k))
            cells.append(f"{c['us']:.1f} ({c['speedup']:.2f}x)" if c else "–")
        c4 = r["k"].get(4) or r["k"].get("4")
        kern = ", ".join(f"{p.replace('_proj', '')}: {n}" for p, n in c4["kernels"].items()) if c4 else ""
        L.append(f"| {r['M']} | {r['scope']} | {r['bf16_us']:.1f} | " + " | ".join(cells) + f" | {kern} |")
    L += ["", _src_line(rep["sources"], (0, 1)), ""]

    w = rep["workload"]
    L += ["## (b) Workload-weighted kbit / bf16 time by concurrent users", "",
          f"Weighted by `token_distributions.json` (~24k turns of a coding-assistant workload): mean "
          f"{w['mean_input_tokens']:.0f} input (prefill) and {w['mean_generated_tokens']:.0f} generated (decode) "
          f"tokens per turn, so {100 * w['input_token_share']:.0f}% of tokens are prefill. Scheduler model: "
          "continuous batching with chunked prefill. Per turn-round of all users: E[generated] decode steps at "
          "M = users (generations batched in lockstep), and per user its input split into chunks of the chunk "
          "size (plus a remainder chunk), each one step at M = chunk tokens + users - 1. The ratio is "
          "sum(weight x kbit time) / sum(weight x bf16 time) over steps, for the MLP part of the block "
          "(" + " + ".join(w["projections"]) + ": the only shapes measured at every M). "
          "Times between measured M (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096) are interpolated linearly "
          "in log(time) vs log(M); `*` marks a cell that needed extrapolation beyond the measured M. "
          "Below 1 = kbit faster. Chunk 2048 is the primary setting (a common chunked-prefill token budget); "
          "chunk 512 is shown for comparison.", ""]
    ks = w["ks"]
    for chunk in sorted({r["chunk"] for r in w["rows"]}, reverse=True):
        L.append(f"**Chunk {chunk}**" + (" (primary)" if chunk == max(r['chunk'] for r in w['rows']) else ""))
        L.append("")
        L.append("| users | decode steps | decode share of bf16 time | " +
                 " | ".join(f"k={k} kbit/bf16" for k in ks) + " | k=4 time by kernel |")
        L.append("|--:|--:|--:|" + "--:|" * len(ks) + "---|")
        for r in w["rows"]:
            if r["chunk"] != chunk:
                continue
            cells = []
            for k in ks:
                c = r["k"].get(k) or r["k"].get(str(k))
                cells.append(f"**{c['ratio']:.2f}x**{'*' if c['extrapolated'] else ''}")
            c4 = r["k"].get(4) or r["k"].get("4")
            shares = ", ".join(f"{n} {100 * v:.0f}%" for n, v in list(c4["kernel_time_share"].items())[:3]) \
                if c4 else ""
            L.append(f"| {r['users']} | {100 * r['decode_step_share']:.0f}% | "
                     f"{100 * r['decode_time_share_bf16']:.0f}% | " + " | ".join(cells) + f" | {shares} |")
        L.append("")
    L += [_src_line(rep["sources"], (0, 1)) + " Token distributions: `src/kbit/analyze/token_distributions.json`.",
          "", "Approximations: lockstep decode (all users decode together; real batches vary as turns end), the "
          "other users' decode tokens during a prefill chunk do not shorten the decode phase, no attention/"
          "KV-cache, norm or sampling time, bucketed (power-of-two) token counts, k/v projections omitted, "
          "the two files are separate runs (bf16 at M <= 8 and M >= 16 measured in different processes), and "
          "the 256 -> 1024 gap is interpolated.", ""]

    if rep.get("moe"):
        L += ["## (c) Whole MoE layer (routing + experts), as measured", "",
              "| model | k | T (tokens) | kernels | kbit µs | bf16 µs | speedup |", "|---|--:|--:|---|--:|--:|--:|"]
        for r in rep["moe"]:
            L.append(f"| {r['model']} | {r['k']} | {r['T']} | {r['kernels']} | {r['kbit_us']:.1f} | "
                     f"{r['bf16_us']:.1f} | {r['speedup']:.2f}x |")
        L += ["", _src_line(rep["sources"], (2,)), ""]

    plots = list(plots)
    if plots:
        L += ["## Plots", ""]
        for p in plots:
            L += [f"![{Path(p).stem}](plots/{Path(p).name})", ""]
    return "\n".join(L).rstrip() + "\n"


def to_jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj

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
import statistics
import subprocess
from collections import defaultdict
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path

from kbit.tuning.mma import default_config as _mma_default_config

# kbit kernels from the kbit-bench file (gemv-*.json): candidates for "best kbit" at M = 1..8.
# kbit-linear (the dispatching module) is left out: it runs one of these plus Python overhead.
GEMV_KBIT_KERNELS = ("gemv", "gemm-fused", "dequant+cublas")
# kbit rows in the gemm-lab file: two fused-GEMM configurations and dequant + cuBLAS.
SWEEP_KBIT_KERNELS = {"fused0": "gemm-fused(cfg0)", "fused1": "gemm-fused(cfg1)", "dequant_mm": "dequant+cublas"}
# the CUDA tensor-core small-M kernel (kbit.ops.gemv_mma) from the mma lab files
MMA_KERNEL = "mma"

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

R = "benchmarks/results/h100/"
DEFAULT_GEMV = R + "gemv-2026-11-21.json"
DEFAULT_LAB = R + "gemm-lab-2026-11-21.json"
# newest first: a (shape, k, M) cell comes from the first file with a row at today's default config
DEFAULT_MMA = (R + "mma-2026-11-21-issue3.json", R + "mma-2026-11-21-final.json")
DEFAULT_MOE = R + "moe-2026-11-21-gemm.json"
DEFAULT_DEQUANT = R + "dequant-2026-11-21.json"
DEFAULT_QUALITY = "benchmarks/results/cpu/quality-minilm-2026-11-21.json"


# ---------------------------------------------------------------------------------------------- inputs
def load_json(path: str | Path) -> dict:
    """A results file; one that is not JSON is a ``ValueError`` naming it."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: expected a JSON results file, got unreadable JSON ({e})") from e


def load_opt(path) -> dict | None:
    return load_json(path) if path and Path(path).exists() else None


def token_distributions(path: str | Path | None = None) -> dict:
    if path is not None:
        return load_json(path)
    return json.loads(resources.files("kbit.analyze").joinpath("token_distributions.json").read_text())


def git_commit_of(path: str | Path) -> str | None:
    """The last commit that touched ``path`` (for files that carry no commit of their own).

    Seven hex digits, whatever git's own abbreviation: git lengthens ``%h`` as a clone's object count grows,
    and the committed report must read the same from every clone.
    """
    try:
        p = Path(path).resolve()
        out = subprocess.run(["git", "log", "-1", "--format=%H", "--", p.name], capture_output=True,
                             text=True, timeout=10, cwd=p.parent)
        return out.stdout.strip()[:7] or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_info(path: str | Path, data: dict, role: str = "") -> dict:
    head = data.get("header") or data.get("meta") or data
    return {"role": role, "path": str(path), "commit": head.get("commit"), "committed_in": git_commit_of(path),
            "gpu": head.get("gpu_name") or head.get("device") or head.get("gpu"), "date": head.get("date"),
            "command": head.get("command")}


def short(path) -> str:
    return Path(str(path)).name



def legacy_default_config(k: int, M: int, N: int, K: int) -> tuple:
    """Today's small-M default config (``kbit.tuning.mma.default_config``) in the positional form result files
    record, so that it can be matched against their rows."""
    return _mma_default_config(k, M, N, K).legacy(k)

def mma_cells(mma_files: Iterable[tuple[str, dict]], default_cfg=None) -> dict:
    """-> {(N, K, k, M): cell} for the small-M kernel, ``mma_files`` newest first.

    A file's rows are ``kind == "mma"`` (fp16 activations; the final sweep, with a same-run bf16 F.linear
    time) or ``kind == "variant"`` (the issue-3 config comparison: several configs a cell, no bf16 time).
    Per file and cell the row at today's default config (``default_cfg(k, M, N, K)``) is taken; a variant
    file contributes only such rows. Sweep files without a row at the default config still count (cell
    flagged ``default=False``): the first file in order with a usable row wins."""
    out: dict = {}
    for path, data in mma_files:
        by: dict = defaultdict(list)
        for r in data.get("rows", []):
            kind = r.get("kind")
            if r.get("us") is None or kind not in ("mma", "variant"):
                continue
            if kind == "mma" and r.get("dtype", "float16") != "float16":
                continue  # the few bf16-activation rows (M = 1, k = 4) are compared in the text only
            by[(int(r["N"]), int(r["K"]), int(r["k"]), int(r["M"]))].append(r)
        for key, rows in by.items():
            if key in out:
                continue
            n, kk, k, m = key
            dflt = tuple(default_cfg(k, m, n, kk)) if default_cfg else None
            at_default = [r for r in rows if dflt is not None and tuple(r.get("cfg") or ()) == dflt]
            if at_default:
                r, is_default = at_default[0], True
            elif rows[0].get("kind") == "mma":
                r, is_default = rows[0], (None if dflt is None else False)
            else:
                continue  # a variant file without the default config: fall back to the next file
            out[key] = {"us": float(r["us"]), "cfg": list(r.get("cfg") or []), "default": is_default,
                        "default_cfg": list(dflt) if dflt else None, "file": short(path),
                        "bf16_us": float(r["bf16_us"]) if r.get("bf16_us") else None}
    return out


def mma_bf16(mma_files: Iterable[tuple[str, dict]]) -> dict:
    """{(N, K): {M: (us, file)}}: the bf16 F.linear times of the mma files (median over a cell's k rows)."""
    out: dict = defaultdict(dict)
    for path, data in mma_files:
        acc: dict = defaultdict(list)
        for r in data.get("rows", []):
            if r.get("kind") == "mma" and r.get("bf16_us") and r.get("dtype", "float16") == "float16":
                acc[(int(r["N"]), int(r["K"]), int(r["M"]))].append(float(r["bf16_us"]))
        for (n, kk, m), v in acc.items():
            if m not in out[(n, kk)]:
                out[(n, kk)][m] = (statistics.median(v), short(path))
    return out


Series = dict[int, tuple[float, str, str]]  # M -> (us, kernel, file)


def measured(gemv: dict | None, lab: dict | None, mma: dict | None = None, bf16_mma: dict | None = None,
             names: Mapping[str, str] | None = None):
    """-> (kbit, bf16, bf16_src): kbit[(N, K)][k][M] = (best us, kernel, file) over every measured kbit
    option of every source; bf16[(N, K)][M] = us; bf16_src[(N, K)][M] = file.

    kbit candidates: the gemv file's gemv / gemm-fused / dequant+cublas (M = 1..8, all k), the gemm-lab
    file's fused configs and dequant+cublas (M = 16..4096, k = 2, 4), the mma cells (``mma_cells``, M = 1..64).
    bf16 (the cuBLAS baseline): the gemv file (M <= 8), else the gemm-lab file, else the mma files' same-run
    F.linear (only where neither has the shape and M: 4096x4096 at M = 16..64 for the committed files).
    ``names``: {"gemv": file, "lab": file} for the provenance."""
    names = dict(names or {})
    kbit: dict = defaultdict(lambda: defaultdict(dict))
    bf16: dict = defaultdict(dict)
    bf16_src: dict = defaultdict(dict)

    def put(shape, k, m, us, name, src):
        cur = kbit[shape][k].get(m)
        if cur is None or us < cur[0]:
            kbit[shape][k][m] = (float(us), name, src)

    for role, data in (("gemv", gemv), ("lab", lab)):
        if not data:
            continue
        src = names.get(role, role)
        for r in data["rows"]:
            if r.get("E", 1) != 1 or r.get("us") is None or "M" not in r:
                continue
            shape, m = (int(r["N"]), int(r["K"])), int(r["M"])
            if role == "gemv":
                name, is_bf16 = r.get("kernel"), r.get("kernel") == "bf16"
            else:
                name, is_bf16 = SWEEP_KBIT_KERNELS.get(r.get("what")), r.get("what") == "bf16"
            if is_bf16:
                if m not in bf16[shape]:  # gemv file first
                    bf16[shape][m], bf16_src[shape][m] = float(r["us"]), src
            elif name and (role == "lab" or name in GEMV_KBIT_KERNELS):
                put(shape, int(r["k"]), m, r["us"], name, src)
    for (n, kk, k, m), c in (mma or {}).items():
        put((n, kk), k, m, c["us"], MMA_KERNEL, c["file"])
    for shape, pts in (bf16_mma or {}).items():
        for m, (us, src) in pts.items():
            if m not in bf16[shape]:
                bf16[shape][m], bf16_src[shape][m] = us, src
    return kbit, bf16, bf16_src


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
def transformer_block_sums(kbit, bf16, projections=PROJECTIONS, bf16_src=None) -> dict:
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
            if bf16_src is not None:
                row["bf16_files"] = sorted({bf16_src[s][m] for s in shapes})
            for k in ks:
                if all(m in kbit.get(s, {}).get(k, {}) for s in shapes):
                    us = sum(kbit[s][k][m][0] for s in shapes)
                    row["k"][k] = {"us": us, "speedup": row["bf16_us"] / us,
                                   "kernels": {p: kbit[dict(projections)[p]][k][m][1] for p in names},
                                   "files": {p: kbit[dict(projections)[p]][k][m][2] for p in names}}
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


# ---------------------------------------------------------------------------------------------- best per cell
def best_table(kbit, bf16, bf16_src) -> list[dict]:
    """Every (shape, k, M) with a kbit time: the best option, its file, and the bf16 baseline used."""
    rows = []
    for shape in sorted(kbit, key=lambda s: (-s[0] * s[1], s)):
        for k in sorted(kbit[shape]):
            for m in sorted(kbit[shape][k]):
                us, name, src = kbit[shape][k][m]
                b = bf16.get(shape, {}).get(m)
                rows.append({"N": shape[0], "K": shape[1], "k": k, "M": m, "us": us, "kernel": name, "file": src,
                             "bf16_us": b, "bf16_file": bf16_src.get(shape, {}).get(m),
                             "speedup": (b / us) if b else None})
    return rows


def mma_summary(cells: Mapping, mma_files: Iterable[tuple[str, dict]], default_known: bool) -> dict:
    """Provenance of the mma cells, and method notes computed from the files."""
    files: dict = defaultdict(list)
    for (n, kk, k, m), c in sorted(cells.items()):
        files[c["file"]].append(f"{n}x{kk} k={k} M={m}")
    not_default = [f"{n}x{kk} k={k} M={m}: {c['file']} cfg {tuple(c['cfg'])}, default now "
                   f"{tuple(c['default_cfg']) if c['default_cfg'] else '?'}"
                   for (n, kk, k, m), c in sorted(cells.items()) if c["default"] is False]
    # bf16-activation rows vs the fp16 ones of the same file (M = 1, k = 4 in the committed final file)
    act = []
    for path, data in mma_files:
        fp16 = {(r["N"], r["K"], r["k"], r["M"]): r["us"] for r in data.get("rows", [])
                if r.get("kind") == "mma" and r.get("dtype") == "float16"}
        for r in data.get("rows", []):
            key = (r.get("N"), r.get("K"), r.get("k"), r.get("M"))
            if r.get("kind") == "mma" and r.get("dtype") == "bfloat16" and key in fp16:
                act.append({"file": short(path), "shape": f"{key[0]}x{key[1]}", "k": key[2], "M": key[3],
                            "bf16_act_us": float(r["us"]), "fp16_act_us": float(fp16[key])})
    return {"cells_by_file": {f: len(v) for f, v in files.items()},
            "cells_from": {f: v for f, v in files.items()}, "not_default": not_default,
            "default_known": default_known, "activation_dtype_check": act}


def bf16_disagreement(bf16, bf16_mma) -> dict | None:
    """How far the mma files' same-run bf16 F.linear times are from the baseline bf16 at the same (shape, M)."""
    diffs = []
    for shape, pts in (bf16_mma or {}).items():
        for m, (us, src) in pts.items():
            b = bf16.get(shape, {}).get(m)
            if b is not None and b != us:
                diffs.append(((us - b) / b, f"{shape[0]}x{shape[1]}", m, src))
    if not diffs:
        return None
    lo, hi = min(diffs), max(diffs)
    return {"n": len(diffs), "min_rel": lo[0], "min_at": f"{lo[1]} M={lo[2]}", "max_rel": hi[0],
            "max_at": f"{hi[1]} M={hi[2]}", "median_rel": statistics.median(d[0] for d in diffs)}


# ---------------------------------------------------------------------------------------------- dequant
def dequant_rows(lab: dict | None, deq: dict | None, backend: str = "cuda-u4") -> list[dict]:
    """The dequantize-only times: the gemm-lab file's (the kernel its dequant+cuBLAS rows ran) against the
    dequant file's ``backend`` (the new default) and its ``triton`` (the previous kernel) in that run."""
    if not deq:
        return []
    new: dict = defaultdict(dict)
    for r in deq.get("rows", []):
        new[(int(r["N"]), int(r["K"]), int(r["k"]))][r.get("backend")] = float(r["us"])
    old = {(int(r["N"]), int(r["K"]), int(r["k"])): float(r["us"])
           for r in (lab or {}).get("rows", []) if r.get("what") == "dequant" and r.get("us")}
    rows = []
    for key in sorted(new, key=lambda x: (-x[0] * x[1], x[2])):
        b = new[key]
        rows.append({"N": key[0], "K": key[1], "k": key[2], "sweep_dequant_us": old.get(key),
                     "new_us": b.get(backend), "new_backend": backend, "triton_us": b.get("triton")})
    return rows


# ---------------------------------------------------------------------------------------------- (c) MoE
def moe_rows(moe: dict | None) -> list[dict]:
    """Per (model, k, T): every plan measured, the best (lowest kbit time) flagged."""
    if not moe:
        return []
    keep = ("model", "k", "T", "plan", "kernels", "kbit_us", "bf16_us", "speedup")
    rows = [{k: r.get(k) for k in keep} for r in moe.get("rows", []) if r.get("kbit_us") is not None]
    best: dict = {}
    for r in rows:
        key = (r["model"], r["k"], r["T"])
        if key not in best or r["kbit_us"] < best[key]["kbit_us"]:
            best[key] = r
    for r in rows:
        r["best"] = best[(r["model"], r["k"], r["T"])] is r
    return rows


# ---------------------------------------------------------------------------------------------- build + render
def build(gemv_path=DEFAULT_GEMV, sweep_path=DEFAULT_LAB, moe_path=DEFAULT_MOE, dists_path=None,
          mma_paths=DEFAULT_MMA, dequant_path=DEFAULT_DEQUANT, default_cfg="auto") -> dict:
    """``default_cfg``: today's mma default-config function; "auto": :func:`legacy_default_config`."""
    gemv, lab, moe, deq = (load_opt(p) for p in (gemv_path, sweep_path, moe_path, dequant_path))
    mma_files = [(p, d) for p in (mma_paths or ()) if (d := load_opt(p))]
    if default_cfg == "auto":
        default_cfg = legacy_default_config if mma_files else None
    dists = token_distributions(dists_path)
    cells = mma_cells(mma_files, default_cfg)
    b_mma = mma_bf16(mma_files)
    kbit, bf16, bf16_src = measured(gemv, lab, cells, b_mma,
                                    names={"gemv": short(gemv_path or ""), "lab": short(sweep_path or "")})
    sources = [source_info(p, d, role) for p, d, role in
               [(gemv_path, gemv, "gemv"), (sweep_path, lab, "lab")] +
               [(p, d, "mma") for p, d in mma_files] + [(moe_path, moe, "moe"), (dequant_path, deq, "dequant")]
               if d]
    return {
        "sources": sources,
        "projections": {p: f"{n}x{k}" for p, (n, k) in PROJECTIONS},
        "block": transformer_block_sums(kbit, bf16, bf16_src=bf16_src),
        "workload": workload_table(kbit, bf16, dists),
        "best": best_table(kbit, bf16, bf16_src),
        "mma": mma_summary(cells, mma_files, default_cfg is not None) if mma_files else None,
        "bf16_mma_vs_baseline": bf16_disagreement(bf16, b_mma),
        "dequant": dequant_rows(lab, deq),
        "moe": moe_rows(moe),
    }


def _src_line(sources: Iterable[dict], roles: Iterable[str]) -> str:
    out = []
    roles = list(roles)
    for s in sources:
        if s.get("role") in roles:
            c = f"measured at commit {s['commit']}" if s["commit"] else "the file records no commit"
            gpu = f"; {s['gpu']}" if s["gpu"] else ""
            out.append(f"`{s['path']}` ({c}; added to the repo in {s['committed_in'] or '?'}{gpu})")
    return "Source: " + "; ".join(out) + "." if out else ""


def _k(d: Mapping, k):
    return d.get(k) if k in d else d.get(str(k))


def _files_of(rep: dict, role: str) -> str:
    return ", ".join(f"`{short(s['path'])}`" for s in rep["sources"] if s.get("role") == role) or "(none)"


def render_markdown(rep: dict, plots: Iterable[str] = ()) -> str:
    L: list[str] = []
    mma, gemv_f, sweep_f = rep.get("mma"), _files_of(rep, "gemv"), _files_of(rep, "lab")
    mma_f = _files_of(rep, "mma")
    L += ["# kbit workload analysis (H100)", "",
          "Generated by `kbit analyze` from committed result files only; no new measurements. "
          "Times are CUDA-graph replays (µs) as recorded in the files. Every kbit time is the best measured "
          "kbit option for its (shape, k, M) over all the sources below: the Triton GEMV, the fused GEMM and "
          f"dequant + cuBLAS of {gemv_f} (M = 1..8), the two fused-GEMM configs and dequant + cuBLAS of "
          f"{sweep_f} (M = 16..4096, k = 2 and 4), and the CUDA tensor-core small-M kernel `mma` "
          f"(`kbit.ops.gemv_mma`, what `kbit.linear` runs for every M <= 32 on CUDA) from {mma_f} (M = 1..64). "
          "These are separate runs (different processes, commits and, for `mma`, fp16 instead of bf16 "
          "activations); the per-cell source file is in the JSON (`best`, `block.rows[].k[].files`).", ""]
    if mma:
        L += _mma_notes(rep, mma)
    L += ["## (a) Cost per transformer block", "",
          "A Llama-3-8B-like dense block (hidden 4096, MLP 14336) from the measured shapes: " +
          ", ".join(f"{p} = {s}" for p, s in rep["projections"].items()) +
          " (gate_up is the fused gate+up projection, 2 x 14336 rows). k_proj/v_proj (1024 x 4096 each, ~4% of "
          "the block's weights) were not measured and are left out. Per cell: the sum over projections of the "
          "best kbit option's time and the speedup vs the sum of bf16 cuBLAS times. The bf16 baseline is the "
          f"bf16 row of {gemv_f} at M <= 8 and of {sweep_f} at M >= 16; 4096x4096 at M = 16..64 is in neither, "
          f"so there it is the same-run bf16 `F.linear` of {mma_f}. Scope `mlp` (gate_up + down only) where "
          "4096x4096 was not measured (M >= 128). k = 3 and 5 were measured up to M = 64 only.", ""]
    ks = rep["block"]["ks"]
    L.append("| M | scope | bf16 µs | " + " | ".join(f"k={k} µs (x)" for k in ks) + " | best kernels (k=4) |")
    L.append("|--:|---|--:|" + "--:|" * len(ks) + "---|")
    for r in rep["block"]["rows"]:
        cells = []
        for k in ks:
            c = _k(r["k"], k)
            cells.append(f"{c['us']:.1f} ({c['speedup']:.2f}x)" if c else "–")
        c4 = _k(r["k"], 4)
        kern = ", ".join(f"{p.replace('_proj', '')}: {n}" for p, n in c4["kernels"].items()) if c4 else ""
        L.append(f"| {r['M']} | {r['scope']} | {r['bf16_us']:.1f} | " + " | ".join(cells) + f" | {kern} |")
    L += ["", _src_line(rep["sources"], ("gemv", "lab", "mma")), ""]

    L += _best_section(rep)

    L += _workload_section(rep)
    if rep.get("moe"):
        L += _moe_section(rep)
    if rep.get("dequant"):
        L += _dequant_section(rep)

    plots = list(plots)
    if plots:
        L += ["## Plots", ""]
        for p in plots:
            L += [f"![{Path(p).stem}](plots/{Path(p).name})", ""]
    return "\n".join(L).rstrip() + "\n"


def _workload_section(rep: dict) -> list[str]:
    """(b): the workload-weighted kbit / bf16 time by concurrent users."""
    L: list[str] = []
    w = rep["workload"]
    L += ["## (b) Workload-weighted kbit / bf16 time by concurrent users", "",
          f"Weighted by `token_distributions.json` (~24k turns of a coding-assistant workload): mean "
          f"{w['mean_input_tokens']:.0f} input (prefill) and {w['mean_generated_tokens']:.0f} generated (decode) "
          f"tokens per turn, so {100 * w['input_token_share']:.0f}% of tokens are prefill. Scheduler model: "
          "continuous batching with chunked prefill. Per turn-round of all users: E[generated] decode steps at "
          "M = users (generations batched in lockstep), and per user its input split into chunks of the chunk "
          "size (plus a remainder chunk), each one step at M = chunk tokens + users - 1. The ratio is "
          "sum(weight x kbit time) / sum(weight x bf16 time) over steps, for the MLP part of the block "
          "(" + " + ".join(w["projections"]) + ": the only shapes measured at every M), with the best "
          "kbit option per M as in (a). "
          "Times between measured M (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096) are interpolated linearly "
          "in log(time) vs log(M); `*` marks a cell that needed extrapolation beyond the measured M. "
          "Below 1 = kbit faster. Chunk 2048 is the primary setting (a common chunked-prefill token budget); "
          "chunk 512 is shown for comparison. Only k = 2 and 4 were measured at every M.", ""]
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
                c = _k(r["k"], k)
                cells.append(f"**{c['ratio']:.2f}x**{'*' if c['extrapolated'] else ''}")
            c4 = _k(r["k"], 4)
            shares = ", ".join(f"{n} {100 * v:.0f}%" for n, v in list(c4["kernel_time_share"].items())[:3]) \
                if c4 else ""
            L.append(f"| {r['users']} | {100 * r['decode_step_share']:.0f}% | "
                     f"{100 * r['decode_time_share_bf16']:.0f}% | " + " | ".join(cells) + f" | {shares} |")
        L.append("")
    L += [_src_line(rep["sources"], ("gemv", "lab", "mma")) +
          " Token distributions: `src/kbit/analyze/token_distributions.json`.",
          "", "Approximations: lockstep decode (all users decode together; real batches vary as turns end), the "
          "other users' decode tokens during a prefill chunk do not shorten the decode phase, no attention/"
          "KV-cache, norm or sampling time, bucketed (power-of-two) token counts, k/v projections omitted, "
          "kbit and bf16 times come from separate runs (see the method notes above), the dequant + cuBLAS "
          "times carry the older dequantize (see (d)), and the 256 -> 1024 gap is interpolated.", ""]
    return L


def _moe_section(rep: dict) -> list[str]:
    """(c): the whole MoE layer rows as measured."""
    L: list[str] = []
    L += ["## (c) Whole MoE layer (routing + experts), as measured", "",
          "Every plan the file measured per (model, k, T); **bold** = the lowest kbit time of that "
          "(model, k, T), the option the report counts. kbit and bf16 times of a row come from that row "
          "(each row timed its own bf16 grouped_mm).", "",
          "| model | k | T (tokens) | plan | kernels | kbit µs | bf16 µs | speedup |",
          "|---|--:|--:|---|---|--:|--:|--:|"]
    for r in rep["moe"]:
        b = "**" if r.get("best") else ""
        L.append(f"| {r['model']} | {r['k']} | {r['T']} | {r.get('plan') or ''} | {r['kernels']} | "
                 f"{b}{r['kbit_us']:.1f}{b} | {r['bf16_us']:.1f} | {b}{r['speedup']:.2f}x{b} |")
    L += ["", _src_line(rep["sources"], ("moe",)) +
          " Its `.md` says `auto` there is the plan choice of the commit it was measured at (the grouped "
          "tensor-core GEMM `gemm` up to 64 rows per touched expert, T = 1 included) and that T = 1 on "
          "small experts went back to the GEMV after that run: the `gemv` rows at T = 1 are that plan.", ""]
    return L


def _mma_notes(rep: dict, mma: dict) -> list[str]:
    L = ["### Method notes: the small-M kernel's files", ""]
    by = mma["cells_by_file"]
    srcs = {short(s["path"]): s for s in rep["sources"] if s.get("role") == "mma"}
    order = list(srcs)
    txt = ("The `mma` cells: per (shape, k, M) the row at today's default launch config "
           "(`kbit.ops.gemv_mma.default_config`) from the newest file that has one (" +
           " before ".join(f"`{f}`" for f in order) + "), else the sweep row of the older file. ")
    if not mma["default_known"]:
        txt = ("The `mma` cells: `kbit.ops.gemv_mma` could not be imported, so today's default config is "
               "unknown; variant rows were skipped and the sweep rows used as they are. ")
    txt += "Cells per file: " + ", ".join(f"`{f}` {n}" for f, n in by.items()) + ". "
    few = {f: v for f, v in mma["cells_from"].items() if len(v) <= 40}
    for f, v in few.items():
        txt += f"From `{f}`: " + _group_cells(v) + ". "
    L += [txt, ""]
    if mma["not_default"]:
        L += [f"{len(mma['not_default'])} cells come from a row whose config is not today's default (no "
              "newer row at the default was measured): " + "; ".join(mma["not_default"]) + ".", ""]
    if mma["activation_dtype_check"]:
        parts = [f"{a['shape']} k={a['k']} M={a['M']}: {a['fp16_act_us']:.1f} (fp16) vs {a['bf16_act_us']:.1f} "
                 f"(bf16)" for a in mma["activation_dtype_check"]]
        L += ["The mma runs use fp16 activations (the other files bf16). The same file's few bf16-activation "
              f"rows ({mma['activation_dtype_check'][0]['file']}), µs: " + "; ".join(parts) + ".", ""]
    d = rep.get("bf16_mma_vs_baseline")
    if d:
        L += [f"bf16 baselines disagree between runs: the mma file's same-run bf16 `F.linear` is "
              f"{100 * d['min_rel']:+.1f}% ({d['min_at']}) to {100 * d['max_rel']:+.1f}% ({d['max_at']}) off the "
              f"gemv/gemm-lab bf16 at the {d['n']} (shape, M) both measured (median {100 * d['median_rel']:+.1f}%). "
              "The report's speedups use the gemv/gemm-lab bf16 wherever it exists, so an `mma` speedup here "
              "can differ from the one in the mma file's `.md` (which divides by its own bf16).", ""]
    return L


def _group_cells(cells: Iterable[str]) -> str:
    """["28672x4096 k=2 M=1", ...] -> "28672x4096: M=1 (k=2, 3), M=8 (k=2)"."""
    by: dict = defaultdict(lambda: defaultdict(list))
    for c in cells:
        shape, k, m = c.split()
        by[shape][int(m[2:])].append(k[2:])
    return "; ".join(f"{shape}: " + ", ".join(f"M={m} (k={', '.join(ks)})" for m, ks in sorted(ms.items()))
                     for shape, ms in by.items())


def _best_section(rep: dict) -> list[str]:
    rows = [r for r in rep.get("best", []) if r["k"] == 4]
    if not rows:
        return []
    ms = sorted({r["M"] for r in rows})
    L = ["### Best measured kbit option per shape (k = 4)", "",
         "Cell: µs, option, speedup vs the bf16 baseline of (a) where one was measured. Options: `mma` "
         "(CUDA small-M kernel), `gemv` (Triton), `gemm-fused` / `gemm-fused(cfg0|cfg1)` (fused GEMM), "
         "`dequant+cublas`. All k and the file of every cell: `best` in the JSON.", "",
         "| N x K | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---|" * len(ms)]
    by: dict = defaultdict(dict)
    for r in rows:
        by[f"{r['N']}x{r['K']}"][r["M"]] = r
    for shape, pts in by.items():
        cells = []
        for m in ms:
            r = pts.get(m)
            if not r:
                cells.append("–")
                continue
            sp = f" {r['speedup']:.2f}x" if r["speedup"] else ""
            cells.append(f"{r['us']:.1f} {r['kernel']}{sp}")
        L.append(f"| {shape} | " + " | ".join(cells) + " |")
    return L + [""]


def _dequant_section(rep: dict) -> list[str]:
    L = ["## (d) Dequantize: the lab's dequant + cuBLAS times predate the new kernel", "",
         "The `dequant+cublas` times above (the best option at M >= 256 in (a)) are the gemm-lab file's, measured "
         "with the older, slower dequantize. The new CUDA dequantize kernel was measured on its own in "
         f"{_files_of(rep, 'dequant')} (a separate run); no dequant + cuBLAS time with it was measured, and the "
         "report does not compute one, so the large-M kbit times above are what was measured, not what "
         "the current code would take. Dequantize-only times, µs:", "",
         "| N x K | k | gemm-lab `dequant` | new (`cuda-u4`) | previous kernel in the same run (`triton`) |",
         "|---|--:|--:|--:|--:|"]
    f = lambda v: f"{v:.1f}" if v is not None else "–"  # noqa: E731
    for r in rep["dequant"]:
        L.append(f"| {r['N']}x{r['K']} | {r['k']} | {f(r['sweep_dequant_us'])} | {f(r['new_us'])} | "
                 f"{f(r['triton_us'])} |")
    return L + ["", _src_line(rep["sources"], ("dequant", "lab")), ""]


def to_jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj

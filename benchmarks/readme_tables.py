"""Regenerate the README's result tables from the committed results files (between the markers
``<!-- tables:begin -->`` and ``<!-- tables:end -->``). Only numbers from those files appear.

    python scripts/readme_tables.py
"""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "benchmarks" / "results" / "h100"
MMA_RESULTS = "mma-2026-11-21-final.json"
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"


def gemv_table(path: Path, kernel: str = "gemv") -> str:
    """M = 1 from a ``kbit bench`` results file: the dispatched kernel (``kernel``) per k next to humming at the
    same k and tinygemm (k = 4), all timed in the same run."""
    d = json.loads(path.read_text())
    h = d["header"]
    rows = [r for r in d["rows"] if r["M"] == 1 and r.get("E", 1) == 1 and r.get("us")]
    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in rows))
    out = [f"M = 1, {h['gpu_name']}, commit {h['commit']}, `{path.relative_to(ROOT)}` (read ceiling "
           f"{h['ceiling_tbps']:.2f} TB/s). Cells: kbit us / % of the read ceiling (all bytes read) / x faster than "
           "bf16, then humming at the same bits [h us] and tinygemm int4 [t us], timed in the same run.", "",
           "| N x K | bf16 us | " + " | ".join(f"k={k}" for k in (2, 3, 4, 5)) + " |", "|---|--:|" + "---|" * 4]

    def find(N, K, kernel, k=None):
        for r in rows:
            if (r["N"], r["K"], r["kernel"]) == (N, K, kernel) and (k is None or r["k"] == k):
                return r
        return None

    for N, K in shapes:
        bf = find(N, K, "bf16")["us"]
        cells = []
        for k in (2, 3, 4, 5):
            r, hm, tg = find(N, K, kernel, k), find(N, K, "humming", k), find(N, K, "tinygemm", k)
            c = f"{r['us']:.1f} / {100 * r['tbps'] / r['ceiling_tbps']:.0f}% / {bf / r['us']:.2f}x" if r else "-"
            c += f" [h {hm['us']:.1f}]" if hm else ""
            c += f" [t {tg['us']:.1f}]" if tg else ""
            cells.append(c)
        out.append(f"| {N}x{K} | {bf:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def floor_table(path: Path) -> str:
    """M = 1..8 from a ``kbit bench --floor`` results file: per k, the dispatcher's M = 1 time, its % of the read
    ceiling, the % a plain read of the same bytes reaches (the ``read`` row: what no kernel of that size can beat),
    and time(M) / time(1) for M = 2, 4, 8."""
    d = json.loads(path.read_text())
    h = d["header"]
    get = {(r["kernel"], r["k"], r["N"], r["K"], r["M"]): r for r in d["rows"] if r.get("E", 1) == 1}
    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in d["rows"] if r.get("E", 1) == 1))
    out = [f"{h['gpu_name']}, commit {h['commit']}, `{path.relative_to(ROOT)}` (read ceiling "
           f"{h['ceiling_tbps']:.2f} TB/s). Cells: M = 1 us / % of the ceiling / % of the ceiling that a plain read "
           "of the same bytes reaches (`kbit bench --floor`) / time at M = 2, 4, 8 over M = 1.", "",
           "| N x K | " + " | ".join(f"k={k}" for k in (2, 3, 4, 5)) + " |", "|---|" + "---|" * 4]
    for N, K in shapes:
        cells = []
        for k in (2, 3, 4, 5):
            r, f = get.get(("kbit-linear", k, N, K, 1)), get.get(("read", k, N, K, 1))
            if not r:
                cells.append("-")
                continue
            c = f"{r['us']:.1f} / {100 * r['tbps'] / r['ceiling_tbps']:.0f}%"
            c += f" / {100 * f['tbps'] / f['ceiling_tbps']:.0f}%" if f else ""
            ms = [get.get(("kbit-linear", k, N, K, M)) for M in (2, 4, 8)]
            c += " / " + ", ".join(f"{m['us'] / r['us']:.2f}" for m in ms if m)
            cells.append(c)
        out.append(f"| {N}x{K} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def mid_table(path: Path) -> str:
    """Mid M (16..64): the old default (kernel 1) against kernel 4 from a scripts/mid_lab.py results file."""
    d = json.loads(path.read_text())
    out = [f"Mid M, k = 4 and 2, bf16 activations, {d['gpu']}, commit {d['commit']}, `{path.relative_to(ROOT)}`. "
           "Cells: us (x faster than bf16 `F.linear`, same run). Kernel 4 is now the default for M 17..64 "
           "(W = 8 warps up to M = 32, 16 above) and for M 9..16 with N >= 8192. On sm_90 session 14's routes (next "
           "table) replace it on these shapes.", "",
           "| k | N x K | M | bf16 | kernel 1 (old default) | kernel 4, 8 warps | kernel 4, 16 warps |",
           "|--:|---|--:|--:|--:|--:|--:|"]
    for r in d["rows"]:
        def c(key, r=r):
            return f"{r[key]:.1f} ({r['bf16_us'] / r[key]:.2f}x)" if r.get(key) else "-"
        out.append(f"| {r['k']} | {r['N']}x{r['K']} | {r['M']} | {r['bf16_us']:.1f} | {c('default')} | "
                   f"{c('4,8,1,2')} | {c('4,16,1,2')} |")
    return "\n".join(out)


def mma_table(path: Path) -> str:
    """The CUDA small-M kernel (kbit.ops.gemv_mma) from a scripts/mma_lab.py results file."""
    d = json.loads(path.read_text())
    rows = [r for r in d["rows"] if r["kind"] == "mma" and r.get("dtype", "float16") == "float16"]
    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in rows))
    get = {(r["N"], r["K"], r["k"], r["M"]): r for r in rows}
    out = [f"Tensor-core small-M kernel (CUDA C++ through NVRTC), fp16 activations, {d['device']}, commit "
           f"{d['commit']}, `{path.relative_to(ROOT)}` (read ceiling {d['ceiling_tbps']:.2f} TB/s). "
           "Cells at M = 1: us / % of the read ceiling (all bytes read) / x faster than bf16 `F.linear`; "
           "last column: time at M = 8 over M = 1, worst k.", "",
           "| N x K | " + " | ".join(f"k={k}" for k in (2, 3, 4, 5)) + " | M=8 / M=1 |", "|---|" + "--:|" * 5]
    for N, K in shapes:
        cells = []
        for k in (2, 3, 4, 5):
            r = get.get((N, K, k, 1))
            cells.append(f"{r['us']:.1f} / {r['pct']:.0f}% / {r['bf16_us'] / r['us']:.2f}x" if r else "-")
        ratios = [get[(N, K, k, 8)]["us"] / get[(N, K, k, 1)]["us"] for k in (2, 3, 4, 5)
                  if (N, K, k, 8) in get and (N, K, k, 1) in get]
        out.append(f"| {N}x{K} | " + " | ".join(cells) + f" | {max(ratios):.2f} |" if ratios else " | - |")
    return "\n".join(out)


def dequant_table(path: Path) -> str:
    d = json.loads(path.read_text())
    m = d["meta"]
    rows = [r for r in d["rows"] if r["backend"] == "cuda-u4"]
    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in rows))
    get = {(r["N"], r["K"], r["k"]): r for r in rows}
    out = [f"Dequantize to bf16 (CUDA kernel, 4 groups of 8 columns a thread), {m['gpu']}, commit {m['commit']}, "
           f"`{path.relative_to(ROOT)}` (read ceiling {m['ceiling_tbps']:.2f} TB/s). Cells: us / TB/s of bytes read "
           "and written / % of the read ceiling.", "", "| N x K | " + " | ".join(f"k={k}" for k in (2, 3, 4, 5)) + " |",
           "|---|" + "--:|" * 4]
    for N, K in shapes:
        out.append(f"| {N}x{K} | " + " | ".join(
            f"{get[(N, K, k)]['us']:.1f} / {get[(N, K, k)]['tbps']:.2f} / {get[(N, K, k)]['pct_ceiling']:.0f}%"
            for k in (2, 3, 4, 5)) + " |")
    return "\n".join(out)


def moe_table(path: Path) -> str:
    d = json.loads(path.read_text())
    m = d["meta"]
    out = [f"Whole MoE layer (router logits in, hidden out), k = 4, {m.get('device', 'H100')}, commit "
           f"{m.get('commit')}, `{path.relative_to(ROOT)}`. `plan`: `auto` is what KbitMoE picks; other plans "
           "are forced for comparison.", "",
           "| model | T | plan (kernels) | kbit us | bf16 grouped_mm us | speedup |", "|---|--:|---|--:|--:|--:|"]
    for r in d["rows"]:
        if r.get("kbit_us") and r.get("bf16_us"):
            out.append(f"| {r['model']} | {r['T']} | {r.get('plan', 'auto')} ({r.get('kernels', '')}) | "
                       f"{r['kbit_us']:.1f} | {r['bf16_us']:.1f} | {r['bf16_us'] / r['kbit_us']:.2f}x |")
    return "\n".join(out)


def e2e_table(path: Path, variant: str = "kbit") -> str:
    d = json.loads(path.read_text())
    m = d["meta"]
    rows = [r for r in d["rows"] if r.get("tokens_per_s")]
    out = [f"End-to-end decode, one CUDA graph per step on both sides, context {m['ctx']}, {m['device']}, commit "
           f"{m['commit']}, `{path.relative_to(ROOT)}` (`{m['command']}`). Cells: tokens/s (x bf16).", "",
           "| model | batch | bf16 | " + " | ".join(f"k={k}" for k in (2, 3, 4, 5)) + " |",
           "|---|--:|--:|" + "--:|" * 4]
    keys = list(dict.fromkeys((r["model"], r["batch"]) for r in rows))
    for model, b in keys:
        bf = [r for r in rows if (r["model"], r["batch"], r["variant"]) == (model, b, "bf16")]
        if not bf:
            continue
        base = max(r["tokens_per_s"] for r in bf)
        cells = []
        for k in (2, 3, 4, 5):
            kr = [r for r in rows if (r["model"], r["batch"], r["variant"], r["k"]) == (model, b, variant, k)]
            cells.append(f"{kr[0]['tokens_per_s']:.1f} ({kr[0]['tokens_per_s'] / base:.2f}x)" if kr else "-")
        out.append(f"| {model} | {b} | {base:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def quantize_table(path: Path) -> str:
    d = json.loads(path.read_text())
    h = d["header"]
    out = [f"Quantizing one 8192 x 28672 bf16 matrix, {h['gpu']}, commit {h['commit']}, "
           f"`{path.relative_to(ROOT)}`.", "", "| k | codebook | scales | ms |", "|--:|---|---|--:|"]
    for r in d["rows"]:
        out.append(f"| {r['k']} | {r['codebook']} | {r['scale_format']} | {r['us'] / 1e3:.2f} |")
    return "\n".join(out)


def sampling_table(path: Path) -> str:
    d = json.loads(path.read_text())
    m = d["meta"]
    out = [f"Fused sampler (`kbit.sample`), V = 151936 fp32 logits, temperature 0.7 + top-k 50 + top-p 0.9, "
           f"{m['gpu']}, commit {m['commit']}, `{path.relative_to(ROOT)}` (`{m['command']}`; CUDA graphs, "
           f"torch reference in the same run; GPU statistical tests: {m['tests']['summary'].split(',')[0]}).", "",
           "| B | kbit us | torch reference us | speedup |", "|--:|--:|--:|--:|"]
    for r in d["cases"]:
        out.append(f"| {r['B']} | {r['kbit_us']:.1f} | {r['ref_us']:.1f} | {r['speedup']:.1f}x |")
    return "\n".join(out)


def gemm_table(path: Path, ks=(4, 2)) -> str:
    """Dense M = 16..4096 from a ``kbit bench`` run with the dispatcher (``kbit-linear``) and dequantize + cuBLAS:
    x faster than bf16 ``F.linear`` in the same run, at the two bit widths ``ks``."""
    d = json.loads(path.read_text())
    h = d["header"]
    rows = [r for r in d["rows"] if r.get("us") and r.get("E", 1) == 1]
    ms = sorted({r["M"] for r in rows})
    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in rows))
    out = [f"Dense GEMM by M, {h['gpu_name']}, commit {h['commit']}, `{path.relative_to(ROOT)}`. Cells: x faster than "
           f"bf16 `F.linear` (same run) for kbit's dispatcher at k = {ks[0]} / k = {ks[1]}, [dequantize + cuBLAS at "
           f"k = {ks[0]}].", "",
           "| N x K | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---|" * len(ms)]

    def sp(N, K, M, kernel, k):
        for r in rows:
            if (r["N"], r["K"], r["M"], r["kernel"], r["k"]) == (N, K, M, kernel, k):
                return f"{r['bf16_us'] / r['us']:.2f}"
        return "-"

    for N, K in shapes:
        cells = [f"{sp(N, K, m, 'kbit-linear', ks[0])} / {sp(N, K, m, 'kbit-linear', ks[1])} "
                 f"[{sp(N, K, m, 'dequant+cublas', ks[0])}]" for m in ms]
        out.append(f"| {N}x{K} | " + " | ".join(cells) + " |")
    return "\n".join(out)

#: hand-written in session 14 (its table from `issue4-s14-mid-2026-11-22.json`), kept verbatim
S14_MID = "### Mid M, session 14 (the dispatcher on sm_90)\n\nDense M = 16 / 32 / 64, k = 4, bf16 activations, NVIDIA H100 80GB HBM3, commit df86bae, `benchmarks/results/h100/issue4-s14-mid-2026-11-22.json` (`kbit bench --m 16,32,64 --k 4 --candidates kbit-linear`). On sm_90, M 9..16 on weights with N >= 8192 and >= 5e7 elements runs kernel 3 with K slices of x in shared memory; every M 17..64 runs kernel 7 (wgmma) with 32- / 64-token tiles, bulk-copied x and stream-K. Both replace kernel 4 there (weights under 2e7 elements keep dequantize + cuBLAS at M 33..256). Other GPUs keep the table above. The table was measured at df86bae, where M 17..32 took kernel 7 only on weights of >= 5e7 elements (all four shapes here); since then every weight does at M 17..32 (the lab's small shapes, `k7-s14-small-shapes.log`, e.g. 4096x4096 M = 32 22.9 -> 18.3 us). The lab runs behind the choice are `benchmarks/results/h100/k7-s14-*.log` and `m16-s14-xk-sweep1.log`. Since session 19, M 9..16 on weights under 2e8 elements (k = 5: 1e8) whose CTAs can own whole tiles runs kernel 3 with CTA-aligned units instead of K slices, and k = 2 on N >= 16384 above 2e8 runs kernel 3 with 16-warp CTAs (`issue4-s19-m16-2026-11-22.md`, docs/notes/gemv.md \"Session 19\"; 28672x4096 at M = 16: k = 4 36.90 us, 2.34x; k = 2 28.32 us, 3.05x).\n\n| N x K | M | bf16 us | kbit us | x bf16 | route |\n|---|--:|--:|--:|--:|---|\n| 28672x4096 | 16 | 86.6 | 37.1 | 2.34 | kernel 3, x slices |\n| 28672x4096 | 32 | 88.7 | 52.0 | 1.71 | kernel 7, 32-token tiles |\n| 28672x4096 | 64 | 90.4 | 65.8 | 1.37 | kernel 7, 64-token tiles |\n| 4096x14336 | 16 | 46.5 | 21.4 | 2.18 | kernel 1 (unchanged) |\n| 4096x14336 | 32 | 47.3 | 31.0 | 1.53 | kernel 7, 32-token tiles |\n| 4096x14336 | 64 | 48.5 | 42.2 | 1.15 | kernel 7, 64-token tiles |\n| 57344x8192 | 16 | 330.6 | 125.7 | 2.63 | kernel 3, x slices |\n| 57344x8192 | 32 | 330.3 | 147.9 | 2.23 | kernel 7, 32-token tiles |\n| 57344x8192 | 64 | 339.0 | 194.2 | 1.75 | kernel 7, 64-token tiles |\n| 8192x28672 | 16 | 167.3 | 66.1 | 2.53 | kernel 3, x slices |\n| 8192x28672 | 32 | 171.4 | 79.7 | 2.15 | kernel 7, 32-token tiles |\n| 8192x28672 | 64 | 175.4 | 105.9 | 1.66 | kernel 7, 64-token tiles |"  # noqa: E501


def main():
    parts = ["### Small-M kernel (M = 1..64)", mma_table(RES / MMA_RESULTS),
             "### Small batch (M = 1) with peers, same run", gemv_table(RES / "issue3-session5b-2026-11-22.json"),
             "Session 16, the dispatcher (`kbit-linear`) without peers (so no bracketed cells), after kernel 1's "
             "earlier first loads and faster table build (M <= 8 below 2e8 weights) and the one-tile-a-CTA routes on "
             "mid-size weights:",
             gemv_table(RES / "m1-s16-2026-11-22.json", "kbit-linear"),
             "Session 17, the dispatcher with peers in the same run (k = 5 lookup table without bank conflicts, the "
             "M = 1 accumulator trim, x staged in shared memory at M = 2..8 on kernel 3):",
             gemv_table(RES / "issue3-s17b-2026-11-22.json", "kbit-linear"),
             "The same run with the read floor of each size and the M = 2, 4, 8 ratios:",
             floor_table(RES / "issue3-s17b-2026-11-22.json"),
             "### Mid M (kernel 4)", mid_table(RES / "mid-2026-11-21-run3.json"),
             S14_MID,
             "### Mid M, session 15 (split-K workspace, small weights on kernel 1)",
             "Where more than four parts add to a tile (kernel 7 stream-K on N <= 8192, kernel 3 x slices on "
             "long K) the split-K workspace holds a lane's four sums together and adds them with one "
             "`red.global.add.v4.f32` (fewer parts keep one atomic a value; `ws4-ab3-2026-11-22.md`); weights "
             "under 2e7 elements at M 17..64 run kernel 1 instead of kernel 7 / dequantize + cuBLAS. k = 4 only "
             "in this run (the dispatcher's choice):",
             gemm_table(RES / "mid-s15-final-2026-11-22.json").replace(" / - [-]", "").replace(
                 "at k = 4 / k = 2, [dequantize + cuBLAS at k = 4]", "at k = 4"),
             "### Small batch on mid-size weights, session 16 (kernel 1, a CTA a tile)",
             "M <= 8 on weights of 4224 < N <= 16 x 3 x SMs rows (6336 on an H100) below 2e8 elements run kernel 1 "
             "with a CTA a 16-row tile (3 CTAs an SM, K unsplit, no workspace) instead of kernel 3; at k = 2 also up "
             "to 16 x 4 x SMs rows (4 CTAs an SM) and 16 x 6 x SMs (4-warp CTAs, 6 an SM). Same-run before/after: "
             "`m1-one-tile-s16-ab.log`, `k2-wide-s16-ab.log` (e.g. 6144x4096 M = 1 k = 2 9.01 -> 6.23 us, k = 4 "
             "9.36 -> 8.67; 12288x4096 k = 2 13.11 -> 10.59). The fast decode step's fused q/k/v keeps kernel 3 "
             "(its norm prologue): a kernel-1 prologue measured no change end to end "
             "(`e2e-s16-k1pro-dropped.log`). After the change:",
             gemm_table(RES / "small-mid-s16-2026-11-22.json").replace(" [-]", "").replace(
                 "Dense GEMM by M", "Small batch by M").replace(", [dequantize + cuBLAS at k = 4]", ""),
             "Then k = 3 and 4 also take kernel 1 at 4 CTAs an SM up to 16 x 4 x SMs rows (`m1-cfg-sweep-s16-k34.log`; "
             "e.g. 8192x4096 k = 4 M = 8 13.78 -> 12.28 us, k = 3 12.88 -> 10.48):",
             gemm_table(RES / "k34-s16-2026-11-22.json", ks=(4, 3)).replace(" [-]", "").replace(
                 "Dense GEMM by M", "Small batch by M").replace(", [dequantize + cuBLAS at k = 4]", "").replace(
                 "commit 0540e92+k34", "commit 0540e92+k34 (the tree committed as 518d129)"),
             "### Dense GEMM, M = 16..4096 (the dispatcher; kernel 7 with bulk-copied x above M = 64)",
             gemm_table(RES / "issue4-s6-2026-11-22.json"),
             "Session 16, M = 128 / 256 with the kernels of today (kernel 7 with stream-K, the vector split-K "
             "workspace):",
             gemm_table(RES / "issue4-s16-m128-2026-11-22.json").replace(" [-]", "").replace(
                 ", [dequantize + cuBLAS at k = 4]", ""),
             "After this run the dispatcher sends weights under 2e7 elements (4096x4096 here) at M 33..256 to "
             "dequantize + cuBLAS (the bracketed column), where kernel 7 measured 0.40-0.46x.",
             "Session 21, the dispatcher at every M of issue 4 in one run (the kernels of session 20; a "
             "warp-specialized kernel 7 measured slower this session and was dropped, docs/notes/gemm.md):",
             gemm_table(RES / "issue4-s21-2026-11-23.json").replace(" [-]", "").replace(
                 ", [dequantize + cuBLAS at k = 4]", ""),
             "### Dequantize", dequant_table(RES / "dequant-2026-11-21.json"),
             "### MoE layer", moe_table(RES / "moe-2026-11-21-kernel4.json"),
             "Session 11: with the grouped wgmma kernel (kernel 7 over 64-256-row blocks of one expert, sm_90) "
             "serving steps of 48 or more rows an expert (here Qwen3-30B-A3B at T >= 1024, Qwen3-Next at 4096, "
             "Mixtral at T >= 256; the other rows run the same kernels as above):",
             moe_table(RES / "moe-s11-grouped7-2026-11-22.json"),
             "Sessions 12-13: SiLU * up computed while gathering the down projection's x tiles for kernel 7 (no "
             "separate SwiGLU pass), and kernel 7 doing a chunk's first lookups before its barrier, T = 256..4096:",
             moe_table(RES / "moe-s13-lkh-2026-11-22.json"),
             "Session 22, every T: cheaper copies around kernel 7 at T = 4096 (block table from the group ends, "
             "x gathers without 64-bit index math or padding rows) and the tail split (each expert's last block "
             "of <= 32 rows on kernel 4; stacks of >= 64 experts) for Qwen3-30B-A3B at T = 4096. The A/B of the "
             "split alone is `moe-s22-tail-ab-2026-11-23.md` (1129.8 -> 1056.6 us); runs differ by ~2%:",
             moe_table(RES / "moe-s22-tail-2026-11-23.json"),
             "### End-to-end decode (graphs only)", e2e_table(RES / "e2e-2026-11-21.json"),
             "### End-to-end decode (glue fused by torch.compile, fused q/k/v and gate/up, both sides)",
             e2e_table(RES / "e2e-session3.json"),
             "Same setup, batch 1, after the MoE decode change (grouped kernel 4 on the down projections):",
             e2e_table(RES / "e2e-session3-moe-t1.json"),
             "Llama-3-8B-shaped, batch 1, same setup, with the decode-attention kernel on both sides (session 6):",
             e2e_table(RES / "e2e-s6-2026-11-22.json"),
             "### End-to-end decode, the fast decode step on both sides (session 7)",
             "One-token steps through `kbit.hf.fast_decode` (residual add + RMSNorm, rotary + KV append, SiLU * up, "
             "attention and argmax as kbit kernels with programmatic dependent launch, around the model's own "
             "projections), the default of `StaticDecoder` on CUDA:",
             e2e_table(RES / "e2e-s7b-2026-11-22.json"), e2e_table(RES / "e2e-s7-qwen3-2026-11-22.json"),
             "Same, with the lm_head quantized at k = 4 too (not the default of `quantize_model`):",
             e2e_table(RES / "e2e-s7b-lmhead4-2026-11-22.json", "kbit+head4"),
             "### End-to-end decode, session 8: one attention launch a layer, q/k/v and gate/up quantized jointly",
             "The decode attention loads the keys of earlier steps before its PDL wait and its last split program "
             "merges the partials (one launch a layer); `quantize_model` quantizes q/k/v and gate/up jointly "
             "(`joint=True`, the default) and the fast step runs each group as one GEMV (the kbit side of "
             "`--fuse-proj` is now this library path, not a benchmark-only fusion):",
             e2e_table(RES / "e2e-s8-2026-11-22.json"), e2e_table(RES / "e2e-s8-qwen3-2026-11-22.json"),
             "Same, with the lm_head quantized at k = 4 too (not the default of `quantize_model`):",
             e2e_table(RES / "e2e-s8-lmhead4-2026-11-22.json", "kbit+head4"),
             "### End-to-end decode, session 9: glue folded into the GEMVs, kernel 3 for 2 <= M <= 16 on mid-size N",
             "The fused q/k/v and gate/up GEMVs compute the residual add + RMSNorm in their x prologue and the "
             "gate/up GEMV SiLU * up in its epilogue (`kbit.ops.prologue`); batches 2-16 run kernel 3 on q/k/v "
             "(batch 4 and 16 at commit ccf6bb1 / b4596bc, batch 1 at 7ff78eb, before the M = 2..16 dispatch "
             "change, which does not touch M = 1):",
             e2e_table(RES / "e2e-s9-2026-11-22.json"), e2e_table(RES / "e2e-s9-b4-2026-11-22.json"),
             e2e_table(RES / "e2e-s9-b16-2026-11-22.json"), e2e_table(RES / "e2e-s9-qwen3-2026-11-22.json"),
             "Same, with the lm_head quantized at k = 4 too (not the default of `quantize_model`):",
             e2e_table(RES / "e2e-s9-lmhead4-2026-11-22.json", "kbit+head4"),
             "### End-to-end decode, session 15: batch 32 and 64",
             "After the session-15 mid-M changes (above). Session 14 had measured batch 64 below bf16 (k = 4 0.90x, "
             "k = 2 0.83x, `e2e-s14-b16-b64-2026-11-22.md`); batch 1..16 routes are unchanged:",
             e2e_table(RES / "e2e-s15-b32-b64-2026-11-22.json"),
             "### End-to-end decode, session 18: batch 1 today",
             "Batch 1 after the M = 1 changes of sessions 16-18 (the fused decode GEMVs stage x, so session 18's "
             "CTA-local fix-up does not run in this step):",
             e2e_table(RES / "e2e-s18-llama.json"), e2e_table(RES / "e2e-s18-qwen3.json"),
             "### End-to-end decode, session 19: split-K sums in shared memory (CTA-aligned units)",
             "Kernel 3 builds that stage x (the fused q/k/v and gate/up GEMVs of the decode step) now give each CTA "
             "whole tiles and add the split-K parts in shared memory (`CAU`, docs/notes/gemv.md); the same step "
             "without it: k = 4 2.567 ms, k = 2 2.237 at batch 1 (`e2e-s19-nocau.md`), k = 4 3.001, k = 2 2.688 at "
             "batch 4 (`e2e-s19-b4-nocau.md`):",
             e2e_table(RES / "e2e-s19-cau.json"), e2e_table(RES / "e2e-s19-b4-16.json"),
             e2e_table(RES / "e2e-s19-qwen3.json"),
             "### End-to-end decode, session 20: kernel 1's warp-order sums",
             "Kernel 1 (the o_proj and down GEMVs of this step) adds its warps' sums in warp order at k = 3, 4, 5 "
             "instead of with shared-memory float atomics: bit-identical run to run where K is not split, and faster "
             "(interleaved A/B of the same step at k = 4: 2.434 / 2.415 -> 2.402 / 2.384 ms, `e2e-s20-k1wo0.md`, "
             "`e2e-s20-k1wo1.md`). With the lm_head at k = 2 as well (not the default), k = 2 ran 1.756 ms "
             "(`e2e-s20-k2-lmh2.md`, commit a98e1a7) and 1.832 ms in another call (`e2e-s20-llama-k2-lmh2.md`):",
             e2e_table(RES / "e2e-s20-final.json"),
             "### Sampling", sampling_table(RES / "sampling_v5.json"),
             "### Quantizer", quantize_table(RES / "quantize-2026-11-21.json")]
    readme = ROOT / "README.md"
    text = readme.read_text()
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    readme.write_text(text[:a] + "\n" + "\n\n".join(parts) + "\n" + text[b:])


if __name__ == "__main__":
    main()

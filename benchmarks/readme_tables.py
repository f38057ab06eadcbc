"""Regenerate the README's result tables from committed results files (between the markers
``<!-- tables:begin -->`` and ``<!-- tables:end -->``). Only numbers from those files appear, each table names its
file. To show a newer run, point the constants below at its file and run::

    python benchmarks/readme_tables.py
"""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"

#: the newest results file of each area (H100 unless the folder says otherwise)
DENSE_M1 = RES / "h100" / "issue3-2026-11-22c.json"
DENSE_BY_M = RES / "h100" / "issue4-2026-11-23.json"
MOE = RES / "h100" / "moe-tail-2026-11-23.json"
#: end to end: (model, batch) rows from the newest file that has them
E2E = [RES / "h100" / name for name in ("e2e-h100-2026-11-28b.json", "e2e-h100-2026-11-28b-moe.json",
                                        "e2e-b32-b64-2026-11-22.json")]
QUALITY = RES / "cpu" / "quality-smollm2-2026-11-21.json"
#: the decode-step profiles (``kbit.bench.step_profile``) whose roofline share the end-to-end section quotes: a
#: model's newest folder first
PROFILES = [RES / "h100" / "e2e-profile-2026-11-27b", RES / "h100" / "e2e-profile-2026-11-26"]
#: the model-shape suite (``kbit bench --suite models --peers humming``; the rest file: the smaller shapes at M = 1
#: that the first run's budget left out; the m1 files: every shape at M = 1, k = 2..5; the m1-k4 files: k = 4 again,
#: without T64 and with the 50 ms timing warm-up; the m1-k235 file: k = 2, 3, 5 of the larger half with the warm-up),
#: oldest first: a later file's
#: row of a (kernel, k, shape, M) replaces an earlier one's; the plot of the first
SUITE = [RES / "h100" / "suite-k4-2026-11-27.json", RES / "h100" / "suite-k4-rest-2026-11-27.json",
         RES / "h100" / "suite-k2-2026-11-27.json",
         RES / "h100" / "suite-m1-2026-11-27" / "suite-m1-p1-2026-11-27.json",
         RES / "h100" / "suite-m1-2026-11-27" / "suite-m1-p2-2026-11-27.json",
         RES / "h100" / "suite-m1-k4-2026-11-27" / "suite-m1-k4-p1-2026-11-27.json",
         RES / "h100" / "suite-m1-k4-2026-11-27" / "suite-m1-k4-p2-2026-11-27.json",
         RES / "h100" / "suite-m1-k235-2026-11-27" / "suite-m1-k235-p1-2026-11-27.json",
         RES / "h100" / "suite-m1-k5-2026-11-27" / "suite-m1-k5-p1-2026-11-27.json",
         RES / "h100" / "suite-m1-k5-2026-11-27" / "suite-m1-k5-p2-2026-11-27.json"]
KS = (2, 3, 4, 5)


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _name(path: Path) -> str:
    return f"`{path.relative_to(ROOT)}`"


def dense_m1_table(path: Path) -> str:
    """M = 1 from a ``kbit bench --peers`` file: the dispatcher (``kbit-linear``) per k, with humming at the same k
    and tinygemm (int4), all timed in the same run."""
    d = _load(path)
    h = d["header"]
    rows = {(r["kernel"], r["k"], r["N"], r["K"]): r for r in d["rows"]
            if r["M"] == 1 and r.get("E", 1) == 1 and r.get("us")}
    shapes = list(dict.fromkeys((n, kk) for (_, _, n, kk) in rows))
    out = [f"{h['gpu_name']}, commit {h['commit']}, {_name(path)}; read ceiling {h['ceiling_tbps']:.2f} TB/s. "
           "Cells: kbit us / % of the read ceiling / x faster than bf16 `F.linear`, [h: humming at the same k, "
           "t: tinygemm int4], same run.", "",
           "| N x K | bf16 us | " + " | ".join(f"k={k}" for k in KS) + " |", "|---|--:|" + "---|" * len(KS)]
    for n, kk in shapes:
        bf = rows[("bf16", 16, n, kk)]["us"]
        cells = []
        for k in KS:
            r = rows.get(("kbit-linear", k, n, kk))
            c = f"{r['us']:.1f} / {100 * r['tbps'] / r['ceiling_tbps']:.0f}% / {bf / r['us']:.2f}x" if r else "-"
            peers = [(tag, rows.get((kernel, k, n, kk))) for tag, kernel in (("h", "humming"), ("t", "tinygemm"))]
            c += "".join(f" [{tag} {p['us']:.1f}]" for tag, p in peers if p)
            cells.append(c)
        out.append(f"| {n}x{kk} | {bf:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def dense_by_m_table(path: Path, ks=(4, 2)) -> str:
    """Dense M = 16..4096 from a ``kbit bench`` file: x faster than bf16 ``F.linear`` (same run) at two k."""
    d = _load(path)
    h = d["header"]
    speedup = {(r["N"], r["K"], r["M"], r["k"]): r["bf16_us"] / r["us"] for r in d["rows"]
               if r["kernel"] == "kbit-linear" and r.get("E", 1) == 1 and r.get("us")}
    ms = sorted({m for (_, _, m, _) in speedup})
    shapes = list(dict.fromkeys((n, kk) for (n, kk, _, _) in speedup))
    out = [f"{h['gpu_name']}, commit {h['commit']}, {_name(path)}. Cells: x faster than bf16 `F.linear` (same run) at "
           f"k = {ks[0]} / k = {ks[1]}.", "",
           "| N x K | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "--:|" * len(ms)]
    for n, kk in shapes:
        cells = [" / ".join(f"{speedup[(n, kk, m, k)]:.2f}" if (n, kk, m, k) in speedup else "-" for k in ks)
                 for m in ms]
        out.append(f"| {n}x{kk} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def moe_table(path: Path) -> str:
    """The whole MoE layer (``benchmarks/bench_moe.py``): kbit us and x faster than the bf16 layer, by tokens T."""
    d = _load(path)
    m = d["meta"]
    rows = [r for r in d["rows"] if r.get("kbit_us") and r.get("bf16_us") and r.get("plan", "auto") == "auto"]
    ts = sorted({r["T"] for r in rows})
    get = {(r["model"], r["T"]): r for r in rows}
    out = [f"Router logits in, hidden out, k = 4, {m['device']}, commit {m['commit']}, {_name(path)}. Cells: kbit us "
           "(x faster than bf16 experts on `torch._grouped_mm` with the same routing).", "",
           "| model (E, top-k, H, I) | " + " | ".join(f"T={t}" for t in ts) + " |", "|---|" + "--:|" * len(ts)]
    for model in dict.fromkeys(r["model"] for r in rows):
        c = m["models"][model]
        cells = [f"{get[(model, t)]['kbit_us']:.0f} ({get[(model, t)]['bf16_us'] / get[(model, t)]['kbit_us']:.2f}x)"
                 if (model, t) in get else "-" for t in ts]
        out.append(f"| {model} ({c['E']}, {c['top_k']}, {c['H']}, {c['I']}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def e2e_table(paths: list[Path], ks=(4, 2), note: str = "") -> str:
    """Decode tokens/s (``benchmarks/bench_e2e.py``): a row per model and file, its batches side by side, each
    (model, batch) from the first file in ``paths`` that has it; bf16 and kbit from the same run. ``note``: appended
    to the table's heading paragraph."""
    seen, out = set(), []
    for path in paths:
        d = _load(path)
        rows = [r for r in d["rows"] if r.get("tokens_per_s")]
        by_model: dict = {}
        for model, b in dict.fromkeys((r["model"], r["batch"]) for r in rows):
            if (model, b) not in seen:
                seen.add((model, b))
                by_model.setdefault(model, []).append(b)
        for model, batches in by_model.items():
            tps = {b: {r["k"] if r["variant"] == "kbit" else "bf16": r["tokens_per_s"] for r in rows
                       if (r["model"], r["batch"]) == (model, b) and r["variant"] in ("kbit", "bf16")} for b in batches}
            cells = [" / ".join(f"{tps[b][k]:.0f} ({tps[b][k] / tps[b]['bf16']:.2f}x)" if k in tps[b] else "-"
                                for b in batches) for k in ks]
            bf16 = " / ".join(f"{tps[b]['bf16']:.0f}" for b in batches)
            out.append(f"| {model} | {' / '.join(map(str, batches))} | {bf16} | " + " | ".join(cells)
                       + f" | `{path.name}` ({d['meta']['commit']}) |")
    meta = [_load(path)["meta"] for path in paths]
    devices = ", ".join(dict.fromkeys(m["device"] for m in meta))
    contexts = ", ".join(dict.fromkeys(str(m["ctx"]) for m in meta))
    flags = "`, `".join(dict.fromkeys("--fuse --fuse-proj" if m.get("fuse") else "--fuse-proj" for m in meta))
    head = [f"{devices}, one CUDA graph a decode step on both sides, context {contexts}, `StaticDecoder`'s fast "
            f"decode step, q/k/v and gate/up fused on both sides (`{flags}`: each file's command is in it). Cells: "
            f"tokens/s (x bf16) at each batch of the row; files under `{paths[0].parent.relative_to(ROOT)}/`." + note,
            "", "| model | batch | bf16 | " + " | ".join(f"k={k}" for k in ks) + " | file (commit) |",
            "|---|--:|--:|" + "--:|" * len(ks) + "---|"]
    return "\n".join(head + out)


def roofline_line(folders: list[Path], e2e: list[Path]) -> str:
    """The batch-1 k = 4 steps' share of their byte roofline: the bytes at the read ceiling from the step profiles'
    own summary lines (a model's from the first folder that has it) over the step of the end-to-end table (a model's
    from the first file in ``e2e`` that has it)."""
    step = {}
    for path in e2e:
        for r in _load(path)["rows"]:
            if r.get("variant") == "kbit" and r.get("k") == 4 and r.get("batch") == 1 and r.get("ms_per_step"):
                step.setdefault(r["model"], r["ms_per_step"])
    parts, used, seen = [], {}, set()
    for folder in folders:
        for f in sorted(folder.glob("step-*-kbit-k4-b1.txt")):
            text = f.read_text()
            head = re.search(r"^step profile: (\S+) .*commit (\w+)\)", text, re.M)
            share = re.search(r"roofline at [\d.]+ TB/s.*: ([\d.]+) ms = ([\d.]+)% of the step", text)
            if head and share and head.group(1) not in seen and head.group(1) in step:
                seen.add(head.group(1))
                ms, roof = step[head.group(1)], float(share.group(1))
                parts.append(f"{head.group(1)} {roof:.3f} ms / {ms:.3f} = {100 * roof / ms:.0f}%")
                used.setdefault(f"`{folder.relative_to(ROOT)}/` ({head.group(2)})", None)
    if not parts:
        return ""
    return (" Batch-1 k = 4 steps against the bytes they must read at the read ceiling (step profiles, "
            + ", ".join(used) + "): bytes at the ceiling / the step of the table below: " + ", ".join(parts) + ".")


def quality_table(path: Path) -> str:
    """Perplexity of a small real model at equal bits per weight (``kbit eval``)."""
    d = _load(path)
    out = [f"{d['model']}, from the PyPI package {d['package']}; every Linear but embeddings and lm_head "
           f"quantized, perplexity on {d['tokens']} tokens of `{d['text']}` (float model: "
           f"{d['baseline']['ppl']:.2f}), CPU, {d['date']}, "
           f"{_name(path)}. `kbit/<codebook>`: kbit's format; `rtn-g128`, `nf-b64`: common formats at the same "
           "bits (docs/quality.md).", "",
           "| method | k=3: bits | ppl | top-1 | k=4: bits | ppl | top-1 |", "|---|--:|--:|--:|--:|--:|--:|"]
    by = {(r["method"], r["k"]): r for r in d["rows"]}
    for method in dict.fromkeys(r["method"] for r in d["rows"]):
        cells = []
        for k in (3, 4):
            r = by.get((method, k))
            cells += [f"{r['bits']:.2f}", f"{r['ppl']:.1f}", f"{r['top1']:.2f}"] if r else ["-"] * 3
        out.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def suite_table(paths: list[Path]) -> str:
    """Per model family (and the suite's tune / held-out halves) and M, kbit's dispatcher against humming at the same
    k and bf16 cuBLAS of the same run: median ratios over the family's layers (``kbit.bench.summary``)."""
    from kbit.bench import report, summary
    from kbit.bench import suite as suite_mod

    times, heads = {}, []
    for path in paths:  # one summary over the newest run of each point (a family's layers may span files); a
        # point's kbit, humming and bf16 times come from one run
        header, rows = report.read_results(path)
        times.update(summary.kbit_times(rows))
        heads.append(f"{_name(path)} ({header['gpu_name']}, commit {header['commit']}, {header['date']})")
    models = suite_mod.load_models("models")
    summ = summary.summarize_times(times, summary.with_halves(suite_mod.layers(models), models))
    cols = sorted({(s["k"], s["M"]) for s in summ}, key=lambda c: (-c[0], c[1]))
    cell = {(s["family"], s["k"], s["M"]): s for s in summ}
    fams = sorted({s["family"] for s in summ}, key=lambda f: (f.startswith("["), f))
    out = ["Dense layers of >= 16M weights from the suite's models (`kbit bench --suite models --suite-parts dense "
           "--min-weights 16000000 --peers humming`), largest first as far as each run's budget went (a `-rest` file: "
           "shapes an earlier run of the same k left out; a point's times come from the newest file that has it); "
           + "; ".join(heads) + ". Cells: x faster than humming at the same k / than bf16 `F.linear`, median over "
           "the family's layers (`-`: no humming row). `[tune]` / `[held-out]`: the suite's halves (configs were "
           "tuned on the first).", "",
           "| family | " + " | ".join(f"k={k} M={M}" for k, M in cols) + " |",
           "|---|" + "--:|" * len(cols)]
    for fam in fams:
        cells = []
        for k, M in cols:
            s = cell.get((fam, k, M))
            if s is None:
                cells.append("")
                continue
            hum = "-" if s["x_humming_median"] is None else f"{s['x_humming_median']:.2f}"
            cells.append(f"{hum} / {s['x_bf16_median']:.2f}")
        out.append(f"| {fam} | " + " | ".join(cells) + " |")
    png = paths[0].with_suffix(".png")
    if png.exists():
        out[0] += f" Plot: [speed-up over bf16 against M per family, k = 4]({png.relative_to(ROOT)})."
    return "\n".join(out)


def tables() -> str:
    return "\n\n".join([
        "### Dense decode kernels (M = 1)", dense_m1_table(DENSE_M1),
        "### Dense, M = 16..4096", dense_by_m_table(DENSE_BY_M),
        "### Model-shape suite, per family", suite_table(SUITE),
        "### MoE layer", moe_table(MOE),
        "### End-to-end decode", e2e_table(E2E, note=roofline_line(PROFILES, E2E)),
        "### Quality", quality_table(QUALITY)])


def main():
    readme = ROOT / "README.md"
    text = readme.read_text()
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    readme.write_text(text[:a] + "\n" + tables() + "\n" + text[b:])


if __name__ == "__main__":
    main()

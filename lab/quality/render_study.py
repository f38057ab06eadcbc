"""Markdown table, issue-35 verdicts and a plot from the JSON files of ``rotation_gptq_study.py``.

    python lab/quality/render_study.py benchmarks/results/cpu/quality-rotation-gptq-*.json \
        --plot docs/plots/quality-rotation-gptq.png

Bars of issue 35 (against today's default, kbit RTN with the default codebook, ``rtn``):
k = 3 KL <= 50% of rtn's; k = 2 top-1 >= 0.6 and perplexity <= 3x the unquantized model's; k = 4 KL <= 75% of rtn's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLORS = {"rtn": "tab:blue", "rot": "tab:orange", "gptq": "tab:green", "rot+gptq": "tab:red"}


def table(result: dict) -> str:
    base = result["baseline"]
    lines = [f"**{result['model']}** ({result['eval_tokens']} tokens, calibration {result['calib_tokens']} tokens, "
             f"commit {result['commit']}, {result['date']})", "",
             "| k | method | bits/weight | ppl | KL to unquantized | top-1 agreement | KL vs rtn | seconds |",
             "|--:|---|--:|--:|--:|--:|--:|--:|",
             f"| - | unquantized | 32 | {base['ppl']:.2f} | 0 | 1 | | |"]
    rtn = {r["k"]: r for r in result["rows"] if r["method"] == "rtn"}
    for r in result["rows"]:
        rel = f"{r['kl'] / rtn[r['k']]['kl']:.2f}x" if r["k"] in rtn else ""
        lines.append(f"| {r['k']} | {r['method']} ({r['codebook']}) | {r['bits']:.2f} | {r['ppl']:.2f} | "
                     f"{r['kl']:.4f} | {r['top1']:.3f} | {rel} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def verdicts(result: dict) -> list[str]:
    """One line per (k, method other than rtn): whether it meets issue 35's bar at that k."""
    base = result["baseline"]
    rtn = {r["k"]: r for r in result["rows"] if r["method"] == "rtn"}
    out = []
    for r in result["rows"]:
        k = r["k"]
        if r["method"] == "rtn" or k not in rtn:
            continue
        if k == 3:
            ok, what = r["kl"] <= 0.5 * rtn[3]["kl"], f"KL {r['kl'] / rtn[3]['kl']:.2f}x rtn (bar <= 0.50x)"
        elif k == 2:
            ok = r["top1"] >= 0.6 and r["ppl"] <= 3 * base["ppl"]
            what = f"top-1 {r['top1']:.3f} (bar >= 0.6), ppl {r['ppl'] / base['ppl']:.2f}x unquantized (bar <= 3x)"
        elif k == 4:
            ok, what = r["kl"] <= 0.75 * rtn[4]["kl"], f"KL {r['kl'] / rtn[4]['kl']:.2f}x rtn (bar <= 0.75x)"
        else:
            continue
        out.append(f"- {result['model']} k={k} {r['method']}: {what}: {'meets' if ok else 'misses'}")
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib  # optional dependency: only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        methods = sorted({r["method"] for r in res["rows"]}, key=[r["method"] for r in res["rows"]].index)
        for m in methods:
            rows = sorted((r for r in res["rows"] if r["method"] == m), key=lambda r: r["bits"])
            ax.plot([r["bits"] for r in rows], [r["kl"] for r in rows], marker="o", label=m,
                    color=COLORS.get(m))  # one colour per method on every panel
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight")
        ax.set_ylabel("KL to the unquantized model (nats/token)")
        ax.set_title(f"{res['model']} ({res['eval_tokens']} tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--plot", type=Path, default=None)
    a = p.parse_args(argv)
    results = [json.loads(f.read_text()) for f in a.results]
    for res in results:
        print(table(res) + "\n")
    print("\n".join(line for res in results for line in verdicts(res)))
    if a.plot is not None:
        plot(results, a.plot)
        print(f"\nwrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

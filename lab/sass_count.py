"""SASS instructions a weight in the M = 1 GEMV's main loop (kernel 3, kbit_gemv_mma_streamk), by class.

Compiles the kernel that serves M = 1 on sm_90 (kernel 3 with the defines kbit.tuning.mma_plan.make_plan gives shape
--shape: 8 or 16 warps, x in shared memory, CTA-aligned units (CAU) on some shapes) at k = 2..5 with NVRTC for
sm_90, disassembles it with cuobjdump and counts the instructions of the basic blocks that hold the segment code
(the blocks with HMMA: decode, lookup, scales, mma, accumulate, and the ring's loads and bookkeeping that the
compiler put among them). A segment is 128 weights a lane (16 rows x 256 columns a warp), so instructions a weight
= block instructions / (segments in those blocks x 128): issued lane-ops a weight. Compare builds of the same loop
structure only: where a change moves segment code into blocks without HMMA (e.g. unrolling a loop that branches
between segments), count the whole loop instead (--dump). Needs NVRTC only, no GPU::

    python lab/sass_count.py --nvrtc /path/to/libnvrtc.so.12 [--ref REV] [--shape 65536x5120] [--bf16]
        [--fp16-scales] [--k 2 3 4 5] [--config 1,8,2] [-D NAME=VALUE ...] [--dump DIR]

``--ref REV``: also compile the csrc folder of git revision REV (e.g. the commit before a change) and print both
tables and the difference. ``--dump DIR``: write each SASS listing there.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
CSRC = "src/kbit/cuda/csrc"

#: the columns of the table: class -> opcode prefixes (the opcode before its first '.')
CLASSES = {
    "LOP3": ("LOP3", "LOP"), "SHF": ("SHF", "SHL", "SHR"), "IMAD": ("IMAD",), "IADD": ("IADD3", "VIADD", "IADD", "LEA"),
    "PRMT": ("PRMT",), "HFMA2": ("HFMA2",), "HMUL2": ("HMUL2",), "HADD2": ("HADD2",), "FFMA": ("FFMA",),
    "FMUL": ("FMUL",), "FADD": ("FADD",), "F2F": ("F2F", "F2FP"), "I2F": ("I2F", "I2FP"), "LDS": ("LDS",),
    "LDG": ("LDG",), "SHFL": ("SHFL",), "BRA": ("BRA", "BSSY", "BSYNC"), "HMMA": ("HMMA",),
    "MOV": ("MOV", "IMAD.MOV"), "SETP": ("ISETP", "FSETP"), "SEL": ("SEL", "FSEL"),
}
#: kernel -> (file, kernel name)
FILES = {1: ("gemv_mma_split.cu", "kbit_gemv_mma_split"), 3: ("gemv_mma_streamk.cu", "kbit_gemv_mma_streamk")}
_BRANCH = re.compile(r"\b(BRA|BRX|JMP|EXIT|RET|CALL)\b")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def klass(op: str) -> str:
    if op.startswith("IMAD.MOV"):
        return "MOV"
    base = op.split(".")[0]
    for name, prefixes in CLASSES.items():
        if base in prefixes:
            return name
    return "other"


def parse(sass: str, name: str) -> list:
    """[(address, opcode, operands)] of function ``name`` in a cuobjdump listing."""
    out, cur = [], None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = m.group(1)
            continue
        if cur != name:
            continue
        m = _INSN.search(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def blocks(insns: list) -> list:
    """Basic blocks (lists of instructions): leaders are branch targets and the instructions after branches."""
    targets = set()
    for _a, op, args in insns:
        if _BRANCH.match(op):
            targets.update(int(t, 16) for t in re.findall(r"0x([0-9a-f]+)", args))
    out, cur = [], []
    for ins in insns:
        if cur and ins[0] in targets:
            out.append(cur)
            cur = []
        cur.append(ins)
        if _BRANCH.match(ins[1]):
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def hot_counts(insns: list, ng: int) -> tuple[Counter, int]:
    """(instruction classes of the HMMA blocks, segments they hold)."""
    c, n_mma = Counter(), 0
    for b in blocks(insns):
        m = sum(op.startswith("HMMA") for _a, op, _r in b)
        if m:
            n_mma += m
            c.update(klass(op) for _a, op, _r in b if op != "NOP")
    return c, n_mma // (16 * ng)


def tree_sources(rev: str | None, file: str) -> tuple[str, dict]:
    """(the .cu text, {header: text}) of the worktree (rev None) or of git revision rev."""
    if rev is None:
        from kbit.cuda import sources

        return sources.read_source(file), dict(sources.headers())

    def show(path):
        return subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True,
                              check=True).stdout
    names = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", f"{rev}:{CSRC}"], capture_output=True,
                           text=True, check=True).stdout.split()
    return show(f"{CSRC}/{file}"), {n: show(f"{CSRC}/{n}") for n in names if n.endswith(".cuh")}


def m1_defines(k: int, bf16: int, fp16_scales: int, N: int = 65536, K: int = 5120, config=None) -> dict:
    """The M = 1 defines kbit.tuning.mma_plan.make_plan gives shape N x K (the default rule table's config; kernel
    3 with 8 warps, 2 CTAs an SM and x in shared memory where that rule picks another kernel) on a 132-SM GPU where
    2 CTAs fit an SM (no GPU: a stand-in for the built kernel's occupancy); config (kernel, warps, CTAs an SM, ...): pin
    one, in ``MmaConfig.of``'s positional form (kernel 1 compiles gemv_mma_split.cu)."""
    from kbit.tuning import mma, mma_plan

    class _Built:
        num_regs = 128

        def occupancy(self, block, shared):
            return 2

    cfg = mma.MmaConfig.of(config) if config else mma.default_config(k, 1, N, K)
    if getattr(cfg, "kernel", None) not in (1, 3):
        cfg = mma.MmaConfig(kernel=3, warps=8, min_ctas=2, x_smem=True)
    p = mma_plan.make_plan(k, 1, N, K, "fp16" if fp16_scales else "log8", cfg, sms=132,
                           build=lambda kernel, defines: _Built())
    return {**p.defines, "BF16": bf16}


def sass_of(rev, file, defines, cuobjdump) -> str:
    from kbit.cuda import runtime, sources

    src, hdrs = tree_sources(rev, file)
    cubin, _log = runtime.nvrtc_compile(src, "sm_90", sources.define_options(defines), name=file, headers=hdrs)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs, local = re.search(r"REG:(\d+)", res), re.search(r"LOCAL:(\d+)", res)
    return sass, (int(regs.group(1)) if regs else -1, int(local.group(1)) if local else -1)


def table(rows: list, title: str) -> None:
    cols = [c for c in list(CLASSES) + ["other"] if any(r[2].get(c) for r in rows)]
    print(title)
    print(f"{'k':>2} {'regs':>4} {'spill':>5} {'segs':>4} {'total':>6} {'/wt':>5} " + " ".join(f"{c:>5}" for c in cols))
    for k, regs, c, segs in rows:
        tot = sum(c.values())
        per = 128 * max(segs, 1)
        print(f"{k:>2} {regs[0]:>4} {regs[1]:>5} {segs:>4} {tot / max(segs, 1):>6.0f} {tot / per:>5.2f} "
              + " ".join(f"{c.get(x, 0) / per:>5.2f}" for x in cols))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvrtc", required=True, help="path of libnvrtc.so")
    p.add_argument("--cuobjdump", default=None, help="default: the one in triton's nvidia backend")
    p.add_argument("--ref", default=None, help="git revision to compare with (its csrc folder)")
    p.add_argument("--k", type=int, nargs="*", default=[2, 3, 4, 5])
    p.add_argument("--bf16", action="store_true", help="bf16 activations (default fp16)")
    p.add_argument("--fp16-scales", action="store_true", help="fp16 block scales (default log8 bytes)")
    p.add_argument("--shape", default="65536x5120", help="N x K of the plan whose defines are compiled")
    p.add_argument("--config", default=None, help="KERNEL,WARPS,CTAS[,...] (MmaConfig.of; 1 or 3): pin the config "
                   "(kernel 1: gemv_mma_split.cu)")
    p.add_argument("-D", dest="defs", action="append", default=[], help="NAME=VALUE: override a define")
    p.add_argument("--dump", default=None, help="folder for the SASS listings")
    a = p.parse_args(argv)
    from kbit import options

    options.set_options(nvrtc_lib=a.nvrtc, cache_dir=None)
    cuobjdump = a.cuobjdump
    if cuobjdump is None:
        import triton

        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    over = {n: int(v) for n, v in (d.split("=", 1) for d in a.defs)}
    trees = ([(a.ref, f"ref {a.ref}")] if a.ref else []) + [(None, "worktree")]
    results = {}
    for rev, title in trees:
        rows = []
        for k in a.k:
            N, K = (int(v) for v in a.shape.split("x"))
            cfg = tuple(int(v) for v in a.config.split(",")) if a.config else None
            d = {**m1_defines(k, int(a.bf16), int(a.fp16_scales), N, K, cfg), **over}
            a.file, a.kernel = FILES[1 if "K1WO" in d else 3]
            sass, regs = sass_of(rev, a.file, d, cuobjdump)
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                with open(os.path.join(a.dump, f"{rev or 'wt'}_k{k}.sass"), "w") as f:
                    f.write(sass)
            c, segs = hot_counts(parse(sass, a.kernel), d.get("NG", 1))
            rows.append((k, regs, c, segs))
        results[rev] = rows
        table(rows, f"{title}: {a.file}, instructions a weight (lane-ops), HMMA blocks"
                    f" ({'bf16' if a.bf16 else 'fp16'} x, {'fp16' if a.fp16_scales else 'log8'} scales)")
    if a.ref:
        print("difference (worktree - ref), instructions a weight:")
        for (k, _r, c0, s0), (_k, _r1, c1, s1) in zip(results[a.ref], results[None], strict=True):
            print(f"k={k}: {sum(c0.values()) / (128 * max(s0, 1)):.3f} -> {sum(c1.values()) / (128 * max(s1, 1)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

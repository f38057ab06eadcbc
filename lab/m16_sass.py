"""SASS instructions a weight (and a weight x token) in the main loop of the kernel the dispatcher picks at M = 1..64,
by class, on sm_90 (issue 32: why M = 16 costs 1.4-1.8x M = 1 while humming's costs 1.1-1.2x).

For each shape (N x K), k and M: the config the H200 dispatcher picks (the shipped tuned table ``tuned-h200.json``
where it has the shape's M bucket or a near shape, else the built-in rules with sm90 and 132 SMs; kernel 7 where
``uses_large`` says so), its plan (``kbit.tuning.mma_plan.make_plan``; the occupancy from the build's registers and
shared bytes, no GPU), compiled with NVRTC, disassembled with cuobjdump. Counted: the basic blocks that hold an
HMMA / HGMMA (lab/sass_count.py's "hot" blocks: decode, lookup, scales, mma, x loads, accumulate and whatever the
compiler put among them). A warp HMMA m16n8k16 consumes 16 x 16 weights, i.e. 8 a lane, for its 8 tokens; an HGMMA
(kernel 7) 16 x 16 weights a warp for all its tile's tokens, so lane-weights = HMMA / NG x 8 (kernels 1, 3, 4) or
HGMMA x 8 (kernel 7). Columns are issued lane-ops a weight; "/wt.tok" divides the total by min(M, 8 NG) tokens.
Needs NVRTC only::

    python lab/m16_sass.py --nvrtc /path/to/libnvrtc.so.12 [--shapes 65536x5120,...] [--ks 2,4] [--ms 1,2,4,8,16,32]
        [--ref REV] [--bf16] [--dump DIR] [-D NAME=VALUE ...]

``--ref REV``: the csrc folder of git revision REV too (same plan and defines), printed above the worktree's rows.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from sass_count import blocks, parse, tree_sources  # noqa: E402

SHAPES = "65536x5120,35840x5120,5120x17408,9216x4096"
#: columns: class -> opcode bases
CLASSES = {
    "HMMA": ("HMMA", "HGMMA"), "LDS": ("LDS", "LDSM"), "STS": ("STS",), "LDG": ("LDG",), "LOP3": ("LOP3", "LOP"),
    "PRMT": ("PRMT",), "SHF": ("SHF", "SHL", "SHR"), "IMAD": ("IMAD",), "IADD": ("IADD3", "VIADD", "IADD", "LEA"),
    "FFMA": ("FFMA", "FMUL", "FADD"), "HFMA2": ("HFMA2", "HMUL2", "HADD2"), "F2F": ("F2F", "F2FP", "I2F", "I2FP"),
    "BAR": ("BAR", "SYNCS", "WARPSYNC", "DEPBAR", "WARPGROUP", "MEMBAR"), "SHFL": ("SHFL",),
    "BRA": ("BRA", "BSSY", "BSYNC", "BRX"), "MOV": ("MOV", "IMAD.MOV", "S2R", "S2UR", "R2UR", "UMOV"),
    "SETP": ("ISETP", "FSETP", "UISETP"), "SEL": ("SEL", "FSEL"),
}


def klass(op: str) -> str:
    if op.startswith("IMAD.MOV"):
        return "MOV"
    base = op.split(".")[0]
    if base.startswith("U") and base not in ("UMOV", "UISETP"):
        return "uniform"
    for name, prefixes in CLASSES.items():
        if base in prefixes:
            return name
    return "other"


def pick(k: int, M: int, N: int, K: int):
    """(config, where it came from) the H200 dispatcher takes for one launch of M rows (no GPU: the tuned table's
    lookup, then kbit.tuning.mma's rules with sm90 and 132 SMs)."""
    from kbit.tuning import mma, tuned

    table = tuned.packaged_table("h200")
    cand = table.lookup(k, M, N, K) if table is not None else None
    if cand is not None and cand.family in ("mma", "large"):
        return cand.config, "tuned"
    if M >= mma.LARGE7_MIN_M and not (M <= mma.MAX_M and N * K < mma.LARGE7_SMALL_NK):
        return mma.large_config(k, M, N, K, gpu="h200"), "rule (kernel 7)"
    return mma.default_config(k, M, N, K, sm90=True, sms=132, gpu="h200"), "rule"


class Built:
    """A build's registers / stack and an occupancy estimate (sm_90: 64K registers, 228 KB shared, 64 warps, 32
    CTAs an SM; 1 KB reserved a CTA)."""

    def __init__(self, regs: int, local: int):
        self.num_regs, self.local = regs, local

    def occupancy(self, threads: int, shared: int) -> int:
        warps = -(-threads // 32)
        regs_warp = -(-max(self.num_regs, 1) * 32 // 256) * 256
        by_regs = 65536 // (regs_warp * warps)
        by_smem = (233472 // (shared + 1024 + 1024)) if shared else 32
        return max(0, min(by_regs, by_smem, 64 // warps, 32))


def compile_sass(rev, kernel: int, defines: dict, cuobjdump: str) -> tuple[str, tuple[int, int]]:
    from kbit.cuda import runtime, sources
    from kbit.tuning.mma_plan import KERNELS

    file, _name = KERNELS[kernel]
    src, hdrs = tree_sources(rev, file)
    arch = "sm_90a" if kernel == 7 else "sm_90"
    cubin, _log = runtime.nvrtc_compile(src, arch, sources.define_options(defines), name=file, headers=hdrs)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs, local = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    return sass, (int(regs.group(1)) if regs else -1, int(local.group(1)) if local else 0)


def plan_of(rev, k, M, N, K, cfg, bf16, over, cuobjdump):
    """(plan, sass, regs) of the launch, every build of the plan compiled from revision rev's csrc."""
    from kbit.tuning.mma_plan import make_plan

    cache = {}

    def build(kernel, defines):
        d = {**defines, **over, "BF16": bf16}
        key = (kernel, tuple(sorted(d.items())))
        if key not in cache:
            sass, regs = compile_sass(rev, kernel, d, cuobjdump)
            cache[key] = (Built(*regs), sass)
        return cache[key][0]

    p = make_plan(k, M, N, K, "log8", cfg, sms=132, build=build)
    d = {**p.defines, **over, "BF16": bf16}
    b, sass = cache[(p.kernel, tuple(sorted(d.items())))]
    return p, sass, (b.num_regs, b.local)


def hot(sass: str, kernel: int, ng: int) -> tuple[Counter, float]:
    """(classes of the HMMA / HGMMA blocks, lane-weights they consume)."""
    from kbit.tuning.mma_plan import KERNELS

    c, n = Counter(), 0
    for b in blocks(parse(sass, KERNELS[kernel][1])):
        m = sum(op.startswith(("HMMA", "HGMMA")) for _a, op, _r in b)
        if m:
            n += m
            c.update(klass(op) for _a, op, _r in b if op != "NOP")
    return c, (n * 8.0 if kernel == 7 else n * 8.0 / ng)


COLS = list(CLASSES) + ["uniform", "other"]


def describe(p, cfg) -> str:
    d = p.defines
    keys = ("NG", "MAXW", "MINB", "PD", "XS", "XK", "CAU", "LFX", "WS4", "M1", "K1WO", "D", "SK", "RT", "TAB256")
    return f"k{p.kernel} " + ",".join(f"{n}={d[n]}" for n in keys if d.get(n))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvrtc", required=True)
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ks", default="2,4")
    ap.add_argument("--ms", default="1,2,4,8,16,32")
    ap.add_argument("--ref", default=None)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--dump", default=None)
    ap.add_argument("-D", dest="defs", action="append", default=[])
    a = ap.parse_args(argv)
    from kbit import options

    options.set_options(nvrtc_lib=a.nvrtc, cache_dir=None)
    cuobjdump = a.cuobjdump
    if cuobjdump is None:
        import triton

        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    over = {n: int(v) for n, v in (d.split("=", 1) for d in a.defs)}
    print(f"{'shape':>11} {'k':>1} {'M':>2} {'tree':>8} {'build':<44} {'regs':>4} {'stk':>3} {'/wt':>5} {'/wt.tok':>7} "
          + " ".join(f"{c[:5]:>5}" for c in COLS))
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        for k in (int(v) for v in a.ks.split(",")):
            for M in (int(v) for v in a.ms.split(",")):
                cfg, _src = pick(k, M, N, K)
                for rev in ([a.ref] if a.ref else []) + [None]:
                    p, sass, regs = plan_of(rev, k, M, N, K, cfg, int(a.bf16), over, cuobjdump)
                    ng = p.defines.get("NG", 1)
                    c, wts = hot(sass, p.kernel, ng)
                    if a.dump:
                        os.makedirs(a.dump, exist_ok=True)
                        with open(os.path.join(a.dump, f"{shape}_k{k}_M{M}_{rev or 'wt'}.sass"), "w") as f:
                            f.write(sass)
                    tot = sum(c.values())
                    toks = min(M, 8 * ng) if p.kernel != 7 else M
                    w = max(wts, 1.0)
                    print(f"{shape:>11} {k:>1} {M:>2} {(rev or 'wt')[:8]:>8} {describe(p, cfg):<44} {regs[0]:>4} "
                          f"{regs[1]:>3} {tot / w:>5.2f} {tot / w / toks:>7.3f} "
                          + " ".join(f"{c.get(x, 0) / w:>5.2f}" for x in COLS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

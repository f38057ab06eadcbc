"""A/B of the CUDA sources: the old Python strings (commit 64014d4) against the csrc files, same SASS.

For a set of define combinations that kbit.ops uses (every kernel, k = 2..5, the NG values, BF16 and FP16_SCALES
0/1, kernel 3's XS / XK / PRO / EPI / LFX / CAU / DET / M1 / WS4 builds, the wgmma kernel's dense, stream-K and
grouped forms, ...), compiles the old source (defines prepended as #define lines, the old kernel name) and the new
file (-D options, headers) with the same NVRTC for sm_90 (sm_90a for wgmma.cu), disassembles both CUBINs with
cuobjdump and compares each kernel's SASS (kernel name and column padding normalised) and resource usage
(registers, stack, shared, local, constant bytes). Needs NVRTC only, no GPU::

    python lab/cuda_sass_ab.py --nvrtc /path/to/libnvrtc.so.12 [--cuobjdump PATH] [--jobs 2] [--quick] \
        [--files mma_pipe.cu ...]

Exit status 1 if any kernel differs.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
OLD = "64014d4"

# (file, new name) -> (old source key, old name, old KERNEL define)
OLD_NAMES = {
    ("gemv_mma_split.cu", "kbit_gemv_mma_split"): ("mma", "kbit_gemv_mma", 1),
    ("gemv_mma_streamk.cu", "kbit_gemv_mma_streamk"): ("mma", "kbit_gemv_mma", 3),
    ("mma_pipe.cu", "kbit_mma_pipe"): ("mma", "kbit_gemv_mma", 4),
    ("grouped_mma_pipe.cu", "kbit_grouped_mma_pipe"): ("mma", "kbit_grouped_mma4", 5),
    ("wgmma.cu", "kbit_wgmma"): ("mma", "kbit_gemv_mma", 7),
    ("x_tiles.cu", "kbit_x_tiles"): ("x_tiles", "kbit_x_tiles", None),
    ("x_tiles.cu", "kbit_x_tiles_g"): ("x_tiles", "kbit_x_tiles_g", None),
    ("x_tiles.cu", "kbit_x_tiles_silu_g"): ("x_tiles", "kbit_x_tiles_silu_g", None),
    ("dequant_mma.cu", "kbit_deq_mma"): ("deq", "kbit_deq_mma", None),
    ("moe_blocks.cu", "kbit_moe_blocks"): ("grouped", "kbit_moe_blocks", None),
    ("moe_blocks.cu", "kbit_moe_blocks_off"): ("grouped", "kbit_moe_blocks_off", None),
    ("moe_blocks.cu", "kbit_moe_split"): ("grouped", "kbit_moe_split", None),
    ("moe_blocks.cu", "kbit_moe_split_rows"): ("grouped", "kbit_moe_split_rows", None),
    ("grouped_mma.cu", "kbit_grouped_mma"): ("grouped", "kbit_grouped_mma", None),
    ("dequant.cu", "kbit_dequant"): ("dequant", "kbit_dequant", None),
    ("read.cu", "kbit_read"): ("read", "kbit_read", None),
}

# the k / BF16 / FP16_SCALES of a variant: each k once, the dtype pairs rotated per variant
PAIRS = ((0, 0), (1, 0), (0, 1), (1, 1))


def _kbf(i, full):
    if full:
        return [(k, bf, fs) for k in (2, 3, 4, 5) for bf, fs in PAIRS]
    return [(k, *PAIRS[(k + i) % 4]) for k in (2, 3, 4, 5)]


def cases(quick=False):
    """[(file, [names], defines)]: the define sets kbit.ops builds (kbit.ops.gemv_mma.plan / large_defines,
    kbit.ops.grouped_mma, kbit.ops.dequant), each k, both activation dtypes and scale formats."""
    out = []

    def add(file, names, variants, extra=lambda k: {}):
        for i, v in enumerate(variants):
            for k, bf, fs in _kbf(i, i == 0 and not quick):
                out.append((file, names, {**extra(k), **v, "K_BITS": k, "BF16": bf, "FP16_SCALES": fs}))
            if quick:
                break

    # kernel 1: (NG, MAXW, MINB, L2PF, K1EARLY, M1, DET, WS4); K1WO = k in (3, 4, 5) and NG == 1
    k1 = [(1, 8, 2, 16384, 1, 1, 0, 0), (1, 4, 4, 0, 0, 1, 0, 0), (1, 8, 3, 16384, 1, 0, 0, 0),
          (1, 4, 6, 16384, 1, 0, 0, 0), (2, 4, 4, 0, 0, 0, 0, 0), (2, 8, 2, 16384, 0, 0, 0, 1),
          (8, 8, 2, 16384, 0, 0, 0, 1), (4, 8, 2, 16384, 0, 0, 0, 0), (1, 8, 2, 16384, 1, 1, 1, 0),
          (2, 8, 2, 0, 0, 0, 1, 0)]
    add("gemv_mma_split.cu", ["kbit_gemv_mma_split"],
        [dict(NG=a, D=1, MAXW=b, MINB=c, L2PF=d, K1EARLY=e, M1=f, DET=g, WS4=h) for a, b, c, d, e, f, g, h in k1],
        )
    for file, _names, d in out:  # K1WO as plan() sets it
        if file == "gemv_mma_split.cu":
            d["K1WO"] = int(d["K_BITS"] in (3, 4, 5) and d["NG"] == 1)
    # kernel 3: plan()'s builds (L2PF[3] = 0)
    k3 = [dict(NG=1, MAXW=8, MINB=2, XS=1, CAU=1, LFW=2, M1=1),
          dict(NG=1, MAXW=8, MINB=2, XS=1, M1=1),
          dict(NG=1, MAXW=8, MINB=2, XS=0, LFX=1, LFU=3, LFW=2, M1=1),
          dict(NG=1, MAXW=16, MINB=1, XS=0, CAU=1, LFW=2, M1=1),
          dict(NG=2, MAXW=8, MINB=2, XS=0, CAU=1, LFW=2),
          dict(NG=2, MAXW=16, MINB=1, PD=3, XS=1, XK=8, WS4=1),
          dict(NG=2, MAXW=16, MINB=1, PD=3, XS=1, XK=8, WS4=0),
          dict(NG=1, MAXW=8, MINB=2, XS=1, PRO=1, CAU=1, LFW=2, M1=1),
          dict(NG=1, MAXW=8, MINB=2, XS=1, PRO=2, M1=1),
          dict(NG=1, MAXW=8, MINB=2, XS=1, EPI=1, CAU=1, LFW=3, M1=1),
          dict(NG=1, MAXW=8, MINB=2, XS=0, EPI=1, LFX=1, LFU=4, LFW=3, M1=1),
          dict(NG=1, MAXW=8, MINB=2, XS=1, DET=1, M1=1),
          dict(NG=2, MAXW=8, MINB=2, XS=0, DET=1, EPI=1),
          dict(NG=2, MAXW=8, MINB=2, XS=0, LFX=1, LFU=2, LFW=2),
          dict(NG=2, MAXW=8, MINB=2, XS=1, WS4=1),
          # one token's MoE pairs (kbit.ops.gemv_mma.pairs_linear: GRP, no L2 prefetch, x read per pair without XS)
          dict(NG=1, MAXW=8, MINB=2, XS=1, CAU=1, LFW=2, M1=1, GRP=1),
          dict(NG=1, MAXW=8, MINB=2, XS=0, LFX=1, LFU=3, LFW=2, M1=1, GRP=1),
          dict(NG=1, MAXW=8, MINB=2, XS=0, M1=1, GRP=1)]
    add("gemv_mma_streamk.cu", ["kbit_gemv_mma_streamk"],
        [{"D": 1, "XK": 0, "L2PF": 0, "WS4": 0, **v} for v in k3], lambda k: {"PD": {2: 2, 3: 3, 4: 2, 5: 2}[k]})
    # kernel 4
    k4 = [dict(NG=2, D=2, MAXW=8, RT=1, WS4=0), dict(NG=4, D=2, MAXW=8, RT=1, WS4=1),
          dict(NG=8, D=2, MAXW=16, RT=1, WS4=0), dict(NG=8, D=2, MAXW=16, RT=1, WS4=1)]
    add("mma_pipe.cu", ["kbit_mma_pipe"], [{"MINB": 1, **v} for v in k4])
    k5 = [dict(NG=1, MAXW=4), dict(NG=2, MAXW=8), dict(NG=4, MAXW=8), dict(NG=8, MAXW=16)]
    add("grouped_mma_pipe.cu", ["kbit_grouped_mma_pipe"], [{"D": 2, "MINB": 1, "RT": 1, **v} for v in k5])
    # the grouped kernel at kernel 4's define sets too (NG 2..8)
    add("grouped_mma_pipe.cu", ["kbit_grouped_mma_pipe"], [{"MINB": 1, **v, "WS4": 0} for v in k4])
    # kernel 7: large_defines(); the constants the callers pass along (AB, GM, XSW, XB, RT, MINB, ARCH_SPECIFIC)
    k7 = [(4, 6, 8, 1, 0, 0), (4, 6, 8, 1, 0, 1), (8, 6, 16, 1, 0, 1), (8, 6, 12, 1, 0, 0), (16, 4, 12, 1, 0, 1),
          (32, 4, 8, 1, 0, 0), (32, 4, 8, 0, 0, 0), (32, 4, 8, 0, 0, 1), (8, 4, 16, 0, 1, 0), (16, 4, 12, 0, 1, 0),
          (32, 4, 8, 0, 1, 0)]
    add("wgmma.cu", ["kbit_wgmma"],
        [dict(NG=a, D=b, MAXW=c, SK=d, GRP=e, WS4=f, MINB=1, RT=1, ARCH_SPECIFIC=1, AB=2, GM=8, XSW=1, XB=1)
         for a, b, c, d, e, f in k7])
    add("dequant_mma.cu", ["kbit_deq_mma"], [dict(VEC=1), dict(VEC=0)])
    add("grouped_mma.cu", ["kbit_grouped_mma"],
        [dict(NG=1, MAXW=4, MINB=4), dict(NG=2, MAXW=8, MINB=2), dict(NG=4, MAXW=8, MINB=1),
         dict(NG=8, MAXW=16, MINB=1)])
    for i, (bs, out_, vec) in enumerate([(b, o, v) for b in (32, 64, 128) for o in (0, 1, 2) for v in (0, 1)]):
        k = 2 + i % 4
        out.append(("dequant.cu", ["kbit_dequant"],
                    dict(K_BITS=k, BLOCKSIZE=bs, FP16_SCALES=(i // 4) % 2, OUT=out_, VEC=vec, U=4)))
        if quick:
            break
    out.append(("x_tiles.cu", ["kbit_x_tiles", "kbit_x_tiles_g", "kbit_x_tiles_silu_g"], {}))
    out.append(("moe_blocks.cu", ["kbit_moe_blocks", "kbit_moe_blocks_off", "kbit_moe_split", "kbit_moe_split_rows"],
                dict(K_BITS=4, BF16=0, FP16_SCALES=0)))
    for u, pdl in ((4, 0), (8, 0), (4, 1), (8, 1)):
        out.append(("read.cu", ["kbit_read"], dict(U=u, PDL=pdl)))
    return out


def old_sources() -> dict:
    """The old CUDA strings of commit OLD, by key."""
    def show(path):
        return subprocess.run(["git", "-C", ROOT, "show", f"{OLD}:{path}"], capture_output=True, text=True,
                              check=True).stdout
    ns: dict = {}
    exec(compile(show("src/kbit/cuda/gemv_mma_src.py"), "gemv_mma_src", "exec"), ns)
    g: dict = {"HELPERS": ns["HELPERS"]}
    grouped = show("src/kbit/cuda/grouped_mma_src.py").replace("from kbit.cuda.gemv_mma_src import HELPERS", "")
    exec(compile(grouped, "grouped", "exec"), g)
    dq: dict = {}
    exec(compile(show("src/kbit/cuda/dequant_src.py"), "dequant", "exec"), dq)
    floor = show("src/kbit/bench/floor.py")
    read = re.search(r'READ_SOURCE = r"""(.*?)"""', floor, re.S).group(1)
    return {"mma": ns["SOURCE"], "x_tiles": ns["X_TILES_SOURCE"], "deq": ns["DEQ_SOURCE"], "grouped": g["SOURCE"],
            "dequant": dq["SOURCE"], "read": read}


_OLD: dict = {}


def _sass(cuobjdump, cubin, names):
    """{name: (SASS text with the name normalised, resource-usage line)} of ``names`` in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    funcs, cur = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
        elif cur:
            funcs[cur].append(line)
    usage, lines = {}, res.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"Function (\S+):", line)
        if m and i + 1 < len(lines):
            usage[m.group(1)] = lines[i + 1].strip()
    # cuobjdump pads its columns to the module's longest line: whitespace runs compared as one space
    return {n: ("\n".join(" ".join(line.split()) for line in funcs[n]).replace(n, "KERNEL"), usage.get(n, ""))
            for n in names}


def compare(case, cuobjdump):
    from kbit.cuda import runtime, sources

    file, names, defines = case
    arch = "sm_90a" if file in sources.ARCH_SPECIFIC else "sm_90"
    new = _sass(cuobjdump, sources.compile_source(file, defines, arch), names)
    out = []
    for name in names:
        key, old_name, kernel = OLD_NAMES[(file, name)]
        d = dict(defines) if kernel is None else {**defines, "KERNEL": kernel}
        head = "".join(f"#define {k} {int(v) if isinstance(v, bool) else v}\n" for k, v in sorted(d.items()))
        cubin, _ = runtime.nvrtc_compile(head + _OLD[key], arch)
        old = _sass(cuobjdump, cubin, [old_name])[old_name]
        out.append((file, name, defines, old == new[name], new[name][1], len(new[name][0].splitlines())))
    return out


def _init(nvrtc, old):
    from kbit import options

    options.set_options(nvrtc_lib=nvrtc, cache_dir=None)
    _OLD.update(old)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvrtc", required=True, help="path of libnvrtc.so")
    p.add_argument("--cuobjdump", default=None, help="default: the one in triton's nvidia backend")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one variant a kernel")
    p.add_argument("--files", nargs="*", help="only these .cu files")
    a = p.parse_args(argv)
    cuobjdump = a.cuobjdump
    if cuobjdump is None:
        import triton

        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    old = old_sources()
    todo = [c for c in cases(a.quick) if not a.files or c[0] in a.files]
    n = bad = 0
    with concurrent.futures.ProcessPoolExecutor(a.jobs, initializer=_init, initargs=(a.nvrtc, old)) as ex:
        for res in ex.map(compare, todo, [cuobjdump] * len(todo)):
            for file, name, defines, same, usage, lines in res:
                n += 1
                bad += not same
                print(f"{'same' if same else 'DIFFERENT'} {file} {name} {defines} ({lines} SASS lines; {usage})",
                      flush=True)
    print(f"{n} kernels compared ({len(todo)} define sets), {bad} different")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

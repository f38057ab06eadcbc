"""Loads moved above the PDL wait: the analysis behind ``tests/test_pdl_order.py`` and ``lab/pdl_hoist_scan.py``.

A kernel launched with programmatic dependent launch may start while the kernel before it still runs; it reads
what that kernel writes only after ``griddepcontrol.wait`` (``pdl_wait``). ptxas treats a read-only load
(``ld.global.nc``: ``const __restrict__`` pointers) as free to move, and moves some above the wait: the read then
races the launch that writes the data. :func:`hoisted` compiles a kernel build with NVRTC (no GPU), finds the
kernel parameters that each global load before the wait derives its address from (a forward taint from the
parameter reads, over the straight-line text) in the PTX (above ``griddepcontrol.wait``) and in the SASS (above
``ACQBULK``), and returns those read above the wait only in the SASS, weights excepted.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile


def split_funcs(text, start_re):
    """{function name: body lines} of a PTX or SASS listing."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.search(start_re, line)
        if m:
            cur = m.group(1)
            out[cur] = [line]
        elif cur:
            out[cur].append(line)
    return out


SIZES = {"u64": 8, "s64": 8, "b64": 8, "f64": 8, "u32": 4, "s32": 4, "b32": 4, "f32": 4, "u16": 2, "s16": 2,
         "b16": 2, "u8": 1, "s8": 1, "b8": 1}


def param_offsets(lines):
    """{param index: byte offset} from a PTX .entry's parameter list (natural alignment)."""
    out, off = {}, 0
    for line in lines:
        m = re.search(r"\.param \.(\w+)\b.*_param_(\d+)", line)
        if m:
            size = SIZES[m.group(1)]
            off = -(-off // size) * size
            out[int(m.group(2))] = off
            off += size
        if ")" in line and "_param_" not in line:
            break
    return out


def tainted_loads(lines, wait_re, source_of, load_re, addr_re, reg_re, pairs, direct=lambda text: set()):
    """For each global load before the wait: the set of parameters its address derives from (forward taint over
    the straight-line text: a destination takes the union of its sources' sets). source_of(line) -> (dest
    registers, param index) for a parameter read, else None; direct(operand text) -> the parameters an operand
    reads in place (SASS constant-bank operands)."""
    taint, out = {}, []
    for line in lines:
        if re.search(wait_re, line):
            return out
        code = re.sub(r"desc\[[^\]]*\]", "", re.sub(r"^\s*/\*[0-9a-f]+\*/", "", line).split(";")[0])
        src = source_of(code)
        if src is not None:
            for r in src[0]:
                taint[r] = {src[1]}
            continue
        if re.search(load_re, code):
            addr = re.search(addr_re, code)
            regs = reg_re.findall(addr.group(1)) if addr else []
            params = set().union(*(taint.get(r, set()) for r in regs)) if regs else set()
            out.append(params | (direct(addr.group(1)) if addr else set()))
        m = re.match(r"\s*(?:@!?U?P\w+\s+)?[\w.]+\s+(.*)", code)
        if not m:
            continue
        ops = [o.strip() for o in m.group(1).split(",")]
        if not ops or not reg_re.fullmatch(ops[0].split(".")[0].strip("{} ")):
            continue
        dest = ops[0].split(".")[0].strip("{} ")
        srcs = set().union(*(taint.get(r, set()) for o in ops[1:] for r in reg_re.findall(o)),
                           *(direct(o) for o in ops[1:]))
        dests = [dest] + ([pairs(dest)] if pairs and ".64" in code.split()[0] + ops[0] else [])
        for d in dests:
            if srcs:
                taint[d] = srcs
            else:
                taint.pop(d, None)
    return None


#: parameters that hold weights (never written by the kernel before, so free to read above the wait): codes,
#: scales, tensor scale, codebook, exponent table of the tensor-core kernels, and the bias of the dense ones
WEIGHTS = {name: {0, 1, 2, 3, 4} for name in ("kbit_grouped_mma", "kbit_grouped_mma_pipe", "kbit_deq_mma")}
WEIGHTS.update({name: {0, 1, 2, 3, 4, 7} for name in ("kbit_gemv_mma_split", "kbit_gemv_mma_streamk",
                                                       "kbit_mma_pipe", "kbit_wgmma")})

PTX_REG = re.compile(r"%\w+")
SASS_REG = re.compile(r"\bU?R\d+\b")


def ptx_pre_wait(lines):
    def source_of(code):
        m = re.search(r"ld\.param\.\w+\s+(%\w+),\s*\[\w+_param_(\d+)\]", code)
        return ([m.group(1)], int(m.group(2))) if m else None
    return tainted_loads(lines, r"griddepcontrol\.wait", source_of, r"\bld\.global", r"\[([^\]]*)\]", PTX_REG,
                         None)


def sass_pre_wait(lines, offsets):
    by_off = {0x210 + o: i for i, o in offsets.items()}

    def source_of(code):
        m = re.search(r"\b(U?LDC)(\.64)?\s+(U?R\d+),\s*c\[0x0\]\[(0x[0-9a-f]+)\]", code)
        if not m or int(m.group(4), 16) not in by_off:
            return None
        regs = [m.group(3)]
        if m.group(2):
            regs.append(_next(m.group(3)))
        return regs, by_off[int(m.group(4), 16)]

    def direct(text):
        return {by_off[int(o, 16)] for o in re.findall(r"c\[0x0\]\[(0x[0-9a-f]+)\]", text) if int(o, 16) in by_off}
    return tainted_loads(lines, r"ACQBULK", source_of, r"\bLDG\b", r"\[(U?R[^\]]*)\]", SASS_REG, _next, direct)


def _next(reg):
    m = re.match(r"(U?R)(\d+)", reg)
    return f"{m.group(1)}{int(m.group(2)) + 1}"


def cuobjdump() -> str:
    """cuobjdump from the triton package (``triton/backends/nvidia/bin``)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def hoisted(file: str, names, defines: dict, cuobj: str | None = None, csrc: str | None = None) -> dict:
    """{kernel name: sorted parameter indices a load of which ptxas moved above the wait} of one build of
    ``kbit/cuda/csrc/<file>`` (``defines``; ``ARCH_SPECIFIC=1``: sm_90a), for the kernels in ``names`` that wait;
    an empty list where none moved. ``csrc``: another tree's kernel folder (default: the package's)."""
    from kbit.cuda import runtime, sources

    d = dict(defines)
    arch = "sm_90a" if d.pop("ARCH_SPECIFIC", 0) else "sm_90"
    opts = sources.define_options(d)
    if csrc is None:
        src, hdrs = sources.read_source(file), sources.headers()
    else:
        texts = {f: open(os.path.join(csrc, f), encoding="utf-8").read() for f in os.listdir(csrc)
                 if f.endswith((".cu", ".cuh"))}
        src, hdrs = texts[file], {f: t for f, t in texts.items() if f.endswith(".cuh")}
    ptx = runtime.nvrtc_ptx(src, arch.replace("sm_", "compute_"), opts, name=file, headers=hdrs)
    ptx = split_funcs(ptx, r"\.entry (\w+)\(")
    cubin, _ = runtime.nvrtc_compile(src, arch, opts, name=file, headers=hdrs)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobj or cuobjdump(), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    sass = split_funcs(sass, r"Function : (\w+)")
    out = {}
    for name in names:
        p, sl = ptx.get(name, []), sass.get(name, [])
        pre_p, pre_s = ptx_pre_wait(p), sass_pre_wait(sl, param_offsets(p))
        if pre_p is None and pre_s is None:
            continue  # no wait
        if pre_p is None or pre_s is None:
            out[name] = ["the wait itself"]
            continue
        allowed = set().union(*pre_p) | WEIGHTS.get(name, set())
        out[name] = sorted(set().union(*pre_s) - allowed)
    return out

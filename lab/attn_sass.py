"""CPU lab: the decode attention's split kernel (``kbit.kernels.attention.split_kernel``) compiled for sm_90 without a
GPU, as the fast decode step launches it (PDL, prefetch before the wait, the last split merges), and its registers,
stack (spills) and SASS instruction counts.

    python lab/attn_sass.py [--g 4,8] [--sb 16,8,4] [--warps 2] [--unaligned]

A launch specializes the pointers as 16-byte aligned and the integer arguments divisible by 16 (the strides at
D = 128); ``--unaligned`` compiles without those facts. The 2026-11-27 claim that the 2-warp build spills 488
bytes a thread came from such an unaligned build: aligned, the same builds take 199-220 registers and no stack
(docs/notes/2026-11-27-k1-grid-attention-work.md).
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kbit.kernels.attention import split_kernel  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = dict(Q="*bf16", K="*bf16", V="*bf16", Mask="*bf16", Length="*i32", NewFrom="*i32", Counter="*i32",
                Out="*bf16", PartO="*fp32", PartM="*fp32", PartL="*fp32")
ALIGNED = ["Q", "K", "V", "Out", "PartO", "PartM", "PartL", "stride_qb", "stride_qh", "stride_qg", "stride_kb",
           "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn", "stride_ob", "stride_oh", "stride_og"]


def build(G: int, SB: int, warps: int, aligned: bool, block_n: int = 32, D: int = 128) -> str:
    params = inspect.signature(split_kernel.fn).parameters
    G_PAD = 1 << (G - 1).bit_length()
    const = dict(BLOCK_N=block_n, BLOCK_G=max(16, G_PAD), D=D, HAS_MASK=False, MASK_BOOL=False, HAS_LENGTH=True,
                 LENGTH_PER_ROW=False, SPLIT=True, PDL=True, PREFETCH=True, FOLD=True, G_PAD=G_PAD, SB=SB)
    sig = {n: POINTERS.get(n, "fp32" if n == "qk_scale" else "constexpr" if n in const or
                           params[n].default is not inspect.Parameter.empty else "i32") for n in params}
    for n in params:
        if sig[n] == "constexpr" and n not in const:
            const[n] = 32 if n == "S_PAD" else params[n].default
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED} if aligned else {}
    k = triton.compile(ASTSource(fn=split_kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([f"{BIN}/nvdisasm", "-c", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    count = {op: sum(1 for ln in lines if re.search(r"\b" + op + r"\b", ln)) for op in ("LDL", "STL", "BAR", "LDG",
                                                                                       "STG", "LDS", "STS")}
    regs, stack = re.search(r"REG:(\d+)", res).group(1), re.search(r"STACK:(\d+)", res).group(1)
    return f"G={G} SB={SB} warps={warps} aligned={aligned}: registers {regs}, stack {stack} B, {len(lines)} " \
           f"instructions, " + ", ".join(f"{op} {n}" for op, n in count.items())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--g", default="4,8", help="query rows per KV head (Llama-3-8B 4, Qwen2.5-7B 7 -> 8)")
    p.add_argument("--sb", default="16,8,4", help="partials per step of the merge (the launcher's SB)")
    p.add_argument("--warps", default="2")
    p.add_argument("--unaligned", action="store_true")
    a = p.parse_args()
    for w in map(int, a.warps.split(",")):
        for g in map(int, a.g.split(",")):
            for sb in map(int, a.sb.split(",")):
                print(build(g, sb, w, not a.unaligned), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

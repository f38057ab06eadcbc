"""Compile kbit.kernels.gemm / dequant for sm_90 on the CPU (triton 3.6 copy) and count SASS instructions.

    PYTHONPATH=/opt/triton36:src python benchmarks/gemm_sass.py k=4 BM=16 BN=128 BK=128 SWAP=1 S=3 W=4
"""
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, "src")
from kbit.kernels.dequant import dequant_kernel  # noqa: E402
from kbit.kernels.gemm import gemm_kernel  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def sass_of(cubin: bytes):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    return sass, res


def summary(sass, res):
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?", sass, re.M)
    counts = {}
    for o in ops:
        counts[o] = counts.get(o, 0) + 1
    keys = ["HGMMA", "HMMA", "LDG", "LDGSTS", "LDS", "STS", "LDSM", "STG", "LDL", "STL", "SHF", "LOP3", "FMUL",
            "F2FP", "BAR", "UTMALDG", "SYNCS", "WARPGROUP", "RED", "ATOMG"]
    line = " ".join(f"{k}={counts.get(k, 0)}" for k in keys)
    reg = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    shared = re.search(r"SHARED:(\d+)", res)
    return f"total={len(ops)} REG={reg and reg.group(1)} STACK={stack and stack.group(1)} " \
           f"SHARED={shared and shared.group(1)} {line}"


def gemm(k=4, BM=16, BN=128, BK=128, SWAP=1, S=3, W=4, B=32, dtype="bf16", SPLIT=0):
    sig = {"x_ptr": f"*{dtype}", "codes_ptr": "*i32", "scales_ptr": "*u8", "ts_ptr": "*fp32", "cb_ptr": f"*{dtype}",
           "e_ptr": "*fp32", "bias_ptr": f"*{dtype}", "y_ptr": "*fp32" if SPLIT else f"*{dtype}",
           "M": "i32", "N": "i32", "K": "i32", "KP": "i32", "WROW": "i32", "NB": "i32", "K_PER_SPLIT": "i32",
           "stride_xm": "i32", "stride_ym": "i32"}
    const = dict(K_BITS=k, BLOCKSIZE=B, LOG8=True, BM=BM, BN=BN, BK=BK, GROUP_M=8, SWAP=bool(SWAP),
                 SPLIT=bool(SPLIT), HAS_BIAS=False, EVEN_K=True, NUM_STAGES=S)
    for c in const:
        sig[c] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 16)}
    src = ASTSource(fn=gemm_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": W, "num_stages": S})


def dequant(k=4, B=32, dtype="bf16", BR=32, BK=128, W=4):
    sig = {"codes_ptr": "*i32", "scales_ptr": "*u8", "ts_ptr": "*fp32", "cb_ptr": "*fp32", "e_ptr": "*fp32",
           "out_ptr": f"*{dtype}", "R": "i32", "N": "i32", "K": "i32", "KP": "i32", "WROW": "i32", "NB": "i32",
           "stride_or": "i32", "stride_ok": "constexpr", "stride_om": "i32"}
    const = dict(stride_ok=1, K_BITS=k, BLOCKSIZE=B, LOG8=True, BR=BR, BK=BK)
    for c in const:
        sig[c] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14)}
    src = ASTSource(fn=dequant_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": W})


if __name__ == "__main__":
    kw = {}
    what = "gemm"
    for a in sys.argv[1:]:
        if a in ("gemm", "dequant"):
            what = a
            continue
        key, v = a.split("=")
        kw[key] = v if key == "dtype" else int(v)
    c = gemm(**kw) if what == "gemm" else dequant(**kw)
    sass, res = sass_of(c.asm["cubin"])
    if os.environ.get("DUMP"):
        open(os.environ["DUMP"], "w").write(sass)
        open(os.environ["DUMP"] + ".ttgir", "w").write(c.asm["ttgir"])
    print(what, kw, summary(sass, res))

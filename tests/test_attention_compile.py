"""The decode attention kernels compile for sm_90 on the CPU, with every constexpr branch a GPU launch takes (one
split or several, the folded merge or the combine kernel, PREFETCH, masks, q/k norms, programmatic dependent
launch): the interpreter runs them as Python and accepts code Triton's compiler refuses (e.g. a module global that
is not a ``tl.constexpr``). Same method as ``test_ptx_size.py``: a subprocess without TRITON_INTERPRET, stopped
before ptxas, its cache in a temp dir."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_SCRIPT = r"""
import json
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.errors import CompilationError
from triton.compiler import ASTSource
import triton.backends.nvidia.compiler as nvc
nvc.CUDABackend.make_cubin = staticmethod(lambda *a, **k: b"")
from kbit.kernels.attention import combine_kernel, rope_split_kernel, split_kernel
T = GPUTarget("cuda", 90, 32)
def build(fn, sig, const, warps):
    sig = {**sig, **{c: "constexpr" for c in const}}
    try:
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=T,
                           options={"num_warps": warps, "num_stages": 2})
        return len(c.asm["ptx"])
    except CompilationError as e:  # the kernel's own code: a failure, not a missing toolchain
        print(f"{fn.__name__} {const}: {e}", file=sys.stderr)
        sys.exit(3)
def ints(*names):
    return {n: "i32" for n in names}
def parts(split):  # with one split the launcher passes the output as the (unused) partials
    return {"PartO": "*fp32", "PartM": "*fp32", "PartL": "*fp32"} if split else \
        {"PartO": "*bf16", "PartM": "*bf16", "PartL": "*bf16"}
out = {}
for D, block_n, warps in [(128, 32, 2), (64, 64, 4), (256, 32, 4)]:
    for split, fold in [(False, False), (True, False), (True, True)]:
        for norm in (False, True):
            sig = {"Q": "*bf16", "Kx": "*bf16", "Vx": "*bf16", "Cos": "*bf16", "Sin": "*bf16", "Pos": "*i64",
                   "QN": "*bf16", "KN": "*bf16", "K": "*bf16", "V": "*bf16", "Counter": "*i32", "Out": "*bf16",
                   **parts(split),
                   **ints("stride_qb", "stride_kxb", "stride_vxb", "stride_cos", "stride_kb", "stride_kh",
                          "stride_kn", "stride_vb", "stride_vh", "stride_vn", "stride_ob", "stride_oh",
                          "stride_og", "H", "G", "L", "S", "chunk"),
                   "qk_scale": "fp32", "eps": "fp32"}
            out[f"rope D{D} n{block_n} split{split} fold{fold} norm{norm}"] = build(rope_split_kernel, sig, dict(
                BLOCK_N=block_n, BLOCK_G=16, D=D, QK_NORM=norm, SPLIT=split, PDL=True, FOLD=fold, G_PAD=4,
                S_PAD=32, SB=8), warps)
        for prefetch, mask in [(True, False), (False, True), (False, False)] if D == 128 else []:
            sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Mask": "*bf16",
                   "Length": "*i64", "NewFrom": "*i64", "Counter": "*i32", "Out": "*bf16", **parts(split),
                   **ints("stride_qb", "stride_qh", "stride_qg", "stride_kb", "stride_kh", "stride_kn", "stride_vb",
                          "stride_vh", "stride_vn", "stride_mb", "stride_mn", "stride_ob", "stride_oh",
                          "stride_og", "H", "G", "L", "S", "chunk"),
                   "qk_scale": "fp32"}
            out[f"split D{D} n{block_n} split{split} fold{fold} pf{prefetch} mask{mask}"] = build(split_kernel, sig,
                dict(BLOCK_N=block_n, BLOCK_G=16, D=D, HAS_MASK=mask, MASK_BOOL=False, HAS_LENGTH=not mask,
                     LENGTH_PER_ROW=False, SPLIT=split, PDL=True, PREFETCH=prefetch, FOLD=fold, G_PAD=4, S_PAD=32,
                     SB=8), warps)
    out[f"combine D{D}"] = build(combine_kernel, {"PartO": "*fp32", "PartM": "*fp32", "PartL": "*fp32",
                                                  "Out": "*bf16", **ints("stride_ob", "stride_oh", "stride_og", "H",
                                                                         "G", "S")},
                                 dict(D=D, S_PAD=32, BLOCK_S=16, PDL=True), 4)
print(json.dumps(out))
"""


def test_attention_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # the stubbed (empty) CUBINs must not reach the real cache
    src = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src"))
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode != 3, res.stderr[-3000:]
    if res.returncode != 0:
        pytest.skip(f"cannot compile for sm_90 here: {res.stderr.strip().splitlines()[-1:]}")
    sizes = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(sizes) == 3 * (3 * 2 + 1) + 3 * 3 and all(n > 0 for n in sizes.values())

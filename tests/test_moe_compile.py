"""The MoE decode kernels compile for sm_90 on the CPU, with the constexpr branches only a GPU launch takes
(expert range, block table, programmatic dependent launch): the interpreter runs them as Python and accepts code
Triton's compiler refuses (e.g. a module global that is not a ``tl.constexpr``). Same method as
``test_ptx_size.py``: a subprocess without TRITON_INTERPRET, stopped before ptxas, its cache in a temp dir.

The fused router is built with the programs ``fused_router_config`` gives real shapes, specialized as a launch
specializes it (16-byte aligned pointers, H a multiple of 16), and its PTX must issue every load of the weight
chunk before ``griddepcontrol.wait`` (the point of that kernel: ``kbit.kernels.moe.router_route_kernel``)."""
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
from kbit.kernels.moe import (combine_add_norm_kernel, combine_kernel, route_topk_kernel, router_route_kernel,
                              silu_mul_kernel)
from kbit.tuning.moe import fused_router_config
T = GPUTarget("cuda", 90, 32)
def compile_ptx(fn, sig, const, aligned=(), num_warps=4):
    sig = {**sig, **{c: "constexpr" for c in const}}
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    try:
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=T,
                              options=dict(num_warps=num_warps)).asm["ptx"]
    except CompilationError as e:  # the kernel's own code: a failure, not a missing toolchain
        print(f"{fn.__name__} {const}: {e}", file=sys.stderr)
        sys.exit(3)
def build(fn, sig, const):
    return len(compile_ptx(fn, sig, const))
out, early = {}, {}
route = {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i32", "tok_ptr": "*i32",
         "rows_ptr": "*i32", "blk_ptr": "*i32", "nblk_ptr": "*i32", "E": "i32", "stride_l": "i32",
         "scaling": "fp32", "start": "i32", "stop": "i32"}
for local, runs, sig_, k in [(True, True, False, 8), (False, True, True, 10), (True, False, False, 4)]:
    out[f"route {local} {runs} {sig_} {k}"] = build(route_topk_kernel, route, dict(
        TOP_K=k, SIGMOID=sig_, HAS_BIAS=sig_, RENORM=True, LOCAL=local, RUNS=runs, BLOCK_E=128,
        BLOCK_K=1 << (k - 1).bit_length(), PDL=True))
hid = {"x_ptr": "*bf16", "wr_ptr": "*bf16", "logits_ptr": "*bf16", "cnt_ptr": "*i32", **{
    k: v for k, v in route.items() if k not in ("logits_ptr", "stride_l")}, "H": "i32", "stride_x": "i32"}
hid.update({"res_ptr": "*bf16", "nw_ptr": "*bf16", "y_ptr": "*bf16", "rout_ptr": "*bf16", "stride_r": "i32",
            "stride_y": "i32", "stride_ro": "i32", "eps": "fp32"})
hid = {k: hid[k] for k in ("x_ptr", "wr_ptr", "logits_ptr", "cnt_ptr", "bias_ptr", "w_ptr", "ids_ptr", "tok_ptr",
                           "rows_ptr", "blk_ptr", "nblk_ptr", "E", "H", "stride_x", "scaling", "start", "stop",
                           "res_ptr", "nw_ptr", "y_ptr", "rout_ptr", "stride_r", "stride_y", "stride_ro", "eps")}
aligned = [k for k in hid if k.endswith("_ptr")] + ["E", "H", "stride_x", "stride_r", "stride_y", "stride_ro"]
# Qwen3-30B-A3B (EP, T = 1), gpt-oss-20b, Qwen3-235B-A22B, a DeepSeek-sized sigmoid router; Qwen3-30B-A3B with the
# norm in the launch (NORM: the norm weight is read before the wait too, nothing else)
for E, H, k, local, runs, sig_, renorm, norm in [(128, 2048, 8, True, True, False, True, False),
                                                 (32, 2880, 4, False, True, False, True, False),
                                                 (128, 4096, 8, False, False, False, False, False),
                                                 (256, 7168, 8, True, False, True, True, False),
                                                 (128, 2048, 8, False, False, False, True, True)]:
    c = fused_router_config(E, H)
    ptx = compile_ptx(router_route_kernel, hid, dict(
        TOP_K=k, SIGMOID=sig_, HAS_BIAS=sig_, RENORM=renorm, LOCAL=local, RUNS=runs, BLOCK_E=1 << (E - 1).bit_length(),
        BLOCK_K=1 << (k - 1).bit_length(), CHUNK_E=c.chunk_e, BLOCK_H=c.block_h, PDL=True, NORM=norm), aligned,
        c.num_warps)
    name = f"router_route {E}x{H}" + (" norm" if norm else "")
    out[name] = len(ptx)
    head = ptx[:ptx.index("griddepcontrol.wait")]
    early[name] = [head.count("ld.global.v4.b32"), head.count("ld.global"),
                   (c.chunk_e + norm) * c.block_h // (8 * 32 * c.num_warps)]
out["silu"] = build(silu_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16", "I": "i32", "stride_gu": "i32",
                                      "stride_out": "i32"}, dict(BLOCK=1024, PDL=True))
out["combine"] = build(combine_kernel, {"y_ptr": "*bf16", "pair_rows_ptr": "*i32", "w_ptr": "*fp32",
                                        "out_ptr": "*bf16", "err_ptr": "*i32", "P": "i32", "H": "i32",
                                        "stride_y": "i32", "stride_out": "i32"}, dict(TOP_K=8, BLOCK=1024, PDL=True))
out["combine_add_norm"] = build(combine_add_norm_kernel, {
    "y_ptr": "*bf16", "pair_rows_ptr": "*i32", "w_ptr": "*fp32", "res_ptr": "*bf16", "nw_ptr": "*bf16",
    "out_ptr": "*bf16", "rout_ptr": "*bf16", "err_ptr": "*i32", "P": "i32", "H": "i32", "stride_y": "i32",
    "stride_r": "i32", "stride_out": "i32", "stride_ro": "i32", "eps": "fp32"}, dict(TOP_K=8, BLOCK=2048, PDL=True))
print(json.dumps([out, early]))
"""


def test_moe_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # the stubbed (empty) CUBINs must not reach the real cache
    src = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src"))
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode != 3, res.stderr[-3000:]
    if res.returncode != 0:
        pytest.skip(f"cannot compile for sm_90 here: {res.stderr.strip().splitlines()[-1:]}")
    sizes, early = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(sizes) == 11 and all(n > 0 for n in sizes.values())
    # the fused router: each thread's weight chunk (16-byte loads) issued before the PDL wait, nothing else
    assert len(early) == 5 and all(v4 == n == want > 0 for v4, n, want in early.values()), early

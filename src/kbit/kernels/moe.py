"""MoE element-wise kernels: the fused SwiGLU activation and the weighted combine back to token order.

Only @triton.jit code lives here; launchers are in ``kbit.ops.moe``. Both kernels read and write the
activation dtype and compute in float32.
"""

import triton
import triton.language as tl


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_out, BLOCK: tl.constexpr):
    """``out[r, c] = silu(gu[r, c]) * gu[r, I + c]`` for ``c < I``: one program per (row, column block).

    ``gu`` is the gate_up product ``[P, 2I]`` with the gate in columns ``[0, I)`` and up in ``[I, 2I)``
    (Hugging Face's ``gate_up_proj`` order)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    base = gu_ptr + row * stride_gu
    g = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(base + I + cols, mask=ok, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def combine_kernel(y_ptr, pair_rows_ptr, w_ptr, out_ptr, H, stride_y, stride_out, TOP_K: tl.constexpr,
                   BLOCK: tl.constexpr):
    """``out[t, c] = sum_s w[t, s] * y[pair_rows[t * TOP_K + s], c]``: one program per (token, column block).

    Each token's ``TOP_K`` expert rows are summed in a fixed order in float32 (deterministic, no atomics)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        p = t * TOP_K + s
        r = tl.load(pair_rows_ptr + p).to(tl.int64)
        w = tl.load(w_ptr + p)
        v = tl.load(y_ptr + r * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        acc += w * v
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)

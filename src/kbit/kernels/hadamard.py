"""Triton kernel of the online randomized Hadamard transform (launcher and torch reference in
:mod:`kbit.ops.hadamard`).

:func:`hadamard_rotate_kernel` computes ``y = x R`` for a tile of ``BM`` rows and ``C`` columns of ``x [M, K]``,
``R = diag(signs) @ blockdiag(H_B, ..., H_B)`` (``H_B`` the Sylvester Walsh-Hadamard matrix of order ``B``,
normalised by ``scale = 1/sqrt(B)``): the signs are applied, then ``log2(B)`` butterfly stages run on the tile in
registers (float32 throughout), then the scale, and the result is stored in y's dtype. ``C`` is a multiple of
``B`` and ``B`` divides K, so a tile holds whole blocks and the masked columns past K form whole blocks of zeros.

Stage ``s`` (``h = 2**s``) pairs the elements ``i`` and ``i + h`` of every aligned group of ``2h``: viewing the
flat tile as ``[BM * C / (2h), 2, h]`` (row-major, so every block of ``B`` is contiguous and no group crosses a
block), the pair is the middle axis and becomes ``(a + c, a - c)``. Applying the stages from ``h = 1`` up is the
Sylvester product ``H_2 (x) H_2 (x) ... (x) H_2``, so the order of the stages does not change the result.

``PDL``: launched with programmatic dependent launch (sm_90), the kernel first lets the next kernel launch (a
k-bit GEMV may stream its weights; it waits for this kernel before reading y), then waits for the previous one
before reading x.
"""

import triton
import triton.language as tl

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: PDL is never requested there (see kbit.ops.pdl)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def hadamard_butterflies(x, N: tl.constexpr, LOG_B: tl.constexpr):
    """The unnormalised Walsh-Hadamard transform of every aligned block of ``2**LOG_B`` elements of the flat
    float32 tile ``x [N]`` (a helper a producing kernel's epilogue can call on the row it holds)."""
    for st in tl.static_range(LOG_B):  # stage st pairs i and i + 2**st (a constexpr: the shapes below are static)
        pairs = tl.permute(tl.reshape(x, (N // (2 << st), 2, 1 << st)), (0, 2, 1))  # [groups, h, 2]
        a, c = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + c, a - c), (0, 2, 1)), (N,))
    return x


@triton.jit
def hadamard_rotate_kernel(X, Signs, Y, M, K, stride_x, stride_y, scale,
                           BM: tl.constexpr, C: tl.constexpr, LOG_B: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the next kernel may launch now: it reads only weights before its own wait, which waits for us
        gdc_launch_dependents()
        gdc_wait()
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * C + tl.arange(0, C)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(Signs + cols, mask=cols < K, other=0).to(tl.float32)
    y = tl.reshape(hadamard_butterflies(tl.reshape(x * s[None, :], (BM * C,)), BM * C, LOG_B), (BM, C)) * scale
    tl.store(Y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

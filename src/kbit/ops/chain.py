"""Consecutive one-token projections in one persistent launch: :func:`linear_chain`.

A one-token decode step is a chain of GEMVs, each waiting for the previous one's output: in a dense layer the
attention output goes through o_proj, the residual add + RMSNorm and gate/up, SiLU * up, down, then the next
layer's add + norm and q/k/v. Launched one by one, every projection pays a kernel boundary on the critical path:
the grid drains, the next one ramps up, and its weights stream only once its CTAs are resident (H100: ~1800 us for
the 128 GEMVs of a Llama-3-8B step at k = 4 against ~1235 us of bytes, ``docs/notes/e2e.md``).

Kernel 8 of :mod:`kbit.cuda.gemv_mma_src` runs up to four such projections as phases of one launch. Each phase is
kernel 3 (stream-K, x in shared memory, the add + norm prologue and the SiLU * up epilogue of
:mod:`kbit.ops.prologue`); between phases a warp loads the next phase's first weights as soon as its own range is
done, and the CTAs meet at a grid-wide arrival counter instead of a kernel boundary. The grid is the CTAs that fit
at once (all resident: the wait cannot deadlock while nothing else holds the GPU's SMs for good).

:func:`linear_chain` runs the fused launch for :class:`~kbit.nn.KbitLinear` modules in layout "mma-v1" on CUDA
with M <= 2 rows (x of every phase staged in shared memory) and the separate launches otherwise (CPU,
``torch.compile``, other modules, ``KBIT_CHAIN=0``), with the same semantics. The arrival counters are one set a
device: chains on concurrent streams must not run at the same time.
"""
from __future__ import annotations

import os
import struct

import torch

from kbit.ops import gemv_mma
from kbit.ops.prologue import _rows_ok, _silu_halves, add_rms_norm_linear

__all__ = ["MAX_PHASES", "MAX_M", "chain_config", "linear_chain"]

#: projections a launch (kernel 8's ``MAXPH``)
MAX_PHASES = 4
#: rows a fused launch: x of every phase and a norm weight sit in shared memory beside the table, 2 CTAs an SM
MAX_M = 2

_PHASE = "QQQQQQQQQQfiiiiiiiiiii"  # struct Phase of kernel 8 (128 bytes)
_CHAIN = "@" + _PHASE * MAX_PHASES + "QQQQiiii"
_BAR: dict = {}
_PLANS: dict = {}


def chain_config(k: int):
    """(warps a CTA, CTAs an SM, ring depth) of kernel 8; ``KBIT_CHAIN_CFG="W,MINB,PD"`` overrides (lab)."""
    if os.environ.get("KBIT_CHAIN_CFG"):
        return tuple(int(v) for v in os.environ["KBIT_CHAIN_CFG"].split(","))
    return (8, 2, gemv_mma.PIPE[k])


def _enabled() -> bool:
    return os.environ.get("KBIT_CHAIN", "1") != "0"


def _check_stages(x, residual, stages):
    if not isinstance(stages, (list, tuple)) or not stages:
        raise ValueError(f"stages: expected a non-empty list of (linear, norm_weight, eps, silu_mul), got {stages!r}")
    width = x.shape[-1]
    for i, st in enumerate(stages):
        if not isinstance(st, (list, tuple)) or len(st) != 4:
            raise ValueError(f"stages[{i}]: expected (linear, norm_weight, eps, silu_mul), got {st!r}")
        lin, nw, eps, silu = st
        if getattr(lin, "in_features", None) != width:
            raise ValueError(f"stages[{i}]: expected in_features {width} (the previous output's width), got "
                             f"{getattr(lin, 'in_features', None)}")
        if nw is not None:
            if residual is None:
                raise ValueError(f"residual: stages[{i}] has a norm (residual add + RMSNorm), so a residual is "
                                 "needed, got None")
            if tuple(nw.shape) != (width,):
                raise ValueError(f"stages[{i}]: expected a norm weight of shape ({width},), got {tuple(nw.shape)}")
        n = lin.out_features
        if silu and n % 2:
            raise ValueError(f"stages[{i}]: silu_mul needs an even out_features (gate and up halves), got {n}")
        width = n // 2 if silu else n


def _fusable(x, residual, stages) -> bool:
    from kbit.nn import KbitLinear

    if not (_enabled() and x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_M and len(stages) <= MAX_PHASES
            and x.dtype in (torch.float16, torch.bfloat16) and _rows_ok(x) and gemv_mma.available(x.device)
            and not torch.compiler.is_compiling()):
        return False
    if residual is not None and not (residual.is_contiguous() and _rows_ok(residual) and residual.dtype == x.dtype
                                     and residual.shape == x.shape):
        return False
    l0 = stages[0][0]
    for lin, nw, _, silu in stages:
        if type(lin) is not KbitLinear or lin.layout != gemv_mma.LAYOUT or lin.k != l0.k or \
                lin.scale_format != l0.scale_format or lin.in_features % 8 or lin.codes.device != x.device:
            return False
        if nw is not None and (nw.dtype != x.dtype or not nw.is_contiguous()):
            return False
        if (silu and lin.out_features % 32) or lin.out_features % 16:  # 16-byte aligned rows of every output
            return False
    return True


def linear_chain(x: torch.Tensor, residual: torch.Tensor | None, stages) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run projections one after the other: for each ``(lin, norm_weight, eps, silu_mul)`` of ``stages``, with
    ``h`` the previous output (``x`` at first) and ``r`` the running residual,

    - ``norm_weight`` not None: ``r = r + h``, ``h = rms_norm(r) * norm_weight`` (:func:`kbit.ops.glue.add_rms_norm`);
    - ``h = lin(h)``; with ``silu_mul``: ``h = silu(h[:, :N/2]) * h[:, N/2:]`` (a fused gate/up, gate rows first).

    Returns ``(h, r)``. ``x``, ``residual`` ``[M, K]``. One launch of kernel 8 where it runs (see the module doc),
    the same steps as separate launches (:func:`kbit.ops.prologue.add_rms_norm_linear`) otherwise."""
    _check_stages(x, residual, stages)
    if not _fusable(x, residual, stages):
        return linear_chain_unfused(x, residual, stages)
    return _launch_chain(x, residual, stages)


def _bar(device):
    b = _BAR.get(device)
    if b is None:
        b = _BAR[device] = torch.zeros(MAX_PHASES, dtype=torch.int32, device=device)
    return b


def _plan(k, M, scale_format, bf16, dev, shapes):
    """Compiled kernel, CTA size, grid and dynamic shared bytes of one chain shape (cached)."""
    from kbit.cuda import compile_kernel
    from kbit.cuda.gemv_mma_src import SOURCE

    W, X, pd = chain_config(k)
    key = (k, M, scale_format, bf16, dev, shapes, W, X, pd, os.environ.get("KBIT_CHAIN_NOWAIT"))
    p = _PLANS.get(key)
    if p is not None:
        return p
    defines = dict(KERNEL=8, K_BITS=k, NG=1, D=1, MAXW=W, MINB=X, PD=pd, XS=1, PRO=2, EPI=1, L2PF=0,
                   BF16=int(bf16), FP16_SCALES=int(scale_format == "fp16"))
    if os.environ.get("KBIT_CHAIN_NOWAIT") == "1":  # lab: no waits between phases (wrong results, timing only)
        defines["CHAIN_NOWAIT"] = 1
    kern = compile_kernel(SOURCE, "kbit_gemv_chain", defines, dev)
    xs = max((M + int(pro)) * S * gemv_mma.SEG * 2 for S, pro in shapes)
    shared = gemv_mma._table_smem(k) + xs
    occ = kern.occupancy(W * 32, shared)
    if occ < 1:
        raise RuntimeError(f"kbit chain: no CTA fits ({shared} bytes of shared memory, {W} warps)")
    p = dict(kern=kern, W=W, grid=gemv_mma._sms(dev) * occ, shared=shared)
    if len(_PLANS) > 1024:
        _PLANS.clear()
    _PLANS[key] = p
    return p


def _launch_chain(x, residual, stages):
    dev, M = x.device, x.shape[0]
    k, scale_format = stages[0][0].k, stages[0][0].scale_format
    S_of = [-(-lin.in_features // gemv_mma.SEG) for lin, *_ in stages]
    # x of every phase is read as whole 256-column segments: the widths must be multiples of 256 there (the
    # kernel stages the first K columns and zero-fills the rest only for prologue phases)
    for (lin, nw, _, _), S in zip(stages, S_of, strict=True):
        if nw is None and lin.in_features != S * gemv_mma.SEG:
            return linear_chain_unfused(x, residual, stages)
    p = _plan(k, M, scale_format, x.dtype == torch.bfloat16, dev,
              tuple((S, nw is not None) for S, (_, nw, _, _) in zip(S_of, stages, strict=True)))
    Nt_max = max(-(-lin.out_features // 16) for lin, *_ in stages)
    ws, cnt = gemv_mma._workspace(dev, M, Nt_max * 16, Nt_max)
    h, r = x, residual
    fields = []
    keep = []  # every buffer alive until the launch is queued (no two phases' buffers share memory)
    for (lin, nw, eps, silu), S in zip(stages, S_of, strict=True):
        N = lin.out_features
        y = torch.empty(M, N // 2 if silu else N, dtype=x.dtype, device=dev)
        r_out = torch.empty_like(r) if nw is not None else None
        bias = lin.bias.contiguous() if lin.bias is not None else None
        keep += [y, r_out, bias]
        bias_kind = 0 if bias is None else {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}[bias.dtype]
        fields += [lin.codes.data_ptr(), lin.scales.data_ptr(), lin.tensor_scale.data_ptr(),
                   lin.codebook.data_ptr(), h.data_ptr(), y.data_ptr(), bias.data_ptr() if bias is not None else 0,
                   r.data_ptr() if nw is not None else 0, r_out.data_ptr() if nw is not None else 0,
                   nw.data_ptr() if nw is not None else 0,
                   float(eps if nw is not None else 0.0), lin.in_features, N, S, -(-N // 16), h.stride(0),
                   y.stride(0), r.stride(0) if nw is not None else 0, bias_kind, 2 if nw is not None else 0,
                   int(bool(silu)), 0]
        h = y
        if nw is not None:
            r = r_out
    for _ in range(MAX_PHASES - len(stages)):
        fields += [0] * 10 + [0.0] + [0] * 11
    fields += [gemv_mma._etab(dev).data_ptr(), ws.data_ptr(), cnt.data_ptr(), _bar(dev).data_ptr(), len(stages), M,
               Nt_max * 16, 0]
    buf = struct.pack(_CHAIN, *fields)
    p["kern"]((p["grid"],), p["W"] * 32, f"{len(buf)}s", buf, shared=p["shared"], pdl=True)
    if _DEBUG is not None:
        _DEBUG[:] = keep
    return h, r


#: lab: set to a list to receive every phase's (y, residual out, bias) of the last fused launch
_DEBUG = None


def linear_chain_unfused(x, residual, stages):
    """:func:`linear_chain` as separate launches (what it falls back to)."""
    h, r = x, residual
    for lin, nw, eps, silu in stages:
        if nw is not None:
            h, r = add_rms_norm_linear(h, r, nw, eps, lin, silu_mul=silu)
        else:
            z = lin(h)
            h = _silu_halves(z, lin.out_features) if silu else z
    return h, r

"""The built-in kbit candidates of the harness (see :mod:`kbit.bench.registry`), registered on import: the
GEMVs, the dense dispatcher and its backends, dequantize + bf16, the grouped (MoE) kernels and a self-check."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kbit.bench.registry import Unsupported, register
from kbit.bench.weights import kbit_api
from kbit.dispatch import linear as dispatch_linear
from kbit.ops import gemm
from kbit.ops.gemv import MAX_M as GEMV_MAX_M
from kbit.ops.gemv import gemv, grouped_gemv
from kbit.ops.grouped_mma import grouped_linear
from kbit.ops.mma.common import kernels_available


def _kw(qw) -> dict:
    return dict(k=qw.k, blocksize=qw.blocksize, scale_format=qw.scale_format, N=qw.shape[-2], K=qw.shape[-1])


# ------------------------------------------------------------------------------------------ dense
@register("gemv", note="kbit.ops.gemv.gemv (the fused Triton GEMV), M <= kbit.ops.gemv.MAX_M")
def _gemv(qw, M):
    # Above MAX_M the GEMV runs as M / MAX_M launches, a path the dispatcher never takes; timing it cost seconds a
    # shape at M = 1024 (17 ms a call on 28672x4096) and crowded real points out of budgeted suite runs.
    if M > GEMV_MAX_M:
        raise Unsupported(f"M > {GEMV_MAX_M} (the dispatcher's GEMV range)")
    kw = _kw(qw)
    return lambda x: gemv(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)


@register("dequant+bf16", note="kbit.dequantize then F.linear (unfused baseline)", default=False)
def _dequant_linear(qw, M):
    dequantize = kbit_api()[1]
    return lambda x: F.linear(x, dequantize(qw, dtype=torch.bfloat16))


@register("dummy-linear", note="F.linear on a bf16 weight of the same shape (harness self-check)",
          default=False, needs_kbit=False)
def _dummy_linear(qw, M):
    N, K = qw.shape[-2], qw.shape[-1]
    w = torch.randn(N, K, device=qw.codes.device, dtype=torch.bfloat16) * 0.02
    return lambda x: F.linear(x, w)


@register("kbit-linear", note="kbit.dispatch.linear.linear: the per-GPU dispatcher (GEMV / fused / dequant+cuBLAS)")
def _linear(qw, M):
    kw = _kw(qw)
    return lambda x: dispatch_linear.linear(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)


@register("gemm-fused", note="kbit.ops.gemm.gemm_fused (tensor cores, tiles decoded in registers)")
def _fused(qw, M):
    kw = _kw(qw)
    return lambda x: gemm.gemm_fused(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)


@register("dequant+cublas", note="kbit.ops.dequant kernel to bf16, then F.linear (cuBLAS)")
def _dequant_mm(qw, M):
    kw = _kw(qw)
    return lambda x: dispatch_linear.dequant_mm(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)


# ------------------------------------------------------------------------------------------ MoE
@register("grouped_gemv", kind="moe", note="kbit.ops.gemv.grouped_gemv")
def _grouped_gemv(qw, routing):
    kw = _kw(qw)
    eids = routing.expert_ids
    # the harness hands over rows already gathered per (token, slot), so row p is "token" p
    rows = torch.arange(eids.numel(), dtype=torch.int32, device=eids.device)
    return lambda a: grouped_gemv(a, rows, eids, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)


@register("grouped_mma", kind="moe", note="kbit.ops.grouped_mma.grouped_linear (tensor cores, CUDA)")
def _grouped_mma(qw, routing):
    eids = routing.expert_ids
    if not kernels_available(eids.device):
        raise Unsupported("the CUDA grouped kernel is not available here (NVRTC / GPU)")
    kw = _kw(qw)
    rows = torch.arange(eids.numel(), dtype=torch.int32, device=eids.device)
    return lambda a: grouped_linear(a, rows, eids, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)

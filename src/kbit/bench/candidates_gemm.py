"""Bench candidates of the GEMM work (issue 4): the dispatcher, the fused tensor-core kernel, dequantize +
cuBLAS. Imported by ``kbit.bench.registry``; kbit is imported only when a factory runs."""
from __future__ import annotations

from kbit.bench.registry import Unsupported, register


def _kw(qw) -> dict:
    return dict(k=qw.k, blocksize=qw.blocksize, scale_format=qw.scale_format, N=qw.shape[-2], K=qw.shape[-1])


def _ops():
    try:
        from kbit.ops import gemm
    except ImportError as e:
        raise Unsupported(f"kbit.ops.gemm not importable ({e})") from e
    return gemm


@register("kbit-linear", note="kbit.ops.gemm.linear: the per-GPU dispatcher (GEMV / fused / dequant+cuBLAS)")
def _linear(qw, M):
    g = _ops()
    kw = _kw(qw)
    return lambda x: g.linear(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)


@register("gemm-fused", note="kbit.ops.gemm.gemm_fused (tensor cores, tiles decoded in registers)")
def _fused(qw, M):
    g = _ops()
    kw = _kw(qw)
    return lambda x: g.gemm_fused(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)


@register("dequant+cublas", note="kbit.ops.dequant kernel to bf16, then F.linear (cuBLAS)")
def _dequant_mm(qw, M):
    g = _ops()
    kw = _kw(qw)
    return lambda x: g.dequant_mm(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)

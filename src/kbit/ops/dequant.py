"""Dequantize a k-bit weight on the GPU: canonical layout -> float ``[..., N, K]`` (or ``[..., K, N]``).

Launcher (validate -> allocate -> pick config -> launch ``kbit.kernels.dequant.dequant_kernel``) beside its
plain-torch reference (:func:`kbit.format.reference.dequantize_reference`, bit-exact: both compute
``codebook[c] * scale`` in float32, then cast), and the torch op ``torch.ops.kbit.dequantize``.
"""

from __future__ import annotations

import torch

from kbit import cuda, options
from kbit.format.reference import dequantize_reference
from kbit.format.spec import KbitWeight, padded_k
from kbit.kernels.dequant import dequant_kernel
from kbit.ops._common import e_table
from kbit.utils.checks import fail

__all__ = ["dequantize", "dequantize_tensors", "dequantize_triton", "OUT_DTYPES"]

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _config(k: int, R: int, kp: int) -> tuple[int, int, int]:
    """(BR, BK, num_warps): 128-column tiles (every blocksize divides them), 32 rows; 4 warps.

    Each thread ends up with 8-32 contiguous output columns (16-byte stores or more)."""
    return 32, 128, 4


def dequantize_tensors(codes, scales, tensor_scale, codebook, *, k: int, blocksize: int, scale_format: str,
                       shape, dtype=torch.bfloat16, transpose: bool = False, out=None) -> torch.Tensor:
    """float weight of the canonical tensors: ``[..., N, K]``, or ``[..., K, N]`` if ``transpose``.

    Parameters
    ----------
    codes : int32 ``[..., N, Kp*k/32]``; scales : uint8/fp16 ``[..., N, Kp/blocksize]``; tensor_scale :
    float32 ``[...]``; codebook : float32 ``[2**k]`` (all on one CUDA device, contiguous).
    dtype : float16, bfloat16 or float32 (float64: float32 values, cast).
    out : optional preallocated output of the right shape and dtype (contiguous).
    """
    shape = tuple(int(s) for s in shape)
    *lead, N, K = shape
    if dtype not in OUT_DTYPES + (torch.float64,):
        raise TypeError(f"dtype: expected one of {OUT_DTYPES + (torch.float64,)}, got {dtype}")
    kdtype = torch.float32 if dtype == torch.float64 else dtype
    kp = padded_k(K, blocksize)
    R = N
    for d in lead:
        R *= d
    dev = codes.device
    oshape = (*lead, K, N) if transpose else (*lead, N, K)
    if out is None or kdtype != dtype:
        o = torch.empty(oshape, dtype=kdtype, device=dev)
    else:
        if tuple(out.shape) != oshape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous {dtype} tensor of shape {oshape}, got "
                             f"{out.dtype} {tuple(out.shape)}")
        o = out
    if R == 0 or K == 0:
        return o.to(dtype)
    if not transpose and _use_cuda(dev):
        _launch_cuda(codes, scales, tensor_scale, codebook, o, k=k, blocksize=blocksize,
                     scale_format=scale_format, R=R, N=N, K=K, kp=kp)
        return o if o.dtype == dtype else o.to(dtype)
    BR, BK, nw = _config(k, R, kp)
    grid = (-(-R // BR), -(-kp // BK))
    ts = tensor_scale.reshape(-1).contiguous()
    if transpose:
        s_or, s_ok = 1, N
    else:
        s_or, s_ok = K, 1
    dequant_kernel[grid](
        codes.contiguous(), scales.contiguous(), ts, codebook.contiguous(), e_table(dev), o,
        R, N, K, kp, codes.shape[-1], scales.shape[-1], s_or, s_ok, N * K,
        K_BITS=k, BLOCKSIZE=blocksize, LOG8=scale_format == "log8", BR=BR, BK=BK, num_warps=nw,
    )
    return o if o.dtype == dtype else o.to(dtype)


def _use_cuda(device) -> bool:
    """The CUDA kernel (``dequant.cu``) serves CUDA tensors (not transposed) unless ``kbit.options`` forces the
    Triton kernels (``backend='triton'``)."""
    return device.type == "cuda" and options.get().backend != "triton" and cuda.available()


_UNITS = 4  # 8-weight groups a thread (loads in flight)
_KERNELS: dict = {}  # (k, blocksize, scale_format, dtype, vec, units, device) -> loaded CUDA kernel
_OUT_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _launch_cuda(codes, scales, tensor_scale, codebook, o, *, k, blocksize, scale_format, R, N, K, kp):
    gpr = -(-K // 8)  # 8-column groups per row
    if R >= 2**31:
        raise ValueError(f"codes: at most 2**31 - 1 rows per call, got {R}")
    threads = 64
    while threads < 256 and threads * _UNITS < gpr:
        threads *= 2
    codes = codes.contiguous()
    vec = K % 8 == 0 and o.data_ptr() % 16 == 0
    key = (k, blocksize, scale_format, o.dtype, vec, _UNITS, o.device)
    kern = _KERNELS.get(key)
    if kern is None:  # compile_kernel hashes the whole source: keep that off the per-call path
        kern = _KERNELS[key] = cuda.compile_kernel(
            "dequant.cu", "kbit_dequant", dict(K_BITS=k, BLOCKSIZE=blocksize, FP16_SCALES=int(scale_format == "fp16"),
                                         OUT=_OUT_CODE[o.dtype], VEC=int(vec), U=_UNITS), o.device)
    sc = scales.contiguous()
    ts = tensor_scale.reshape(-1).contiguous()
    cb = codebook.contiguous()
    e = e_table(o.device)
    kern((R, -(-gpr // (threads * _UNITS))), threads, "QQQQQQIiiiiI", codes.data_ptr(), sc.data_ptr(),
         ts.data_ptr(), cb.data_ptr(), e.data_ptr(), o.data_ptr(), N, K, kp, codes.shape[-1], sc.shape[-1], gpr)


def dequantize_triton(qw: KbitWeight, dtype=torch.bfloat16, transpose: bool = False, out=None) -> torch.Tensor:
    """:func:`dequantize_tensors` of a :class:`~kbit.format.KbitWeight` (on a CUDA device)."""
    return dequantize_tensors(qw.codes, qw.scales, qw.tensor_scale, qw.codebook, k=qw.k,
                              blocksize=qw.blocksize, scale_format=qw.scale_format, shape=qw.shape,
                              dtype=dtype, transpose=transpose, out=out)


def _dtype_code(dtype) -> int:
    return {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}[dtype]


_CODE_DTYPE = {0: torch.float16, 1: torch.bfloat16, 2: torch.float32}


@torch.library.custom_op("kbit::dequantize", mutates_args=())
def _dequantize_op(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
                   codebook: torch.Tensor, k: int, blocksize: int, scale_format: str, shape: list[int],
                   dtype_code: int, transpose: bool) -> torch.Tensor:
    dtype = _CODE_DTYPE[dtype_code]
    if not codes.is_cuda or options.get().backend == "torch":
        qw = KbitWeight(codes, scales, tensor_scale, codebook, tuple(shape), k, blocksize, scale_format)
        w = dequantize_reference(qw, dtype)
        return w.transpose(-1, -2).contiguous() if transpose else w
    return dequantize_tensors(codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                              scale_format=scale_format, shape=shape, dtype=dtype, transpose=transpose)


@_dequantize_op.register_fake
def _(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, shape, dtype_code, transpose):
    *lead, N, K = shape
    oshape = (*lead, K, N) if transpose else (*lead, N, K)
    return codes.new_empty(oshape, dtype=_CODE_DTYPE[dtype_code])


#: weight dtypes :func:`dequantize` returns
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dequantize(qw: KbitWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The float weight ``[..., N, K]`` that ``qw`` stands for, as ``dtype`` (math in float32): ``kbit.dequantize``.
    On a GPU through the ``kbit::dequantize`` op (bit-exact with the reference), else the plain-torch reference."""
    if not isinstance(qw, KbitWeight):
        fail(TypeError, "qw", "a KbitWeight", type(qw).__name__)
    if dtype not in FLOAT_DTYPES:
        fail(TypeError, "dtype", f"one of {FLOAT_DTYPES}", dtype)
    if qw.codes.is_cuda:
        return dequantize_triton(qw, dtype)
    return dequantize_reference(qw, dtype)

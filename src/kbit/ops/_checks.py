"""Argument checks shared by the linear ops (dense and grouped, canonical and "mma-v1" weights); imports no op.

:func:`check_linear` is the one validator of a dense op's inputs: every dense backend (the CPU path, the Triton
GEMV and GEMM, dequantize + cuBLAS, the CUDA small-M kernels) and the fake implementations of the torch ops call it,
each with the x dtypes it computes on. It reads metadata only (types, dtypes, shapes, devices): no host sync, and
it traces under ``torch.compile``.
"""

from __future__ import annotations

import math

import torch

from kbit.format.spec import SCALE_FORMATS, check_blocksize, check_k, check_scale_format
from kbit.utils.checks import check_tensor, fail

__all__ = ["FLOAT_X", "SCALE_FORMATS", "X16", "check_bias", "check_dense", "check_format", "check_grouped",
           "check_linear", "check_norm", "check_not_meta", "check_params", "check_rows", "check_weight_tensors",
           "check_x"]

#: activation dtypes of the CPU path (and of the torch ops' fake implementations)
FLOAT_X = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: activation dtypes of the GPU kernels
X16 = (torch.float16, torch.bfloat16)
#: bias dtypes the GPU kernels read
_KERNEL_BIAS = (torch.float16, torch.bfloat16, torch.float32)


def check_format(k, blocksize, scale_format) -> None:
    """The format parameters (the format's own checks, ``kbit.format.spec``)."""
    check_k(k)
    check_blocksize(blocksize)
    check_scale_format(scale_format)


def check_params(k, blocksize, scale_format, N, K) -> None:
    """The format parameters of a weight ``[N, K]``."""
    check_format(k, blocksize, scale_format)
    if isinstance(N, bool) or not (isinstance(N, int) and N >= 1):
        fail(ValueError, "N", "a positive int", N)
    if isinstance(K, bool) or not (isinstance(K, int) and K >= 1):
        fail(ValueError, "K", "a positive int", K)


def check_not_meta(name: str, t: torch.Tensor) -> None:
    """``t`` holds data: a meta tensor outside tracing would make an op return uninitialised memory (its fake
    implementation runs) or meta results nobody can read."""
    if t.device.type == "meta" and not torch.compiler.is_compiling():
        fail(ValueError, name, "a tensor with data (meta tensors only while tracing)", "a tensor on the meta device")


def check_x(x, K: int, dtypes=FLOAT_X) -> None:
    """``x [..., K]``: a floating-point tensor of one of ``dtypes``, not on the meta device."""
    if isinstance(x, torch.Tensor) and x.dtype in dtypes and x.dim() >= 1 and x.shape[-1] == K \
            and x.device.type != "meta":
        return  # the common case in a few attribute reads: this runs on every CPU call
    if not isinstance(x, torch.Tensor):
        fail(TypeError, "x", "a torch.Tensor", type(x).__name__)
    if x.dtype not in dtypes:
        fail(TypeError, "x", "dtype " + " or ".join(str(d) for d in dtypes), x.dtype)
    if x.dim() < 1 or x.shape[-1] != K:
        fail(ValueError, "x", f"last dimension K={K} (the weight's in_features)", f"shape {tuple(x.shape)}")
    check_not_meta("x", x)


def check_bias(bias, N: int, device, dtypes=FLOAT_X) -> None:
    """``bias`` is None or exactly ``[N]`` (no broadcasting) of one of ``dtypes`` on ``device``."""
    if bias is None or (isinstance(bias, torch.Tensor) and bias.dtype in dtypes and bias.dim() == 1
                        and bias.shape[0] == N and bias.device == device):
        return
    check_tensor("bias", bias, dtypes, (N,), device)


def check_weight_tensors(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, lead, device,
                         contiguous: bool = True) -> None:
    """Canonical weight tensors of ``lead + [N, K]`` on ``device`` (codes and scales contiguous where asked)."""
    Kp = math.ceil(K / blocksize) * blocksize
    check_tensor("codes", codes, (torch.int32,), (*lead, N, Kp * k // 32), device)
    sdt = torch.uint8 if scale_format == "log8" else torch.float16
    check_tensor("scales", scales, (sdt,), (*lead, N, Kp // blocksize), device)
    check_tensor("tensor_scale", tensor_scale, (torch.float32,), lead, device)
    check_tensor("codebook", codebook, (torch.float32,), (2**k,), device)
    if contiguous and not codes.is_contiguous():
        fail(ValueError, "codes", "a contiguous tensor", f"strides {codes.stride()}")
    if contiguous and not scales.is_contiguous():
        fail(ValueError, "scales", "a contiguous tensor", f"strides {scales.stride()}")


def check_linear(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias,
                 x_dtypes=FLOAT_X, bias_dtypes=FLOAT_X, contiguous: bool = False) -> int:
    """The arguments of a dense ``x @ W.T (+ bias)`` on canonical tensors of ``W [N, K]``: the format parameters,
    ``x [..., K]`` of ``x_dtypes``, the weight tensors and ``bias [N]`` (of ``bias_dtypes``) on x's device, no
    meta tensor outside tracing. Returns Kp (K padded to whole blocks)."""
    check_params(k, blocksize, scale_format, N, K)
    check_x(x, K, x_dtypes)
    check_weight_tensors(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, (), x.device,
                         contiguous)
    check_bias(bias, N, x.device, bias_dtypes)
    return math.ceil(K / blocksize) * blocksize


def check_dense(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias) -> None:
    """The arguments of a dense small-M GPU call (``kbit.ops.gemv.gemv``, ``kbit.ops.gemv_mma.linear_small_m``):
    :func:`check_linear` with 16-bit x and contiguous codes and scales."""
    check_linear(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias, X16,
                 _KERNEL_BIAS, contiguous=True)


def check_grouped(x, rows_name, rows, expert_ids, codes, scales, tensor_scale, codebook, k, blocksize,
                  scale_format, N, K) -> int:
    """The arguments of a grouped call (``y[r] = x[rows[r]] @ W[expert_ids[r]].T``); returns E."""
    check_params(k, blocksize, scale_format, N, K)
    check_tensor("x", x, (torch.float16, torch.bfloat16))
    if x.dim() != 2 or x.shape[1] != K:
        fail(ValueError, "x", f"shape [T, {K}]", tuple(x.shape))
    if codes.dim() != 3:
        fail(ValueError, "codes", "a 3-D stack [E, N, words]", tuple(codes.shape))
    E = codes.shape[0]
    check_weight_tensors(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, (E,), x.device)
    check_tensor(rows_name, rows, (torch.int32,), None, x.device)
    check_tensor("expert_ids", expert_ids, (torch.int32,), None, x.device)
    if rows.dim() != 1 or expert_ids.shape != rows.shape:
        fail(ValueError, "expert_ids", f"shape of {rows_name} {tuple(rows.shape)} (1-D)", tuple(expert_ids.shape))
    return E


#: activation dtypes of the norm and glue ops
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_rows(name, t, dtype=None, device=None, width=None):
    """``t`` is a [rows, features] float16/bfloat16/float32 tensor with a contiguous last dim, of ``dtype``,
    on ``device`` and ``width`` features where given."""
    check_tensor(name, t, dtype if dtype is not None else NORM_DTYPES, device=device)
    if t.dim() != 2:
        fail(ValueError, name, "2 dims [rows, features]", f"shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(ValueError, name, "a contiguous last dim (stride 1)", f"strides {t.stride()}")
    if width is not None and t.shape[-1] != width:
        fail(ValueError, name, f"{width} features", f"shape {tuple(t.shape)}")


def check_norm(x, weight, eps, residual):
    """The arguments of ``kbit.ops.glue.add_rms_norm`` (``residual`` may be None: ``rms_norm``)."""
    check_rows("x", x)
    if residual is not None:
        check_rows("residual", residual, x.dtype, x.device, x.shape[1])
        if residual.shape != x.shape:
            fail(ValueError, "residual", f"shape {tuple(x.shape)}", tuple(residual.shape))
    if not isinstance(weight, torch.Tensor) or weight.shape != (x.shape[1],):
        fail(ValueError, "weight", f"shape ({x.shape[1]},)",
             tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__)
    if weight.device != x.device:
        fail(ValueError, "weight", f"a tensor on {x.device}", weight.device)
    if not weight.is_contiguous():
        fail(ValueError, "weight", "a contiguous tensor", f"strides {weight.stride()}")
    if not eps > 0:
        fail(ValueError, "eps", "> 0", eps)

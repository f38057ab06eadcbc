"""Argument checks shared by the linear ops (dense and grouped, canonical and "mma-v1" weights); imports no op."""

from __future__ import annotations

import math

import torch

from kbit.format.spec import SCALE_FORMATS, check_blocksize, check_k, check_scale_format
from kbit.utils.checks import check_tensor, fail

__all__ = ["SCALE_FORMATS", "check_dense", "check_format", "check_grouped", "check_linear", "check_params",
           "check_weight_tensors"]



def check_format(k, blocksize, scale_format) -> None:
    """The format parameters (the format's own checks, ``kbit.format.spec``)."""
    check_k(k)
    check_blocksize(blocksize)
    check_scale_format(scale_format)


def check_params(k, blocksize, scale_format, N, K) -> None:
    """The format parameters of a weight ``[N, K]``."""
    check_format(k, blocksize, scale_format)
    if not (isinstance(N, int) and N >= 1):
        fail(ValueError, "N", "a positive int", N)
    if not (isinstance(K, int) and K >= 1):
        fail(ValueError, "K", "a positive int", K)


def check_weight_tensors(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, lead, device) -> None:
    """Canonical weight tensors of ``lead + [N, K]`` on ``device``."""
    Kp = math.ceil(K / blocksize) * blocksize
    check_tensor("codes", codes, (torch.int32,), (*lead, N, Kp * k // 32), device)
    sdt = torch.uint8 if scale_format == "log8" else torch.float16
    check_tensor("scales", scales, (sdt,), (*lead, N, Kp // blocksize), device)
    check_tensor("tensor_scale", tensor_scale, (torch.float32,), lead, device)
    check_tensor("codebook", codebook, (torch.float32,), (2**k,), device)
    if not codes.is_contiguous():
        fail(ValueError, "codes", "a contiguous tensor", f"strides {codes.stride()}")
    if not scales.is_contiguous():
        fail(ValueError, "scales", "a contiguous tensor", f"strides {scales.stride()}")


def check_dense(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias) -> None:
    """The arguments of a dense small-M call (``kbit.ops.gemv.gemv``, ``kbit.ops.gemv_mma.linear_small_m``)."""
    check_params(k, blocksize, scale_format, N, K)
    check_tensor("x", x, (torch.float16, torch.bfloat16))
    if x.dim() < 1 or x.shape[-1] != K:
        fail(ValueError, "x", f"last dimension K={K}", tuple(x.shape))
    check_weight_tensors(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, (), x.device)
    if bias is not None:
        check_tensor("bias", bias, (torch.float16, torch.bfloat16, torch.float32), (N,), x.device)


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


def check_linear(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias) -> int:
    """The arguments of a dense linear on canonical tensors (any x dtype: the CPU path takes float32); returns Kp."""
    if not isinstance(x, torch.Tensor):
        fail(TypeError, "x", "a torch.Tensor", type(x).__name__)
    if x.dim() < 1 or x.shape[-1] != K:
        fail(ValueError, "x", f"last dimension K={K}", tuple(x.shape))
    check_format(k, blocksize, scale_format)
    kp = math.ceil(K / blocksize) * blocksize
    want = {"codes": (codes, torch.int32, (N, kp * k // 32)),
            "scales": (scales, torch.uint8 if scale_format == "log8" else torch.float16, (N, kp // blocksize)),
            "tensor_scale": (tensor_scale, torch.float32, ()), "codebook": (codebook, torch.float32, (2**k,))}
    for name, (t, dt, shape) in want.items():
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, "a torch.Tensor", type(t).__name__)
        if t.dtype != dt:
            fail(TypeError, name, f"dtype {dt}", t.dtype)
        if tuple(t.shape) != shape:
            fail(ValueError, name, f"shape {shape}", tuple(t.shape))
        if t.device != x.device:
            fail(ValueError, name, f"device {x.device} (that of x)", t.device)
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        fail(ValueError, "bias", f"shape ({N},) on {x.device}", f"{tuple(bias.shape)} on {bias.device}")
    return kp

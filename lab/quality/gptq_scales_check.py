"""GPTQ block-scale rule on a synthetic correlated batch (docs/quality.md): output error
``||X (W - W_hat)^T||^2 / ||X W^T||^2`` of RTN and of GPTQ with scales from updated / original weights and act-order.

    PYTHONPATH=src python lab/quality/gptq_scales_check.py
"""

import torch

import kbit
from kbit.calibrate import gptq_quantize
from kbit.format.reference import dequantize_reference

torch.manual_seed(0)
N, K = 256, 576
A = torch.randn(K, K) / K ** 0.5
X = torch.randn(4096, K) @ (A + torch.eye(K))
X[:, :8] *= 10
W = torch.randn(N, K)
H = X.T @ X


def err(W_hat):
    return float(((X.double() @ (W.double() - W_hat.double()).T) ** 2).sum() / ((X.double() @ W.double().T) ** 2).sum())


for k in (2, 3, 4, 5):
    out = {"rtn": err(dequantize_reference(kbit.quantize(W, k=k)))}
    for scales in ("updated", "original"):
        out[scales] = err(dequantize_reference(gptq_quantize(W, H, k=k, scales=scales)))
    out["act_order"] = err(dequantize_reference(gptq_quantize(W, H, k=k, scales="original", act_order=True)))
    print(k, {n: round(v, 6) for n, v in out.items()})

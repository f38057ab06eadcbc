"""A seeded randomized Hadamard rotation along K (plain torch): ``R = diag(signs) @ blockdiag(H_b, ..., H_b)``.

Rotating both sides of a linear layer leaves it unchanged, ``(x R)(W R)^T = x R R^T W^T = x W^T`` (R is
orthogonal), while ``W R`` spreads every outlier of a row over a block of ``b`` weights: the rotated weights are
near-Gaussian, which is what kbit's MSE-fitted codebooks are made for (QuIP#, QuaRot, HIGGS).

``H_b`` is the Sylvester Walsh-Hadamard matrix of order ``b`` scaled by ``1/sqrt(b)``, where ``b`` is the largest
power of two dividing K (capped by ``max_block``): K = 576 rotates in blocks of 64, 1536 in blocks of 512, a
power of two in one block. An odd K gets ``b = 1`` (random signs only, no mixing). The random signs come from
``torch.Generator().manual_seed(seed)``, so one integer stores the rotation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kbit.utils.checks import check_int, fail


@functools.cache
def _hadamard_cpu(b: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / (b ** 0.5)


def hadamard(b: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix ``[b, b]`` (symmetric), ``b`` a power of two."""
    check_int("b", b, minimum=1)
    if b & (b - 1):
        fail(ValueError, "b", "a power of two", b)
    return _hadamard_cpu(b).to(device=device, dtype=dtype)


def hadamard_block(K: int, max_block: int | None = None) -> int:
    """The largest power of two dividing ``K``, at most ``max_block``."""
    check_int("K", K, minimum=1)
    b = K & -K
    if max_block is not None:
        check_int("max_block", max_block, minimum=1)
        while b > max_block:
            b //= 2
    return b


@dataclass(frozen=True)
class RandomHadamard:
    """The rotation ``R [K, K]`` of one input width: ``rotate(x) = x @ R``, ``unrotate(y) = y @ R^T``.

    Apply ``rotate`` to a weight ``W [N, K]`` offline and to the layer's input ``x [..., K]`` online.
    """

    K: int
    seed: int = 0
    block: int = 0  # 0: hadamard_block(K)

    def __post_init__(self):
        check_int("K", self.K, minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_int("block", self.block, minimum=0)
        if self.block == 0:
            object.__setattr__(self, "block", hadamard_block(self.K))
        elif self.K % self.block or self.block & (self.block - 1):
            fail(ValueError, "block", f"a power of two dividing K={self.K}", self.block)

    def signs(self, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        s = torch.randint(0, 2, (self.K,), generator=g, dtype=torch.int64) * 2 - 1
        return s.to(device=device, dtype=dtype)

    def matrix(self, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
        """``R [K, K]`` itself (the reference the fast forms are tested against)."""
        h = hadamard(self.block, torch.float64)
        R = self.signs(torch.float64)[:, None] * torch.block_diag(*([h] * (self.K // self.block)))
        return R.to(device=device, dtype=dtype)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ R`` along the last dimension (``x [..., K]``; computed in x's dtype)."""
        self._check(x)
        s = self.signs(x.dtype, x.device)
        h = hadamard(self.block, x.dtype, x.device)
        xb = (x * s).reshape(*x.shape[:-1], self.K // self.block, self.block)
        return (xb @ h).reshape(x.shape)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """``y @ R^T`` along the last dimension: the inverse of :meth:`rotate`."""
        self._check(y)
        s = self.signs(y.dtype, y.device)
        h = hadamard(self.block, y.dtype, y.device)
        yb = y.reshape(*y.shape[:-1], self.K // self.block, self.block) @ h.T
        return yb.reshape(y.shape) * s

    def rotate_hessian(self, H: torch.Tensor) -> torch.Tensor:
        """``R^T H R``: the Hessian of the rotated inputs ``x R`` from that of ``x``."""
        return self.rotate(self.rotate(H).transpose(-1, -2))

    def _check(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            fail(TypeError, "x", "a floating-point torch.Tensor", getattr(x, "dtype", type(x).__name__))
        if x.shape[-1] != self.K:
            fail(ValueError, "x", f"last dimension K={self.K}", tuple(x.shape))

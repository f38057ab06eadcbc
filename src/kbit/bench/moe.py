"""Routing for the grouped (MoE) benchmarks, and the bf16 baseline on it.

A decoding step of an MoE layer multiplies each (token, slot) pair's activation row by its expert. The
benchmark times that grouped product alone, on rows already sorted by expert (the gather and the
weighted sum of the experts' outputs are outside it, the same for every kernel). Only the experts that the
routing touches are read, so bytes count only those.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoeShape:
    """One expert projection: ``E`` matrices [N, K]; each token picks ``topk`` of them."""

    name: str
    E: int
    N: int
    K: int
    topk: int


# Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, expert intermediate 768 (gate and up fused: N = 1536)
QWEN3_30B_A3B = (MoeShape("qwen3-30b-a3b.gate_up", 128, 1536, 2048, 8),
                 MoeShape("qwen3-30b-a3b.down", 128, 2048, 768, 8))
MOE_PRESETS = {"qwen3-30b-a3b": QWEN3_30B_A3B}


@dataclass(frozen=True)
class Routing:
    """The (token, slot) pairs of one step, sorted by expert.

    expert_ids: int32 [P], P = tokens * topk, ascending: the expert of each row of the sorted activations.
    token_ids: int32 [P]: the token each row came from.
    offsets: int32 [E]: end row of each expert's group (``torch._grouped_mm``'s ``offs``; empty groups
        repeat the previous end).
    touched: the distinct experts, ascending.
    """

    expert_ids: torch.Tensor
    token_ids: torch.Tensor
    offsets: torch.Tensor
    touched: tuple[int, ...]
    tokens: int
    topk: int
    E: int


def make_routing(tokens: int, topk: int, E: int, seed: int = 0,
                 device: str | torch.device = "cpu") -> Routing:
    """Each token picks ``topk`` distinct experts uniformly at random (seeded)."""
    if not 1 <= topk <= E:
        raise ValueError(f"topk must be in [1, E={E}], got {topk}")
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    g = torch.Generator().manual_seed(seed)
    choice = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(tokens)])  # [T, topk]
    flat = choice.flatten()
    order = torch.argsort(flat, stable=True)
    expert_ids = flat[order].to(torch.int32)
    token_ids = (order // topk).to(torch.int32)
    offsets = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    touched = tuple(int(e) for e in torch.unique(flat))
    dev = torch.device(device)
    return Routing(expert_ids.to(dev), token_ids.to(dev), offsets.to(dev), touched, tokens, topk, E)


def groups(routing: Routing) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each touched expert, in row order."""
    ends = routing.offsets.tolist()
    out = []
    for e in routing.touched:
        start = ends[e - 1] if e > 0 else 0
        out.append((e, start, ends[e]))
    return out


def reference(a: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
    """float32 [P, N]: row p of ``a`` times ``w[expert_ids[p]].T`` (``w``: [E, N, K])."""
    out = torch.empty(a.shape[0], w.shape[1], dtype=torch.float32, device=a.device)
    for e, s, t in groups(routing):
        out[s:t] = a[s:t].float() @ w[e].float().t()
    return out


def bf16_grouped(w: torch.Tensor, routing: Routing) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """The bf16 baseline on one weight stack ``w`` [E, N, K]: ``torch._grouped_mm`` when present, else a
    loop of ``mm`` over the touched experts. Returns (call on sorted rows [P, K] -> [P, N], its name)."""
    if hasattr(torch, "_grouped_mm"):
        wt = w.transpose(-2, -1)  # [E, K, N], each matrix column-major, as _grouped_mm wants
        offs = routing.offsets
        return (lambda a: torch._grouped_mm(a, wt, offs=offs)), "bf16-grouped_mm"
    return bf16_loop(w, routing), "bf16-loop_mm"


def bf16_loop(w: torch.Tensor, routing: Routing) -> Callable[[torch.Tensor], torch.Tensor]:
    """A loop of ``mm`` over the touched experts (the fallback when ``_grouped_mm`` fails)."""
    parts = groups(routing)
    return lambda a: torch.cat([a[s:t] @ w[e].t() for e, s, t in parts])

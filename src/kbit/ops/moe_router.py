"""Expert selection of an MoE layer: router logits ``[T, E]`` -> top-k experts and their weights per token.

Two routers, both plain torch ops that never read device values on the host (graph-capturable):

- ``"softmax"`` (Mixtral, Qwen2/3-MoE, Qwen3-Next): ``p = softmax(logits in float32)``, the top-k of ``p``
  by ``torch.topk`` (so ties are broken exactly as Hugging Face's blocks break them), weights ``p`` of the
  chosen experts, divided by their sum when ``renormalize`` (Mixtral always; Qwen3-MoE ``norm_topk_prob``).
- ``"sigmoid"`` (DeepSeek-V3 style): ``s = sigmoid(logits)``; experts chosen on ``s + correction_bias``,
  optionally only inside the ``topk_group`` best of ``n_group`` expert groups (a group scores the sum of
  its two best); weights ``s`` of the chosen experts (without the bias), renormalised when asked, times
  ``scaling``.

:func:`select_experts` is the op (torch, any options); :func:`route_pairs` the same choice in one Triton launch
(no group limit) that also writes the grouped GEMV's row lists; :func:`select_experts_reference` is a
per-token loop, the oracle of both.
"""

from __future__ import annotations

import torch

from kbit.kernels.moe import route_topk_kernel, router_route_kernel
from kbit.ops._checks import check_norm
from kbit.ops.pdl import launch_kw
from kbit.tuning.moe import FusedRouterConfig, fused_router_config

__all__ = ["ROUTERS", "fusable", "localize_pairs", "route_pairs", "route_pairs_hidden", "select_experts",
           "select_experts_reference"]

ROUTERS = ("softmax", "sigmoid")


def _check(router_logits, top_k, router, n_group, topk_group):
    if not isinstance(router_logits, torch.Tensor) or not router_logits.is_floating_point():
        got = router_logits.dtype if isinstance(router_logits, torch.Tensor) else type(router_logits).__name__
        raise TypeError(f"router_logits: expected a floating-point tensor, got {got}")
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits: expected shape [T, E], got {tuple(router_logits.shape)}")
    E = router_logits.shape[1]
    if not (isinstance(top_k, int) and 1 <= top_k <= E):
        raise ValueError(f"top_k: expected an int in [1, E={E}], got {top_k}")
    if router not in ROUTERS:
        raise ValueError(f"router: expected one of {ROUTERS}, got {router!r}")
    if n_group < 1 or E % n_group:
        raise ValueError(f"n_group: expected a divisor of E={E}, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group: expected an int in [1, n_group={n_group}], got {topk_group}")
    if n_group > 1 and topk_group * (E // n_group) < top_k:
        raise ValueError(f"topk_group: {topk_group} groups of {E // n_group} experts cannot hold top_k={top_k}")


def select_experts(router_logits: torch.Tensor, top_k: int, *, router: str = "softmax", renormalize: bool = True,
                   correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                   scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` experts of each token and their weights.

    Parameters
    ----------
    router_logits : float ``[T, E]`` (any float dtype; math in float32).
    top_k : experts per token.
    router : ``"softmax"`` or ``"sigmoid"`` (module docstring).
    renormalize : divide the chosen weights by their sum.
    correction_bias : float ``[E]`` added to the sigmoid scores for the choice only (``"sigmoid"``).
    n_group, topk_group : group-limited choice (``"sigmoid"``; 1 and 1 = no groups).
    scaling : factor on the final weights (DeepSeek's ``routed_scaling_factor``).

    Returns
    -------
    (weights float32 ``[T, top_k]``, expert ids int32 ``[T, top_k]``), slots in ``torch.topk``'s order
    (descending score).

    Example
    -------
    >>> w, ids = select_experts(torch.randn(5, 8), 2)
    >>> w.shape, ids.dtype
    (torch.Size([5, 2]), torch.int32)
    """
    _check(router_logits, top_k, router, n_group, topk_group)
    logits = router_logits.float()
    if router == "softmax":
        if correction_bias is not None or n_group != 1:
            raise ValueError("correction_bias and n_group apply to router='sigmoid' only")
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, n_group, E // n_group)
            group_score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)  # [T, n_group]
            keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(topk_group, dim=-1).indices, 1.0)
            choice = grouped.masked_fill(keep[..., None] == 0, float("-inf")).view(T, E)
        ids = torch.topk(choice, top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if renormalize:
        # the sigmoid weights can all be tiny; the softmax ones cannot (the top one is >= 1/E)
        denom = weights.sum(-1, keepdim=True)
        weights = weights / (denom + 1e-20 if router == "sigmoid" else denom)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, ids.to(torch.int32)


def fusable(router: str, n_group: int = 1) -> bool:
    """Whether :func:`route_pairs` covers this router (all but the group-limited sigmoid choice)."""
    return router in ROUTERS and n_group == 1


def _route_outputs(T: int, top_k: int, dev) -> tuple[torch.Tensor, ...]:
    """The routing launches' outputs: weights float32 ``[T, top_k]``, ids, token_ids and row_ids int32."""
    token_ids = torch.empty(T * top_k, dtype=torch.int32, device=dev)
    return (torch.empty(T, top_k, dtype=torch.float32, device=dev),
            torch.empty(T, top_k, dtype=torch.int32, device=dev), token_ids, torch.empty_like(token_ids))


def route_pairs(router_logits: torch.Tensor, top_k: int, *, router: str = "softmax", renormalize: bool = True,
                correction_bias: torch.Tensor | None = None, scaling: float = 1.0,
                experts: tuple[int, int] | None = None, blocks: tuple[torch.Tensor, torch.Tensor] | None = None):
    """:func:`select_experts` (``n_group = 1``) in one Triton launch, plus the pair lists of the grouped GEMV.

    Same choice and weights (float32 math; ties to the lower expert index), one program per token, so that a
    decode step routes in one launch instead of the ~6 of the torch ops plus ~30 of the sort.

    Parameters
    ----------
    router_logits : float ``[T, E]`` (any float dtype, unit stride along E).
    top_k, router, renormalize, correction_bias, scaling : as :func:`select_experts`.
    experts : ``(start, stop)``: this rank holds experts ``start:stop`` only (expert parallel). The same choice
        and weights over all ``E``, written as this rank's pairs (:func:`localize_pairs`, in the same launch):
        ids relative to ``start``, another rank's pairs weighted 0 and sent to a local expert of their token, so
        that each token's local experts form runs of equal ids. None: all experts.
    blocks : ``(blk int32 [P + 1], nblk int32 [1])`` on the logits' device, one token only (T = 1): filled in the
        same launch with the grouped GEMM's block table of the pairs in router order
        (``kbit.ops.moe_blocks.block_table`` of ``ids`` with 8-row blocks, valid for any of the kernel's
        ``8 * ng``; ``kbit.ops.moe_align.pair_order(..., blocks=)`` carries it), so the step skips the table
        launch.

    Returns
    -------
    (weights float32 ``[T, top_k]``, expert ids int32 ``[T, top_k]``, token_ids int32 ``[P]`` (``p // top_k``),
    row_ids int32 ``[P]`` (``arange(P)``)), ``P = T * top_k``, pair ``p = t * top_k + s``.

    Example
    -------
    >>> w, ids, tok, rows = route_pairs(torch.randn(3, 8), 2)  # doctest: +SKIP
    >>> tok.tolist(), rows.tolist()  # doctest: +SKIP
    ([0, 0, 1, 1, 2, 2], [0, 1, 2, 3, 4, 5])
    """
    _check(router_logits, top_k, router, 1, 1)
    T, E = router_logits.shape
    _check_routing(T, E, top_k, router, correction_bias, experts, blocks, router_logits.device)
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    dev = router_logits.device
    out = _route_outputs(T, top_k, dev)
    if T == 0:
        return out
    args, kw = _routing_args(E, top_k, router, renormalize, correction_bias, scaling, experts, blocks, out)
    route_topk_kernel[(T,)](router_logits, *args[:7], E, router_logits.stride(0), *args[7:], **kw, **launch_kw(dev),
                            num_warps=1 if kw["BLOCK_E"] <= 256 else 4)
    return out


def route_pairs_hidden(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, *, counters: torch.Tensor,
                       router: str = "softmax", renormalize: bool = True,
                       correction_bias: torch.Tensor | None = None, scaling: float = 1.0,
                       experts: tuple[int, int] | None = None,
                       blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
                       config: FusedRouterConfig | None = None,
                       norm: tuple[torch.Tensor, torch.Tensor, float] | None = None):
    """:func:`route_pairs` of ``F.linear(hidden, router_weight)``, the router's matrix product in the same launch
    (``kbit.kernels.moe.router_route_kernel``): a decode step's routing in one launch instead of two.

    ``hidden [T, H]`` and ``router_weight [E, H]``: fp16 / bf16 of one dtype; the logits are float32 sums rounded
    to that dtype (``F.linear``'s result, up to the order of the sums). ``counters``: int32 ``[>= T]`` on their
    device, all zero (the caller's workspace; the launch leaves it zero). ``config``: the programs
    (``kbit.tuning.moe.FusedRouterConfig``, ``block_h >= H``); None: ``fused_router_config(E, H)``. ``norm``:
    ``(residual [T, H], weight [H], eps)``: hidden is the layer's input before its residual add and RMSNorm,
    which the launch makes too (:func:`kbit.ops.glue.add_rms_norm`'s numbers; the router reads the normed rows).
    Other keywords: :func:`route_pairs`. Returns ``(logits [T, E], weights, ids, token_ids, row_ids)``, with
    ``norm`` followed by ``(normed [T, H], residual + hidden [T, H])``."""
    for name, v in (("hidden", hidden), ("router_weight", router_weight)):
        if not isinstance(v, torch.Tensor) or v.dtype not in (torch.float16, torch.bfloat16) or v.dim() != 2:
            got = (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__
            raise TypeError(f"{name}: expected a 2-D float16 / bfloat16 tensor, got {got}")
    T, H = hidden.shape
    E = router_weight.shape[0]
    if router_weight.dtype != hidden.dtype or router_weight.shape[1] != H or router_weight.device != hidden.device:
        raise ValueError(f"router_weight: expected [E, {H}] {hidden.dtype} on {hidden.device}, got "
                         f"{tuple(router_weight.shape)} {router_weight.dtype} on {router_weight.device}")
    if config is None:
        config = fused_router_config(E, H)
    elif not isinstance(config, FusedRouterConfig):
        raise TypeError(f"config: expected a FusedRouterConfig or None, got {type(config).__name__}")
    if config.block_h < H:
        raise ValueError(f"config: expected block_h >= H = {H} (a program holds whole rows), got {config}")
    if (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32 or counters.dim() != 1
            or counters.shape[0] < T or counters.device != hidden.device):
        got = (counters.dtype, tuple(counters.shape), counters.device) if isinstance(counters, torch.Tensor) \
            else type(counters).__name__
        raise ValueError(f"counters: expected int32 [>= {T}] on {hidden.device}, got {got}")
    logits = torch.empty(T, E, dtype=hidden.dtype, device=hidden.device)
    _check(logits, top_k, router, 1, 1)
    _check_routing(T, E, top_k, router, correction_bias, experts, blocks, hidden.device)
    dev = hidden.device
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    if norm is not None:
        if not (isinstance(norm, tuple) and len(norm) == 3):
            raise TypeError(f"norm: expected (residual, weight, eps) or None, got {type(norm).__name__}")
        residual, nw, eps = norm
        check_norm(x, nw, eps, residual)
        residual = residual.contiguous()
        y, r = normed = torch.empty_like(x), torch.empty_like(x)
        nargs = (residual, nw.contiguous(), y, r, residual.stride(0), y.stride(0), r.stride(0), float(eps))
    else:
        normed, nargs = (), (x, x, x, x, 0, 0, 0, 0.0)
    out = _route_outputs(T, top_k, dev)
    if T == 0:
        return logits, *out, *normed
    args, kw = _routing_args(E, top_k, router, renormalize, correction_bias, scaling, experts, blocks, out)
    router_route_kernel[(T, -(-E // config.chunk_e))](
        x, router_weight.contiguous(), logits, counters, *args[:7], E, H, x.stride(0), *args[7:], *nargs, **kw,
        CHUNK_E=config.chunk_e, BLOCK_H=config.block_h, num_warps=config.num_warps, NORM=norm is not None,
        **launch_kw(dev))
    return logits, *out, *normed


def _check_routing(T: int, E: int, top_k: int, router: str, correction_bias, experts, blocks, device) -> None:
    """The argument checks :func:`route_pairs` and :func:`route_pairs_hidden` share (after ``_check``)."""
    if router == "softmax" and correction_bias is not None:
        raise ValueError("correction_bias applies to router='sigmoid' only")
    _expert_range(experts, E)
    if blocks is not None:
        _check_blocks(blocks, T, top_k, device)


def _routing_args(E: int, top_k: int, router: str, renormalize: bool, correction_bias, scaling: float, experts,
                  blocks, out: tuple) -> tuple[tuple, dict]:
    """The routing kernels' shared arguments: ``(bias, weights, ids, token_ids, row_ids, blk, nblk, scaling,
    start, stop)`` (each kernel puts its own sizes between ``nblk`` and ``scaling``) and the constexprs of
    ``kbit.kernels.moe._route_row``; checks the bias's shape."""
    if correction_bias is not None and tuple(correction_bias.shape) != (E,):
        raise ValueError(f"correction_bias: expected shape ({E},), got {tuple(correction_bias.shape)}")
    weights, ids = out[0], out[1]
    bias = correction_bias.contiguous() if correction_bias is not None else weights
    blk, nblk = blocks if blocks is not None else (ids, ids)
    start, stop = _expert_range(experts, E)
    kw = dict(TOP_K=top_k, SIGMOID=router == "sigmoid", HAS_BIAS=correction_bias is not None,
              RENORM=bool(renormalize), LOCAL=experts is not None, RUNS=blocks is not None,
              BLOCK_E=max(16, 1 << (E - 1).bit_length()), BLOCK_K=max(2, 1 << (top_k - 1).bit_length()))
    return (bias, *out, blk, nblk, float(scaling), start, stop), kw


def _check_blocks(blocks, T: int, top_k: int, device) -> None:
    if T != 1:
        raise ValueError(f"blocks: the block table is written for one token (T = 1), got T = {T}")
    want = ((top_k + 1,), (1,))
    ok = (isinstance(blocks, tuple) and len(blocks) == 2
          and all(isinstance(b, torch.Tensor) and b.dtype == torch.int32 and b.device == device
                  and tuple(b.shape) == w for b, w in zip(blocks, want, strict=True)))
    if not ok:
        got = tuple((b.dtype, tuple(b.shape), b.device) if isinstance(b, torch.Tensor) else type(b).__name__
                    for b in blocks) if isinstance(blocks, tuple) else type(blocks).__name__
        raise ValueError(f"blocks: expected (int32 [{top_k + 1}], int32 [1]) on {device}, got {got}")


def _expert_range(experts, E: int) -> tuple[int, int]:
    if experts is None:
        return 0, E
    ok = (isinstance(experts, tuple) and len(experts) == 2 and all(isinstance(v, int) for v in experts)
          and 0 <= experts[0] < experts[1] <= E)
    if not ok:
        raise ValueError(f"experts: expected (start, stop) with 0 <= start < stop <= E={E}, got {experts!r}")
    return experts


def localize_pairs(weights: torch.Tensor, ids: torch.Tensor, start: int, stop: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global choice ``(weights [T, top_k], ids [T, top_k])`` as the pairs of the rank holding experts
    ``start:stop``: ids relative to ``start``; a pair of another rank's expert weighted 0 and sent to the expert
    of the nearest local slot before it (else its token's first local slot, else local expert 0). Every id is
    in ``[0, stop - start)``, at decode no pair reads a weight the step does not read anyway, and a token's
    local experts form runs of equal ids, which the grouped kernels' block tables read once a run. Torch ops, no
    sync; returns int32 ids. :func:`route_pairs` with ``experts=(start, stop)`` is the same in the router's
    launch."""
    top_k = ids.shape[1]
    local = ids - start
    mine = (ids >= start) & (ids < stop)
    slot = torch.arange(top_k, device=ids.device).expand_as(ids)
    src = torch.where(mine, slot, -1).cummax(dim=1).values  # the last local slot at or before each slot
    first = mine.to(torch.int32).argmax(dim=1, keepdim=True).expand_as(ids)  # (0 where none)
    src = torch.where(src < 0, first, src)
    local = torch.where(mine.any(dim=1, keepdim=True), local.gather(1, src), 0).to(torch.int32)
    return torch.where(mine, weights, 0.0).to(weights.dtype), local


def select_experts_reference(router_logits: torch.Tensor, top_k: int, *, router: str = "softmax",
                             renormalize: bool = True, correction_bias: torch.Tensor | None = None,
                             n_group: int = 1, topk_group: int = 1,
                             scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_experts` one token at a time in float64 for the weights (the choice in float32, as the
    op makes it, so that near-ties resolve identically); ties go to the lower expert index (which is what
    ``torch.topk`` does on the CPU; on the GPU compare only where scores are distinct)."""
    _check(router_logits, top_k, router, n_group, topk_group)
    T, E = router_logits.shape
    W = torch.zeros(T, top_k, dtype=torch.float64)
    I = torch.zeros(T, top_k, dtype=torch.int32)
    for t in range(T):
        row = router_logits[t].float().cpu()
        if router == "softmax":
            score = torch.softmax(row, -1)
            choice = score.clone()
        else:
            score = torch.sigmoid(row)
            choice = score + (0 if correction_bias is None else correction_bias.float().cpu())
            if n_group > 1:
                g = choice.view(n_group, E // n_group)
                gs = [sorted(g[i].tolist(), reverse=True)[:2] for i in range(n_group)]
                gscore = [sum(v) for v in gs]
                best = sorted(range(n_group), key=lambda i: (-gscore[i], i))[:topk_group]
                mask = torch.full((E,), float("-inf"))
                for i in best:
                    mask[i * (E // n_group):(i + 1) * (E // n_group)] = 0
                choice = choice + mask
        order = sorted(range(E), key=lambda e: (-float(choice[e]), e))[:top_k]
        w = torch.tensor([float(score[e]) for e in order], dtype=torch.float64)
        if renormalize:
            w = w / w.sum()
        W[t] = w * scaling
        I[t] = torch.tensor(order, dtype=torch.int32)
    return W, I

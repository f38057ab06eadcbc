"""End-to-end tuning of a quantized model's continuous parameters, the codes fixed (format and kernels unchanged).

After calibrated rounding (:func:`kbit.calibrate.gptq_quantize`) every code of a :class:`~kbit.format.KbitWeight`
is chosen; what the format still stores as numbers is each tensor's codebook (``2**k`` float32 values) and its
block scales (log8: an integer ``q`` per block, ``scale = tensor_scale * 2**(-q / 16)``). The model keeps its
norm gains (and biases) in floating point. :func:`finetune` moves all of these to lower the KL divergence of the
quantized model's next-token distribution from the unquantized model's on calibration text: Adam over the
windows, the block scales continuous with a straight-through rounding to the log8 grid (the forward pass always
sees a scale the format can store). QuIP#, AQLM and PV-tuning get most of their 2-bit quality from such a
step; this is its cheapest form (no code changes).

:func:`teacher_targets` records the unquantized model's top log-probabilities once (``top`` per token plus the
mass left over, so Gemma's 262k vocabulary costs kilobytes, not gigabytes); :func:`sparse_kl` is the
divergence against them. :class:`TunableWeight` is the differentiable view of one weight and its export back to
an ordinary :class:`~kbit.format.KbitWeight` (same codes, same k and blocksize).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from kbit.calibrate.model import decoder_layers
from kbit.calibrate.rotation import hadamard
from kbit.format import codebooks as cbs
from kbit.format.pack import pack, unpack
from kbit.format.spec import LOG8_STEPS_PER_OCTAVE, ZERO_BLOCK, KbitWeight
from kbit.utils.checks import check_int, fail

#: log8 exponents a block may take (ZERO_BLOCK marks an all-zero block and stays one)
MAX_Q = ZERO_BLOCK - 1


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` forward, identity backward (straight-through)."""
    return x + (torch.round(x) - x).detach()


class _Lookup(torch.autograd.Function):
    """``codebook[codes]`` whose backward sums the gradient of each level in one histogram pass (``bincount``).
    Every weight hits one of only 2^k levels, where the generic index backward (a sort, then an accumulation per
    index) was nearly all of a tuning step's GPU time (benchmarks/results/h200/quality-k2-gpu-2026-11-26.md)."""

    @staticmethod
    def forward(ctx, codebook: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(codes)
        ctx.levels = codebook.numel()
        return codebook[codes]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (codes,) = ctx.saved_tensors
        g = torch.bincount(codes.reshape(-1), weights=grad.reshape(-1).float(), minlength=ctx.levels)
        return g.to(grad.dtype), None


class TunableWeight(nn.Module):
    """A 2-D log8 :class:`~kbit.format.KbitWeight` with its codebook and block scales as parameters.

    ``forward()`` returns the float32 weight ``[N, K]`` the layer applies to its *unrotated* input (a rotated
    weight is multiplied by ``R^T``), differentiable in :attr:`codebook` and :attr:`q` (the block exponents,
    continuous, rounded straight-through). :meth:`to_weight` exports the stored form.
    """

    def __init__(self, qw: KbitWeight, free_codes: bool = False):
        super().__init__()
        if not isinstance(qw, KbitWeight):
            fail(TypeError, "qw", "a kbit.format.KbitWeight", type(qw).__name__)
        if len(qw.shape) != 2 or qw.scale_format != "log8":
            fail(ValueError, "qw", "a 2-D weight with log8 scales",
                 f"shape {qw.shape}, scale_format {qw.scale_format!r}")
        self.k, self.blocksize, self.shape, self.rotation = qw.k, qw.blocksize, qw.shape, qw.rotation
        N = qw.N
        codes = unpack(qw.codes, qw.k, qw.padded_k).reshape(N, -1, qw.blocksize)
        # uint8 (k <= 8): a quarter of int32's memory for every weight of the model; widened to int32 indexes
        # inside the checkpointed forward, one weight at a time
        self.register_buffer("codes", codes.to(torch.uint8))
        self.register_buffer("zero", qw.scales == ZERO_BLOCK)
        self.register_buffer("tensor_scale", qw.tensor_scale.to(torch.float32).clone())
        self.codebook = nn.Parameter(qw.codebook.to(torch.float32).clone())
        self.q = nn.Parameter(torch.where(self.zero, 0, qw.scales.to(torch.int64)).to(torch.float32))
        # free codes: a latent value per weight in codebook units, started on its level and re-rounded to the
        # nearest level on every forward pass (straight-through), so a code changes once its value crosses a
        # midpoint
        self.latent = nn.Parameter(qw.codebook.to(torch.float32)[self.codes.long()]) if free_codes else None
        # R^T's two factors, made once and moved with the module: made on the host at every forward pass, their
        # copies to a GPU stalled every step
        if self.rotation is not None:
            K = self.shape[1]
            self.register_buffer("_h", hadamard(self.rotation.block, torch.float32, codes.device),
                                 persistent=False)
            self.register_buffer("_signs", self.rotation.signs(K, torch.float32, codes.device),
                                 persistent=False)

    def scales(self) -> torch.Tensor:
        """float32 block scales ``[N, nb]`` on the log8 grid (straight-through in :attr:`q`)."""
        q = _round_ste(self.q.clamp(0, MAX_Q))
        s = self.tensor_scale * torch.exp2(-q / LOG8_STEPS_PER_OCTAVE)
        return torch.where(self.zero, torch.zeros_like(s), s)

    def current_codes(self) -> torch.Tensor:
        """int32 codes ``[N, nb, blocksize]`` in the order of :attr:`codebook` (the latent values rounded to its
        nearest level with free codes; a codebook that lost its order is sorted for the rounding)."""
        if self.latent is None:
            return self.codes.to(torch.int32)
        cb = self.codebook.detach()
        order = torch.argsort(cb)
        c = torch.bucketize(self.latent.detach(), cbs.midpoints(cb[order]), right=False)
        return order[c].to(torch.int32)

    def forward(self, rows: slice = slice(None)) -> torch.Tensor:
        """The weight's ``rows`` (all by default: a member of a joint q/k/v weight takes its own)."""
        K = self.shape[1]
        values = _Lookup.apply(self.codebook, self.current_codes()[rows])
        if self.latent is not None:
            values = values + (self.latent[rows] - self.latent[rows].detach())
        N = values.shape[0]
        W = (values * self.scales()[rows][..., None]).reshape(N, -1)[:, :K]
        if self.rotation is not None:  # the stored weight is W R: the layer's weight is (W R) R^T
            b = self.rotation.block
            W = (W.reshape(N, K // b, b) @ self._h.T.to(W.dtype)).reshape(N, K) * self._signs.to(W.dtype)
        return W

    @torch.no_grad()
    def to_weight(self) -> KbitWeight:
        """The tuned weight in the stored format: the codebook sorted (codes renumbered to match) and divided by
        its largest magnitude (the tensor scale multiplied by it), the exponents rounded to the log8 grid."""
        cb = self.codebook.detach().to(torch.float32)
        order = torch.argsort(cb)
        rank = torch.argsort(order)
        cb = cb[order]
        if bool((cb[1:] <= cb[:-1]).any()) or not bool(torch.isfinite(cb).all()):
            fail(ValueError, "codebook", "distinct finite values after tuning", cb.tolist())
        m = cb.abs().amax()
        cb = cb / m
        ts = self.tensor_scale * m
        q = torch.round(self.q.detach().clamp(0, MAX_Q)).to(torch.uint8)
        q = torch.where(self.zero, torch.full_like(q, ZERO_BLOCK), q)
        codes = pack(rank[self.current_codes().long()].reshape(self.shape[0], -1), self.k)
        return KbitWeight(codes, q, ts, cb, self.shape, self.k, self.blocksize, "log8", "custom", self.rotation)


class _TunedLinear(nn.Module):
    """Stands in for a Linear while tuning: ``x @ W^T + bias`` with ``W`` from a :class:`TunableWeight`."""

    def __init__(self, weight: TunableWeight, bias: torch.Tensor | None, rows: slice):
        super().__init__()
        self.tunable = weight
        self.bias = bias
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the weight is made again in the backward pass instead of keeping its intermediates (the gathered levels,
        # the scaled and the rotated weight: three float32 copies of every weight of the model)
        W = torch.utils.checkpoint.checkpoint(self.tunable, self.rows, use_reentrant=False)
        return nn.functional.linear(x, W.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


@dataclass(frozen=True)
class TeacherTargets:
    """The unquantized model's top log-probabilities per calibration batch: ``logp [B, T-1, top]`` and their
    vocabulary ``index`` (int64), for predicting tokens 1..T-1 of each batch."""

    logp: tuple[torch.Tensor, ...]
    index: tuple[torch.Tensor, ...]


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.to(next(model.parameters()).device)  # token ids may come from the CPU for a model on a GPU
    return model(ids, use_cache=False).logits[:, :-1].float()


@torch.no_grad()
def teacher_targets(model: nn.Module, batches: Sequence[torch.Tensor], top: int = 128) -> TeacherTargets:
    """Record ``model``'s ``top`` largest next-token log-probabilities on each batch of token ids ``[B, T]``
    (call it on the unquantized model). ``model(ids, use_cache=False).logits`` must be ``[B, T, vocab]``."""
    check_int("top", top, minimum=1)
    if not batches:
        fail(ValueError, "batches", "at least one batch of token ids", 0)
    logp, index = [], []
    for ids in batches:
        lp = torch.log_softmax(_logits(model, ids), -1)
        v, i = lp.topk(min(top, lp.shape[-1]), dim=-1)
        logp.append(v)
        index.append(i)
    return TeacherTargets(tuple(logp), tuple(index))


def sparse_kl(logits: torch.Tensor, logp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``KL(teacher || student)``, the teacher known on ``index`` (``logp [..., top]``) and the
    rest of its mass lumped into one outcome (the student's mass outside ``index`` likewise): exact when ``top``
    is the whole vocabulary, a lower bound otherwise. ``logits [..., vocab]``."""
    lq = torch.log_softmax(logits.float(), -1)
    lq_top = lq.gather(-1, index)
    p = logp.exp()
    kl = (p * (logp - lq_top)).sum(-1)
    rest_p = (1 - p.sum(-1)).clamp_min(1e-12)
    rest_q = (1 - lq_top.exp().sum(-1)).clamp_min(1e-12)
    return (kl + rest_p * (rest_p.log() - rest_q.log())).mean()


def _norm_parameters(model: nn.Module, exclude: set[int]) -> list[nn.Parameter]:
    """1-D ``weight`` / ``bias`` parameters of normalisation modules (type name containing "Norm")."""
    out = []
    for m in model.modules():
        if "norm" in type(m).__name__.lower():
            out += [p for p in m.parameters(recurse=False) if p.dim() == 1 and id(p) not in exclude]
    return out


@dataclass(frozen=True)
class FinetuneConfig:
    """Optimiser settings of :func:`finetune` (Adam, learning rate per parameter group, cosine decay to 0).

    ``lr_q`` is in log8 steps (1/16 octave) per step, ``lr_codebook`` in codebook units (levels in [-1, 1]),
    ``lr_norm`` absolute on the norm gains; ``norms=False`` leaves the gains alone. ``lr_codes`` > 0 frees the
    codes (:class:`TunableWeight` ``free_codes``: latent values in codebook units, rounded straight-through).
    ``warmup``: the first steps ramp every learning rate up linearly (then the cosine decay over the rest)."""

    # 512: at k = 2 better than 128 on both small judges, and enough for SmolLM2 to pass issue 35's bar
    # (benchmarks/results/h200/quality-k2-gpu-2026-11-26.md)
    steps: int = 512
    # twice the first rates (0.05, 1e-3, 1e-3): better at every run length measured at k = 2, on both judges
    # (benchmarks/results/cpu/quality-k2-2026-11-26b.md)
    lr_q: float = 0.1
    lr_codebook: float = 2e-3
    lr_norm: float = 2e-3
    norms: bool = True
    lr_codes: float = 0.0
    warmup: int = 0

    def __post_init__(self):
        check_int("steps", self.steps, minimum=0)
        check_int("warmup", self.warmup, minimum=0)
        for name in ("lr_q", "lr_codebook", "lr_norm", "lr_codes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                fail(ValueError, name, "a finite float >= 0", repr(v))


def _out_features(module: nn.Module) -> int:
    n = getattr(module, "out_features", None)
    if not isinstance(n, int):
        fail(TypeError, "weights", "names of modules with out_features (nn.Linear, KbitLinear)", type(module).__name__)
    return n


def finetune(model: nn.Module, weights: Mapping[str | tuple[str, ...], KbitWeight], batches: Sequence[torch.Tensor],
             teacher: TeacherTargets, config: FinetuneConfig = FinetuneConfig(),
             log: Callable[[int, float], None] | None = None) -> dict[str | tuple[str, ...], KbitWeight]:
    """Tune ``weights`` (module name in ``model`` -> its quantized weight, codes fixed; or a tuple of names -> the
    joint weight of those modules, their rows in that order, e.g. q/k/v with one codebook) and, with
    ``config.norms``, the norm gains of ``model`` (in place) to lower :func:`sparse_kl` against ``teacher`` on
    ``batches`` (the batches ``teacher`` was recorded on, visited in turn, one per step).

    The named modules (``nn.Linear`` or :class:`kbit.nn.KbitLinear`, anything with ``bias``) are replaced by
    differentiable stand-ins while tuning and put back afterwards, unchanged. Returns the tuned weights (new
    :class:`~kbit.format.KbitWeight` objects: same codes up to the codebook's order, k, blocksize, rotation);
    ``log(step, loss)`` is called after every step.
    """
    if not isinstance(config, FinetuneConfig):
        fail(TypeError, "config", "a FinetuneConfig", type(config).__name__)
    if len(batches) != len(teacher.logp):
        fail(ValueError, "batches", f"the {len(teacher.logp)} batches the teacher was recorded on", len(batches))
    if not weights:
        fail(ValueError, "weights", "at least one module name -> KbitWeight", 0)
    members = {key: (key,) if isinstance(key, str) else tuple(key) for key in weights}
    originals = {n: model.get_submodule(n) for names in members.values() for n in names}
    tunables = {key: TunableWeight(qw, free_codes=config.lr_codes > 0) for key, qw in weights.items()}
    stand_ins = {}
    for key, names in members.items():
        start = 0
        for n in names:
            rows = _out_features(originals[n])
            stand_ins[n] = _TunedLinear(tunables[key], getattr(originals[n], "bias", None),
                                        slice(start, start + rows))
            start += rows
        if start != weights[key].N:
            fail(ValueError, f"weights[{key!r}]", f"{start} rows (the modules' outputs together)", weights[key].N)
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    norms = _norm_parameters(model, set()) if config.norms else []
    # Adam steps a float32 copy of a half-precision gain: lr_norm's 1e-3 is below bfloat16's resolution near 1
    masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True) for p in norms]
    groups = [{"params": [t.q for t in tunables.values()], "lr": config.lr_q},
              {"params": [t.codebook for t in tunables.values()], "lr": config.lr_codebook}]
    if norms:
        groups.append({"params": masters, "lr": config.lr_norm})
    if config.lr_codes > 0:
        groups.append({"params": [t.latent for t in tunables.values()], "lr": config.lr_codes})
    for p in norms:
        p.requires_grad_(True)
    opt = torch.optim.Adam(groups, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, config.steps, config.warmup))
    try:
        for n, m in stand_ins.items():
            model.set_submodule(n, m)
        _steps(model, opt, sched, batches, teacher, config.steps, log, list(zip(norms, masters, strict=True)))
    finally:
        for n, m in originals.items():
            model.set_submodule(n, m)
        for p, flag in frozen:
            p.requires_grad_(flag)
    return {n: t.to_weight() for n, t in tunables.items()}


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then a cosine decay to 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))


@torch.enable_grad()  # a caller inside torch.no_grad() (quantize_model's may be) still gets its gradients
def _steps(model, opt, sched, batches, teacher: TeacherTargets, steps: int, log, masters: list) -> None:
    """``steps`` Adam steps; ``masters``: (a model parameter, the float32 copy the optimizer steps)."""
    masters = [(p, m) for p, m in masters if m is not p]
    for step in range(steps):
        b = step % len(batches)
        loss = sparse_kl(_logits(model, batches[b]), teacher.logp[b], teacher.index[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p, m in masters:
            m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        opt.step()
        with torch.no_grad():
            for p, m in masters:
                p.copy_(m)
        sched.step()
        if log is not None:
            log(step, float(loss.detach()))


def decoder_linear_names(model: nn.Module) -> list[str]:
    """Names (in ``model``) of the ``nn.Linear`` modules inside the decoder layers: what
    :func:`kbit.calibrate.calibrate_model` quantizes."""
    prefix, layers = decoder_layers(model)
    return [f"{prefix}.{i}.{n}" for i, layer in enumerate(layers) for n, m in layer.named_modules()
            if isinstance(m, nn.Linear)]

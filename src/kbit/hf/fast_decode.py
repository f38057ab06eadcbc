"""The one-token decode step of a Llama-family model on kbit's glue kernels, for :class:`kbit.hf.StaticDecoder`.

transformers' forward spends about 14 kernels a dense decoder layer on a one-token step besides its four (fused)
projections: two RMSNorms, two rotary kernels, two KV-cache copies, the attention, two residual adds, SiLU * up
(on an H100 at Llama-3-8B shapes, about a fifth of a k = 4 step). This step walks the same modules' weights with
:mod:`kbit.ops.glue`: residual add + RMSNorm in one kernel, rotary + (Qwen3) q/k norms + KV append in one, the
split-KV attention of :mod:`kbit.ops.attention` over the valid length, SiLU * up in one; each launched with
programmatic dependent launch on sm_90, so the next k-bit GEMV starts loading its weights while it runs. The
projections and MLPs are the model's own modules (``KbitLinear``, ``nn.Linear``, ``KbitMoE``, or the benchmark's
fused parts), so bf16 and k-bit models take the same path.

Rotated layers (issue 35): a projection quantized under a rotation (``lin.rotation``, a :class:`kbit.format.Rotation`;
``lin.forward_rotated(x R)`` the layer without its own transform) gets ``x R`` from the kernel that produces x: the
residual add + RMSNorm kernel for q/k/v and gate/up (each group shares one rotation), SiLU * up for down_proj,
the final norm for a rotated lm_head; o_proj's input comes from the attention, so there ``kbit.ops.hadamard.rotate``
runs on its own. Projections whose group members differ in rotation run their own ``forward`` (it rotates).
Unrotated models take the path they always took (kbit.dispatch.prologue's fused GEMV glue included).

Supported: ``model_type`` in :data:`MODEL_TYPES` (dense or MoE MLPs), no sliding window within the cache length,
head dims a power of two; :func:`unsupported_reason` says why not otherwise (the decoder then uses transformers'
forward).
"""
from __future__ import annotations

import torch
from torch import nn

from kbit.dispatch.prologue import add_rms_norm_linear
from kbit.nn import KbitLinear
from kbit.ops import attention as A
from kbit.ops.glue import add_rms_norm, rms_norm, rope_append, silu_mul
from kbit.ops.hadamard import rotate, rotation_signs
from kbit.ops.mma.common import kernels_available
from kbit.ops.mma.layout import LAYOUT as MMA_LAYOUT
from kbit.ops.moe import Uncombined, combine_add_rms_norm
from kbit.parallel.linear import ColumnParallelKbitLinear
from kbit.utils.checks import fail
from kbit.utils.device import interpreting

__all__ = ["MODEL_TYPES", "FastDecodeStep", "attention_windows", "fuse_group", "local_linear", "text_config",
           "unsupported_reason"]

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def text_config(model):
    """The model's (text) decoder config."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_windows(model) -> int | dict[str, int | None] | None:
    """The sliding windows the decoder's masks apply: a dict ``{layer type: window or None}`` for a model whose
    config lists ``layer_types`` (transformers then takes one mask per type), else the window of every layer
    (``sliding_window``: transformers' models without ``layer_types`` choose their mask by it alone, whatever
    ``use_sliding_window`` says) or None. ValueError for layer types other than full and sliding attention
    (chunked, linear: no static cache of this kind holds them)."""
    text = text_config(model)
    window = getattr(text, "sliding_window", None) or None
    types = getattr(text, "layer_types", None)
    if not types:
        return window
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        fail(ValueError, "model", "layers of full or sliding-window attention (layer_types)", f"layer types {other}")
    if "sliding_attention" in types and window is None:
        fail(ValueError, "model", "config.sliding_window for its sliding_attention layers", "None")
    return {t: window if t == "sliding_attention" else None for t in dict.fromkeys(types)}


def unsupported_reason(model: nn.Module, max_len: int) -> str | None:
    """``None`` when :class:`FastDecodeStep` runs ``model`` with a cache of ``max_len`` positions, else why not."""
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in MODEL_TYPES:
        return f"model_type {mt!r} not in {MODEL_TYPES}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "embed_tokens"):
        return "no model.model.layers / rotary_emb / embed_tokens"
    if not hasattr(model, "lm_head") or not hasattr(inner, "norm"):
        return "no lm_head / final norm"
    try:
        windows = attention_windows(model)
    except ValueError as e:  # layer types the static cache does not hold
        return str(e)
    windows = list(windows.values()) if isinstance(windows, dict) else [windows]
    if any(w is not None and max_len > w for w in windows):
        return f"sliding window {min(w for w in windows if w is not None)} < cache length {max_len}"
    for i, layer in enumerate(layers):
        att = getattr(layer, "self_attn", None)
        if att is None or not all(hasattr(att, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
            return f"layer {i}: no self_attn with q/k/v/o projections"
        if getattr(att, "sliding_window", None) is not None and max_len > att.sliding_window:
            return f"layer {i}: sliding window"
        d = att.head_dim
        if d < 2 or d & (d - 1):
            return f"head dim {d} is not a power of two"
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name, None)
            if norm is None or not hasattr(norm, "weight") or not hasattr(norm, "variance_epsilon"):
                return f"layer {i}: {name} is not an RMSNorm"
        if (hasattr(att, "q_norm") or hasattr(att, "k_norm")) and mt not in ("qwen3", "qwen3_moe"):
            return f"layer {i}: q/k norms outside Qwen3"
        if getattr(layer, "mlp", None) is None:
            return f"layer {i}: no mlp"
    return None


def local_linear(m: nn.Module) -> KbitLinear | None:
    """The ``KbitLinear`` that computes ``m``'s output on this rank: ``m`` itself, or the shard of a column-parallel
    layer whose output stays split (``gather_output=False``, unpacked: this rank's heads or intermediate columns,
    which its own attention or row-parallel projection reads); None for anything else."""
    if type(m) is KbitLinear:
        return m
    if isinstance(m, ColumnParallelKbitLinear) and not m.gather_output and m.parts is None and \
            type(m.shard) is KbitLinear:
        return m.shard
    return None


def fuse_group(mods) -> tuple[nn.Module, list[int]] | None:
    """One KbitLinear computing ``mods``' outputs side by side (``None`` unless they can be fused).

    The members must be :class:`~kbit.nn.KbitLinear` of one format, input size, tensor scale, codebook and rotation
    (what ``quantize_model(joint=True)`` gives q/k/v and gate/up), on one device, with row counts that are multiples
    of 16; or column-parallel layers (:func:`local_linear`) over such shards, under tensor parallelism: their shards
    are fused, so a rank runs one GEMV for its slices of q/k/v (of gate/up) as one GPU runs one for the whole.
    The fused layer carries the members' rotation (its ``forward_rotated`` is the GEMV on ``x R``).
    Their codes and scales are concatenated (repacked for the small-M kernel first where it runs) and the members
    are re-pointed at row views of the result, so the model keeps working unchanged and no memory is added.
    Returns ``(fused, [rows of each member])``."""
    mods = [local_linear(m) for m in mods]
    if len(mods) < 2 or any(m is None for m in mods):
        return None
    m0 = mods[0]
    attrs = ("in_features", "k", "blocksize", "scale_format", "dtype", "codebook_name")
    for m in mods:
        if any(getattr(m, a) != getattr(m0, a) for a in attrs) or (m.bias is None) != (m0.bias is None) or \
                m.out_features % 16 or m.codes.device != m0.codes.device or \
                getattr(m, "rotation", None) != getattr(m0, "rotation", None):
            return None
        if not (torch.equal(m.tensor_scale, m0.tensor_scale) and torch.equal(m.codebook, m0.codebook)):
            return None
    if kernels_available(m0.codes.device):
        for m in mods:
            m.repack_for_kernels()
    if len({m.layout for m in mods}) != 1:
        return None
    rows = [m.out_features for m in mods]
    codes = torch.cat([m.codes for m in mods])
    scales = torch.cat([m.scales for m in mods])
    fused = KbitLinear(m0.in_features, sum(rows), m0.bias is not None, k=m0.k, blocksize=m0.blocksize,
                       scale_format=m0.scale_format, dtype=m0.dtype, device="meta", codebook_name=m0.codebook_name,
                       rotation=getattr(m0, "rotation", None))
    fused.codes, fused.scales, fused.tensor_scale, fused.codebook = codes, scales, m0.tensor_scale, m0.codebook
    if m0.bias is not None:
        fused.bias = torch.cat([m.bias for m in mods])
    fused.layout = m0.layout
    fused.auto_repack = False  # the members view its buffers: a repack would copy them
    per = 16 if m0.layout == MMA_LAYOUT else 1  # layout "mma-v1" is tile-major (16 rows a tile)
    lo = 0
    for m, n in zip(mods, rows, strict=True):
        m.codes, m.scales = codes[lo // per:(lo + n) // per], scales[lo // per:(lo + n) // per]
        lo += n
    return fused, rows


def shared_rotation(mods, device) -> tuple | None:
    """``(rotation, signs)`` when every module of ``mods`` carries the same rotation (``signs`` its int8 signs on
    ``device``, made now so that a CUDA graph may capture the step), else None: no rotation, or differing ones
    (each member's own forward then rotates its input)."""
    rots = {getattr(m, "rotation", None) for m in mods}
    if len(rots) != 1 or None in rots:
        return None
    rot = rots.pop()
    return rot, rotation_signs(rot, mods[0].in_features, device)


def _proj(lin, y, rot):
    """``lin`` on the norm's output: ``y`` is ``x R`` where ``rot`` is given."""
    return lin.forward_rotated(y) if rot is not None else lin(y)


def _dense_mlp(mlp) -> bool:
    act = getattr(mlp, "act_fn", None)
    return all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")) and \
        type(act).__name__ in ("SiLU", "SiLUActivation")


class FastDecodeStep:
    """``step(ids [B, 1], pos [1]) -> logits [B, V]`` (float32) for ``model`` over the static ``cache`` of a
    :class:`~kbit.hf.StaticDecoder`; k and v of the step are written into the cache at ``pos``.

    The rotary tables are computed once for ``max_len`` positions by the model's own ``rotary_emb`` (the same
    values transformers computes at every step, any rope scaling included)."""

    def __init__(self, model: nn.Module, cache, max_len: int):
        why = unsupported_reason(model, max_len)
        if why is not None:
            raise ValueError(f"model: the fast decode step does not support it ({why})")
        self.model, self.cache = model, cache
        inner = model.model
        self.layers = list(inner.layers)
        dtype = inner.embed_tokens.weight.dtype
        dev = inner.embed_tokens.weight.device
        pos = torch.arange(max_len, device=dev).view(1, -1)
        probe = torch.zeros(1, max_len, 1, dtype=dtype, device=dev)
        with torch.no_grad():
            cos, sin = inner.rotary_emb(probe, pos)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        att = self.layers[0].self_attn
        self.D = att.head_dim
        self.qk_norm = hasattr(att, "q_norm")
        self.dense = [_dense_mlp(layer.mlp) for layer in self.layers]
        # q/k/v and gate/up quantized together (quantize_model(joint=True)): one GEMV each
        self.qkv = [fuse_group([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                    for layer in self.layers]
        self.gate_up = [fuse_group([layer.mlp.gate_proj, layer.mlp.up_proj]) if dense else None
                        for layer, dense in zip(self.layers, self.dense, strict=True)]
        # rotations shared by the inputs of q/k/v, o_proj, gate/up, down_proj: ((rotation, signs) or None) a layer
        self.rot_qkv = [shared_rotation([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                                        dev) for layer in self.layers]
        self.rot_o = [shared_rotation([layer.self_attn.o_proj], dev) for layer in self.layers]
        self.rot_gate_up = [shared_rotation([layer.mlp.gate_proj, layer.mlp.up_proj], dev) if dense else None
                            for layer, dense in zip(self.layers, self.dense, strict=True)]
        self.rot_down = [shared_rotation([layer.mlp.down_proj], dev) if dense else None
                         for layer, dense in zip(self.layers, self.dense, strict=True)]
        self.rot_head = shared_rotation([model.lm_head], dev) if hasattr(model.lm_head, "in_features") else None
        self.counters = None  # the attention's arrival counters (all zero between calls; see decode_attention)

    def _attend(self, q, kc, vc, length, scale, pos):
        B, Hkv = kc.shape[:2]
        qg = q.view(B, Hkv, -1, self.D)
        if (q.is_cuda or interpreting()) and A.supports(qg, kc, vc):
            if self.counters is None or self.counters.numel() < B * Hkv or self.counters.device != q.device:
                self.counters = torch.zeros(B * Hkv, dtype=torch.int32, device=q.device)
            # keys before pos are earlier steps' (settled): loaded before the PDL wait; one launch (counters)
            return A.decode_attention(qg, kc, vc, length=length, scale=scale, new_from=pos, counters=self.counters)
        return A.decode_attention_reference(qg, kc, vc, length=length, scale=scale, out_dtype=q.dtype)

    def _mlp(self, i, x, res):
        """The residual add + post-attention RMSNorm and the MLP: returns ``(mlp output, new residual)``. A fused
        gate/up GEMV computes the add + norm in its x prologue and SiLU * up in its epilogue
        (kbit.dispatch.prologue)."""
        layer = self.layers[i]
        mlp, n = layer.mlp, layer.post_attention_layernorm
        if self.rot_gate_up[i] is not None or self.rot_down[i] is not None:
            return self._mlp_rotated(i, x, res)
        if self.dense[i] and self.gate_up[i] is not None:
            fused, (ng, nu) = self.gate_up[i]
            if ng == nu:
                act, res = add_rms_norm_linear(x, res, n.weight, n.variance_epsilon, fused, silu_mul=True)
                return mlp.down_proj(act), res
            gu, res = add_rms_norm_linear(x, res, n.weight, n.variance_epsilon, fused)
            return mlp.down_proj(silu_mul(gu[:, :ng], gu[:, ng:])), res
        if not self.dense[i] and hasattr(mlp, "forward_add_norm"):  # KbitMoE: the add + norm in its router's launch
            # and its combine left to the next norm (combine_add_rms_norm), where it can
            return mlp.forward_add_norm(x, res, n.weight, n.variance_epsilon, defer_combine=True)
        y, res = add_rms_norm(x, res, n.weight, n.variance_epsilon)
        if not self.dense[i]:
            out = mlp(y.unsqueeze(1))
            out = out[0] if isinstance(out, tuple) else out
            return out.reshape(y.shape[0], -1), res
        return mlp.down_proj(silu_mul(mlp.gate_proj(y), mlp.up_proj(y))), res

    def _mlp_rotated(self, i, x, res):
        """:meth:`_mlp` of a dense MLP with a rotated input: the norm kernel makes ``y R`` for gate/up, SiLU * up
        makes ``a R'`` for down_proj (kernel 3's SiLU epilogue does not rotate)."""
        layer = self.layers[i]
        mlp, n = layer.mlp, layer.post_attention_layernorm
        rgu, rd = self.rot_gate_up[i], self.rot_down[i]
        if rgu is None and self.gate_up[i] is not None:  # unrotated gate/up: the fused prologue where it runs
            fused, (ng, _) = self.gate_up[i]
            gu, res = add_rms_norm_linear(x, res, n.weight, n.variance_epsilon, fused)
            g, u = gu[:, :ng], gu[:, ng:]
        else:
            y, res = add_rms_norm(x, res, n.weight, n.variance_epsilon, *(rgu or ()))
            if self.gate_up[i] is not None:
                fused, (ng, _) = self.gate_up[i]
                gu = _proj(fused, y, rgu)
                g, u = gu[:, :ng], gu[:, ng:]
            else:
                g, u = _proj(mlp.gate_proj, y, rgu), _proj(mlp.up_proj, y, rgu)
        return _proj(mlp.down_proj, silu_mul(g, u, *(rd or ())), rd), res

    def _qkv(self, i, x, res):
        """The residual add + input RMSNorm and q/k/v: returns ``(q, k, v, new residual)``."""
        n, att = self.layers[i].input_layernorm, self.layers[i].self_attn
        rot = self.rot_qkv[i]
        if isinstance(x, Uncombined):  # the MoE layer before left its combine to this norm
            if rot is None and res is not None:
                y, res = combine_add_rms_norm(x, res, n.weight, n.variance_epsilon)
                if self.qkv[i] is None:
                    return att.q_proj(y), att.k_proj(y), att.v_proj(y), res
                fused, (nq, nk, _) = self.qkv[i]
                qkv = fused(y)
                return qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:], res
            x = x.combine()
        if rot is not None:  # y R from the norm kernel
            if res is None:
                y, res = rms_norm(x, n.weight, n.variance_epsilon, *rot), x
            else:
                y, res = add_rms_norm(x, res, n.weight, n.variance_epsilon, *rot)
            if self.qkv[i] is None:
                return (*(m.forward_rotated(y) for m in (att.q_proj, att.k_proj, att.v_proj)), res)
            fused, (nq, nk, _) = self.qkv[i]
            qkv = fused.forward_rotated(y)
        elif self.qkv[i] is not None:  # the add + norm in the fused q/k/v GEMV's x prologue where it runs
            fused, (nq, nk, _) = self.qkv[i]
            if res is None:
                res = x
                qkv = fused(rms_norm(x, n.weight, n.variance_epsilon))
            else:
                qkv, res = add_rms_norm_linear(x, res, n.weight, n.variance_epsilon, fused)
        else:
            if res is None:
                y, res = rms_norm(x, n.weight, n.variance_epsilon), x
            else:
                y, res = add_rms_norm(x, res, n.weight, n.variance_epsilon)
            return att.q_proj(y), att.k_proj(y), att.v_proj(y), res
        return qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:], res

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        B = ids.shape[0]
        x = inner.embed_tokens(ids).reshape(B, -1)
        length = pos + 1
        res = None
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            q, k, v, res = self._qkv(i, x, res)
            kc, vc = self.cache.layers[i].keys, self.cache.layers[i].values
            # pos is this step's input, written before the step's first launch: read before the PDL wait
            if self.qk_norm:
                qr = rope_append(q, k, v, self.cos, self.sin, pos, kc, vc, att.q_norm.weight, att.k_norm.weight,
                                 att.q_norm.variance_epsilon, pos_settled=True)
            else:
                qr = rope_append(q, k, v, self.cos, self.sin, pos, kc, vc, pos_settled=True)
            o = self._attend(qr, kc, vc, length, att.scaling, pos).reshape(B, -1)
            ro = self.rot_o[i]
            x = att.o_proj(o) if ro is None else att.o_proj.forward_rotated(rotate(o, *ro))
            x, res = self._mlp(i, x, res)
        n = inner.norm
        if isinstance(x, Uncombined) and self.rot_head is None:
            y, _ = combine_add_rms_norm(x, res, n.weight, n.variance_epsilon)
        else:
            x = x.combine() if isinstance(x, Uncombined) else x
            y, _ = add_rms_norm(x, res, n.weight, n.variance_epsilon, *(self.rot_head or ()))
        return _proj(self.model.lm_head, y, self.rot_head).float()

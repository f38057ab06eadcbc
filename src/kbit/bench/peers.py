"""Adapters for the peer libraries that the harness times beside kbit (each only when importable).

Each peer turns a bfloat16 weight [N, K] into its own format at ``bits`` bits and exposes:

``unavailable()``
    None, or why the peer cannot run here (not installed, import error): the run records the reason.
``build(W, bits) -> PeerWeight``
    one copy of the quantized weight, its byte count, and the float32 [N, K] matrix its format decodes to
    (the reference the output is checked against).
``copy(state)``, ``bind(state, x) -> thunk``
    an independent copy (for the cold-L2 rotation), and a zero-argument call on activations ``x`` [M, K].

Formats (the closest each library has to ours; none has k = 3 or 5 except humming):

==============  ======  =====  ====================================================================
peer            bits    group  format
==============  ======  =====  ====================================================================
humming         2,3,4,5  128   uint, symmetric, bf16 scale per group (JIT CUDA kernels)
tinygemm        4        128   int4 asymmetric, bf16 scale + zero (``aten._weight_int4pack_mm``)
bitsandbytes    4        64    NF4, float32 absmax per block (``bnb.matmul_4bit``)
gemlite         2,4      128   uint asymmetric, bf16 scale + zero (Triton, ``A16Wn``)
==============  ======  =====  ====================================================================
"""
from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BF16 = torch.bfloat16


@dataclass
class PeerWeight:
    """state: the peer's objects for one copy; nbytes: bytes of one copy; reference: float32 [N, K];
    group: weights per scale; note: the format in a few words."""

    state: Any
    nbytes: int
    reference: torch.Tensor
    group: int
    note: str


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _import_reason(module: str) -> str | None:
    try:
        importlib.import_module(module)
        return None
    except Exception as e:  # noqa: BLE001 - any import failure means "skip, with this reason"
        return f"{module} not importable ({type(e).__name__}: {str(e)[:200]})"


def _minmax_quant(W: torch.Tensor, bits: int, group: int):
    """Asymmetric uint quantization per group of ``group`` along K: q in [0, 2**bits - 1], bf16 scale s
    and bf16 minimum mn, value = q * s + mn. Returns (q uint8 [N, K], s [N, K/g], mn [N, K/g]) in fp32."""
    N, K = W.shape
    Wg = W.float().view(N, K // group, group)
    mn = Wg.amin(-1, keepdim=True)
    s = ((Wg.amax(-1, keepdim=True) - mn) / (2**bits - 1)).clamp_min(1e-8).to(BF16).float()
    q = ((Wg - mn) / s).round().clamp(0, 2**bits - 1)
    return q, s, mn


class Tinygemm:
    """PyTorch's int4 tinygemm kernel (``aten._weight_int4pack_mm``): no wheel needed."""

    name, bits, group = "tinygemm", (4,), 128

    def unavailable(self) -> str | None:
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            return "torch has no aten._weight_int4pack_mm"
        return None

    def build(self, W: torch.Tensor, bits: int) -> PeerWeight:
        N, K = W.shape
        g = self.group
        q, s, mn = _minmax_quant(W, 4, g)
        # tinygemm decodes (q - 8) * scale + zero, so zero = mn + 8 * scale
        s_b = s.to(BF16)
        z_b = (mn + 8 * s).to(BF16)
        ref = ((q - 8) * s_b.float() + z_b.float()).view(N, K)
        qi = q.to(torch.int32).view(N, K)
        pairs = (qi[:, ::2] << 4 | qi[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
        sz = torch.stack([s_b.view(N, K // g), z_b.view(N, K // g)], dim=-1).transpose(0, 1).contiguous()
        return PeerWeight((packed, sz), _nbytes(packed, sz), ref, g, "int4 asym, bf16 scale+zero")

    def copy(self, state):
        return tuple(t.clone() for t in state)

    def bind(self, state, x) -> Callable[[], torch.Tensor]:
        packed, sz = state
        return lambda: torch.ops.aten._weight_int4pack_mm(x, packed, self.group, sz)


class Bitsandbytes:
    name, bits, group = "bitsandbytes", (4,), 64

    def unavailable(self) -> str | None:
        return _import_reason("bitsandbytes")

    def build(self, W: torch.Tensor, bits: int) -> PeerWeight:
        # an optional peer library: imported only when this peer runs
        import bitsandbytes.functional as bnbf
        qw, qs = bnbf.quantize_4bit(W, blocksize=self.group, quant_type="nf4", compress_statistics=False)
        ref = bnbf.dequantize_4bit(qw, qs).float()
        return PeerWeight((qw, qs), _nbytes(qw, qs.absmax), ref, self.group, "NF4, fp32 absmax")

    def copy(self, state):
        qw, qs = state
        qs2 = copy.copy(qs)
        qs2.absmax = qs.absmax.clone()
        return qw.clone(), qs2

    def bind(self, state, x) -> Callable[[], torch.Tensor]:
        # an optional peer library: imported only when this peer runs
        import bitsandbytes as bnb
        qw, qs = state
        return lambda: bnb.matmul_4bit(x, qw.t(), qs)


class Gemlite:
    name, bits, group = "gemlite", (2, 4), 128

    def unavailable(self) -> str | None:
        return _import_reason("gemlite")

    def build(self, W: torch.Tensor, bits: int) -> PeerWeight:
        # an optional peer library: imported only when this peer runs
        from gemlite.helper import A16Wn
        N, K = W.shape
        g = self.group
        _, s, mn = _minmax_quant(W, bits, g)
        z = (-mn / s).to(BF16)
        q = (W.float().view(N, K // g, g) / s + z.float()).round().clamp(0, 2**bits - 1)
        # gemlite's fma mode decodes q * s + bf16(-z * s)
        ref = (q * s + (-z.float() * s).to(BF16).float()).view(N, K)
        layer = A16Wn(device=str(W.device), dtype=BF16).from_weights(
            q.to(torch.uint8).view(N, K), s.to(BF16).view(N, K // g), z.view(N, K // g), W_nbits=bits,
            group_size=g)
        nb = _nbytes(layer.W_q, getattr(layer, "scales", None), getattr(layer, "zeros", None))
        return PeerWeight(layer, nb, ref, g, "uint asym, bf16 scale+zero")

    def copy(self, state):
        return copy.deepcopy(state)

    def bind(self, state, x) -> Callable[[], torch.Tensor]:
        return lambda: state(x)


class Humming:
    name, bits, group = "humming", (2, 3, 4, 5), 128

    def unavailable(self) -> str | None:
        return _import_reason("humming")

    def build(self, W: torch.Tensor, bits: int) -> PeerWeight:
        # an optional peer library: imported only when this peer runs
        from humming.layer import HummingLayer
        from humming.ops.utils import init_humming_launcher
        from humming.schema import HummingWeightSchema
        init_humming_launcher()
        N, K = W.shape
        wcfg = {"dtype": f"uint{bits}", "group_size": self.group}
        layer = HummingLayer(shape_n=N, shape_k=K, weight_config=wcfg, torch_dtype=BF16).to(W.device)
        schema = layer.weight_schema
        tensors = HummingWeightSchema.quant_tensor(W, schema, BF16)
        ref = schema.dequant_tensors(tensors).float().reshape(N, K)
        layer.load_from_tensors(tensors)
        layer.transform()
        st = (layer.humming_config, layer.weight, getattr(layer, "weight_scale", None),
              getattr(layer, "zero_point", None), layer.locks)
        return PeerWeight(st, _nbytes(*st[1:4]), ref, self.group, f"uint{bits} sym, bf16 scale")

    def copy(self, state):
        cfg, w, s, z, locks = state
        cl = lambda t: None if t is None else t.clone()  # noqa: E731
        return cfg, w.clone(), cl(s), cl(z), torch.zeros_like(locks)

    def bind(self, state, x) -> Callable[[], torch.Tensor]:
        # an optional peer library: imported only when this peer runs
        from humming.forward import humming_forward
        from humming.tune import get_heuristics_config
        cfg, w, s, z, locks = state
        tuning = json.dumps(get_heuristics_config(cfg, shape_m=x.shape[0], device=x.device.index or 0))
        return lambda: humming_forward(cfg, inputs=x, weight=w, weight_scale=s, zero_point=z, locks=locks,
                                       tuning_config=tuning)


# in the order they run: quick builds first, humming (JIT-compiled kernels) last
PEERS: dict[str, Any] = {p.name: p for p in (Tinygemm(), Bitsandbytes(), Gemlite(), Humming())}
ALIASES = {"bnb": "bitsandbytes"}


def select_peers(names: str | None) -> list:
    """Peers named in the comma list ``names`` ("all": every one; None or "": none)."""
    if not names:
        return []
    if names.strip() == "all":
        return list(PEERS.values())
    out = []
    for n in (n.strip() for n in names.split(",") if n.strip()):
        n = ALIASES.get(n, n)
        if n not in PEERS:
            raise ValueError(f"unknown peer {n!r}; known: {sorted(PEERS)}")
        out.append(PEERS[n])
    return out

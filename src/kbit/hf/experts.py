"""``KbitExperts``: a drop-in for the fused MoE expert modules of transformers >= 5 (``Qwen3MoeExperts``,
``MixtralExperts``, ...), holding ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` in k bits.

Same ``forward(hidden_states, top_k_index, top_k_weights)`` as those modules: for each expert that any token
was routed to, ``act(x @ gate.T) * (x @ up.T) @ down.T`` weighted by the router, through kbit's linear op on
that expert's slice of the stacked weight (the float32 reference on the CPU). This is the Hugging Face
adapter; a grouped kernel over all experts at once is ``kbit.nn``'s business.

Each stacked weight is a child module (:class:`KbitStack`, ``gate_up`` and ``down``) with the buffers
``codes``, ``scales``, ``tensor_scale``, ``codebook``, so the state dict names (``...experts.gate_up.codes``) are
exactly the names ``kbit.save_file`` gives a :class:`~kbit.format.KbitWeight` saved as ``...experts.gate_up``:
one folder format serves ``kbit.load_quantized`` and transformers' ``from_pretrained``.
"""

from __future__ import annotations

import torch
from torch import nn

from kbit.dispatch.linear import linear as _linear_impl
from kbit.format.pack import words_per_row
from kbit.format.spec import DEFAULT_SCALE_FORMAT, KbitWeight, padded_k
from kbit.ops.quantize import quantize

PARTS = ("codes", "scales", "tensor_scale", "codebook")
WEIGHTS = ("gate_up_proj", "down_proj")
#: the child module holding each weight. Not the transformers parameter names: transformers >= 5 rewrites
#: ``experts.gate_up_proj`` / ``experts.down_proj`` when it saves (back to per-expert tensors), which would
#: split our codes; under other names the k-bit tensors are saved as they are.
CHILDREN = {"gate_up_proj": "gate_up", "down_proj": "down"}


def _linear(x: torch.Tensor, qw: KbitWeight) -> torch.Tensor:
    return _linear_impl(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, k=qw.k, blocksize=qw.blocksize,
                        scale_format=qw.scale_format, N=qw.N, K=qw.K)


def empty_weight(shape, k: int, blocksize: int, scale_format: str = DEFAULT_SCALE_FORMAT,
                 codebook_name: str = "custom", device=None) -> KbitWeight:
    """A :class:`KbitWeight` of ``shape`` with uninitialised tensors (on ``device``, e.g. ``"meta"``): the
    shell a checkpoint is loaded into."""
    shape = tuple(int(s) for s in shape)
    lead, (N, K) = shape[:-2], shape[-2:]
    kp = padded_k(K, blocksize)
    sdt = torch.uint8 if scale_format == "log8" else torch.float16
    return KbitWeight(torch.empty(lead + (N, words_per_row(k, kp)), dtype=torch.int32, device=device),
                      torch.empty(lead + (N, kp // blocksize), dtype=sdt, device=device),
                      torch.empty(lead, dtype=torch.float32, device=device),
                      torch.empty(2**k, dtype=torch.float32, device=device),
                      shape, k, blocksize, scale_format, codebook_name)


class KbitStack(nn.Module):
    """One stacked k-bit weight ``[E, N, K]`` as buffers ``codes``, ``scales``, ``tensor_scale``, ``codebook``."""

    def __init__(self, qw: KbitWeight):
        super().__init__()
        for part, t in qw.tensors().items():
            self.register_buffer(part, t)
        self.shape, self.k, self.blocksize = qw.shape, qw.k, qw.blocksize
        self.scale_format, self.codebook_name = qw.scale_format, qw.codebook_name

    def weight(self) -> KbitWeight:
        return KbitWeight(*(getattr(self, p) for p in PARTS), shape=self.shape, k=self.k, blocksize=self.blocksize,
                          scale_format=self.scale_format, codebook_name=self.codebook_name)

    def extra_repr(self) -> str:
        return (f"shape={self.shape}, k={self.k}, blocksize={self.blocksize}, scale_format={self.scale_format!r}, "
                f"codebook={self.codebook_name!r}")


class KbitExperts(nn.Module):
    """MoE experts with stacked k-bit weights ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``.

    Children ``gate_up`` and ``down`` (:class:`KbitStack`), each with the four tensors of its weight.
    """

    def __init__(self, gate_up_proj: KbitWeight, down_proj: KbitWeight, act_fn, dtype: torch.dtype):
        super().__init__()
        E, two_i, H = gate_up_proj.shape
        if len(down_proj.shape) != 3 or down_proj.shape != (E, H, two_i // 2):
            raise ValueError(f"down_proj: expected shape {(E, H, two_i // 2)} for gate_up_proj {gate_up_proj.shape}, "
                             f"got {down_proj.shape}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, H, two_i // 2
        self.act_fn = act_fn
        self.dtype = dtype
        self.gate_up = KbitStack(gate_up_proj)
        self.down = KbitStack(down_proj)

    @classmethod
    def from_experts(cls, module: nn.Module, k: int, blocksize: int, codebook=None, scale_format: str = "log8",
                     device=None) -> KbitExperts:
        """Quantize a fused expert module (``kbit.quantize`` on each stacked weight, on ``device``, default the
        weight's own)."""
        if any(n.endswith("_bias") and getattr(module, n) is not None for n, _ in module.named_parameters()):
            raise NotImplementedError(f"{type(module).__name__}: expert biases are not supported")
        w = module.gate_up_proj.detach()
        q = [quantize(getattr(module, n).detach().to(device or w.device), k=k, blocksize=blocksize,
                      codebook=codebook, scale_format=scale_format) for n in WEIGHTS]
        return cls(*q, act_fn=module.act_fn, dtype=w.dtype)

    def weight(self, name: str) -> KbitWeight:
        """``"gate_up_proj"`` or ``"down_proj"`` as a stacked :class:`KbitWeight` (sharing the buffers)."""
        if name not in WEIGHTS:
            raise ValueError(f"name: expected one of {WEIGHTS}, got {name!r}")
        return getattr(self, CHILDREN[name]).weight()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        gate_up, down = self.weight("gate_up_proj"), self.weight("down_proj")
        flat_experts = top_k_index.reshape(-1)
        for e in torch.unique(flat_experts).tolist():
            if not 0 <= e < self.num_experts:  # some routers mark dropped slots with E
                continue
            token_idx, slot = torch.where(top_k_index == e)
            x = hidden_states[token_idx]
            gate, up = _linear(x, gate_up[e]).chunk(2, dim=-1)
            y = _linear(self.act_fn(gate) * up, down[e])
            y = y * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, dtype={self.dtype}")

"""``KbitExperts``: a drop-in for the fused MoE expert modules of transformers >= 5 (``Qwen3MoeExperts``,
``MixtralExperts``, ...), holding ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` in k bits.

Same ``forward(hidden_states, top_k_index, top_k_weights)`` as those modules: for each expert that any token
was routed to, ``act(x @ gate.T) * (x @ up.T) @ down.T`` weighted by the router, through kbit's linear op on
that expert's slice of the stacked weight (the float32 reference on the CPU). This is the Hugging Face
adapter; a grouped kernel over all experts at once is ``kbit.nn``'s business.
"""

from __future__ import annotations

import torch
from torch import nn

from kbit.dispatch.linear import linear as _linear_impl
from kbit.format.spec import KbitWeight
from kbit.ops.quantize import quantize

PARTS = ("codes", "scales", "tensor_scale", "codebook")
WEIGHTS = ("gate_up_proj", "down_proj")


def _linear(x: torch.Tensor, qw: KbitWeight) -> torch.Tensor:
    return _linear_impl(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, k=qw.k, blocksize=qw.blocksize,
                        scale_format=qw.scale_format, N=qw.N, K=qw.K)


class KbitExperts(nn.Module):
    """MoE experts with stacked k-bit weights ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``.

    Buffers ``gate_up_proj_codes``, ``gate_up_proj_scales``, ... (the four tensors of each weight).
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
        self._meta = {}
        for name, qw in zip(WEIGHTS, (gate_up_proj, down_proj), strict=True):
            for part, t in qw.tensors().items():
                self.register_buffer(f"{name}_{part}", t)
            self._meta[name] = (qw.shape, qw.k, qw.blocksize, qw.scale_format, qw.codebook_name)

    @classmethod
    def from_experts(cls, module: nn.Module, k: int, blocksize: int, codebook=None, scale_format: str = "log8"
                     ) -> KbitExperts:
        """Quantize a fused expert module (``kbit.quantize`` on each stacked weight, on its device)."""
        if any(n.endswith("_bias") and getattr(module, n) is not None for n, _ in module.named_parameters()):
            raise NotImplementedError(f"{type(module).__name__}: expert biases are not supported")
        w = module.gate_up_proj.detach()
        q = [quantize(getattr(module, n).detach(), k=k, blocksize=blocksize, codebook=codebook,
                      scale_format=scale_format) for n in WEIGHTS]
        return cls(*q, act_fn=module.act_fn, dtype=w.dtype)

    def weight(self, name: str) -> KbitWeight:
        """``"gate_up_proj"`` or ``"down_proj"`` as a stacked :class:`KbitWeight` (sharing the buffers)."""
        shape, k, blocksize, scale_format, codebook_name = self._meta[name]
        return KbitWeight(*(getattr(self, f"{name}_{p}") for p in PARTS), shape=shape, k=k, blocksize=blocksize,
                          scale_format=scale_format, codebook_name=codebook_name)

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
        shape, k, blocksize, scale_format, cb = self._meta["gate_up_proj"]
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, k={k}, blocksize={blocksize}, "
                f"scale_format={scale_format!r}, codebook={cb!r}")

"""``KbitLinear``: an ``nn.Linear`` whose weight is stored in k bits (format version 1).

The forward pass is ``torch.ops.kbit.linear`` (``kbit.ops.gemm``): on CUDA it dispatches by the number of
activation rows (GEMV, fused tensor-core GEMM, or dequantize + cuBLAS); on the CPU it is the float32
reference, so models run (slowly) anywhere. Outside ``torch.compile`` the op's implementation is called
directly: going through the dispatcher of ``torch.library`` costs several microseconds a call, which at
M = 1 is a sizeable part of a ~10-50 us kernel. Under ``torch.compile`` the op (with its fake impl) is traced.
"""

from __future__ import annotations

import torch
from torch import nn

from kbit.format.reference import dequantize_reference
from kbit.format.spec import DEFAULT_BLOCKSIZE, DEFAULT_K, DEFAULT_SCALE_FORMAT, KbitWeight
from kbit.ops.gemm import linear as _linear_impl

__all__ = ["KbitLinear"]


class KbitLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W[out_features, in_features]`` k-bit quantized.

    Buffers (saved in the state dict): ``codes`` int32, ``scales`` uint8/fp16, ``tensor_scale`` float32 [],
    ``codebook`` float32 ``[2**k]``, ``bias`` (optional, in ``dtype``). The format parameters (k, blocksize,
    scale_format, shape) are saved in the module's extra state and checked on load.

    Parameters
    ----------
    in_features, out_features : the weight is ``[out_features, in_features]``.
    k, blocksize, scale_format : format parameters (``docs/format.md``).
    bias : whether the layer has a bias.
    dtype : activations and output dtype (float16 / bfloat16 on CUDA; any float on the CPU).

    Example
    -------
    >>> lin = nn.Linear(4096, 4096, dtype=torch.bfloat16)  # doctest: +SKIP
    >>> q = KbitLinear.from_linear(lin, k=4).cuda()  # doctest: +SKIP
    >>> y = q(torch.randn(2, 7, 4096, dtype=torch.bfloat16, device="cuda"))  # doctest: +SKIP
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, k: int = DEFAULT_K,
                 blocksize: int = DEFAULT_BLOCKSIZE, scale_format: str = DEFAULT_SCALE_FORMAT,
                 dtype: torch.dtype = torch.bfloat16, device=None, codebook_name: str = "custom"):
        super().__init__()
        from kbit.format.pack import words_per_row
        from kbit.format.spec import check_blocksize, check_k, check_scale_format, padded_k

        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.k = check_k(k)
        self.blocksize = check_blocksize(blocksize)
        self.scale_format = check_scale_format(scale_format)
        self.dtype = dtype
        self.codebook_name = codebook_name
        kp = padded_k(self.in_features, self.blocksize)
        sdt = torch.uint8 if scale_format == "log8" else torch.float16
        self.register_buffer("codes", torch.zeros(out_features, words_per_row(k, kp), dtype=torch.int32,
                                                  device=device))
        self.register_buffer("scales", torch.zeros(out_features, kp // blocksize, dtype=sdt, device=device))
        self.register_buffer("tensor_scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("codebook", torch.linspace(-1, 1, 2**k, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_weight(cls, qw: KbitWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
                    ) -> KbitLinear:
        """A layer holding the 2-D :class:`~kbit.format.KbitWeight` ``qw`` (tensors are shared, not copied)."""
        if len(qw.shape) != 2:
            raise ValueError(f"qw: expected a 2-D weight [N, K], got shape {qw.shape}")
        N, K = qw.shape
        m = cls(K, N, bias is not None, k=qw.k, blocksize=qw.blocksize, scale_format=qw.scale_format,
                dtype=dtype, device=qw.device, codebook_name=qw.codebook_name)
        m.codes, m.scales, m.tensor_scale, m.codebook = qw.codes, qw.scales, qw.tensor_scale, qw.codebook
        if bias is not None:
            m.bias = bias.detach().to(device=qw.device, dtype=dtype).clone()
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear, k: int = DEFAULT_K, blocksize: int = DEFAULT_BLOCKSIZE,
                    codebook=None, scale_format: str = DEFAULT_SCALE_FORMAT, dtype: torch.dtype | None = None
                    ) -> KbitLinear:
        """Quantize ``linear.weight`` (``kbit.quantize``, on the weight's device); the bias is kept in
        ``dtype`` (default: the weight's dtype, or bfloat16 for a float32/float64 weight on CUDA)."""
        from kbit.ops.quantize import quantize

        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if dtype is None:
            dtype = w.dtype if (w.dtype in (torch.float16, torch.bfloat16) or not w.is_cuda) else torch.bfloat16
        qw = quantize(w, k=k, blocksize=blocksize, codebook=codebook, scale_format=scale_format)
        return cls.from_weight(qw, linear.bias, dtype)

    def weight(self) -> KbitWeight:
        """The layer's weight as a :class:`~kbit.format.KbitWeight` (sharing the buffers)."""
        return KbitWeight(self.codes, self.scales, self.tensor_scale, self.codebook,
                          (self.out_features, self.in_features), self.k, self.blocksize, self.scale_format,
                          self.codebook_name)

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (x, self.codes, self.scales, self.tensor_scale, self.codebook, self.k, self.blocksize,
                self.scale_format, self.out_features, self.in_features, self.bias)
        if torch.compiler.is_compiling():
            return torch.ops.kbit.linear(*args)
        if x.device.type == "cpu":
            return self._cpu_forward(x)
        return _linear_impl(x, self.codes, self.scales, self.tensor_scale, self.codebook, k=self.k,
                            blocksize=self.blocksize, scale_format=self.scale_format, N=self.out_features,
                            K=self.in_features, bias=self.bias)

    def _cpu_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The CPU path (reference numbers: float32 weight, float32 product, result in x's dtype), with the
        dequantized weight kept between calls: re-dequantizing every layer at every decode step cost ~12 ms
        a call on SmolLM2. The cache is rebuilt when any quantized buffer is replaced or changed in place."""
        parts = (self.codes, self.scales, self.tensor_scale, self.codebook)
        key = tuple((t.data_ptr(), t._version) for t in parts)
        cached = self.__dict__.get("_cpu_weight")
        if cached is None or cached[0] != key:
            qw = KbitWeight(*parts, (self.out_features, self.in_features), self.k, self.blocksize,
                            self.scale_format)
            cached = (key, dequantize_reference(qw, torch.float32))
            self.__dict__["_cpu_weight"] = cached
        bias = None if self.bias is None else self.bias.to(torch.float32)
        return torch.nn.functional.linear(x.to(torch.float32), cached[1], bias).to(x.dtype)

    # -- state dict ----------------------------------------------------------------------------------------
    def get_extra_state(self) -> dict:
        return {"format_version": 1, "k": self.k, "blocksize": self.blocksize, "scale_format": self.scale_format,
                "shape": [self.out_features, self.in_features], "codebook": self.codebook_name}

    def set_extra_state(self, state: dict) -> None:
        mine = self.get_extra_state()
        for key in ("format_version", "k", "blocksize", "scale_format", "shape"):
            if state.get(key) != mine[key]:
                raise ValueError(f"KbitLinear state: expected {key}={mine[key]!r}, got {state.get(key)!r} "
                                 "(build the module with the saved format parameters)")
        self.codebook_name = state.get("codebook", self.codebook_name)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"k={self.k}, blocksize={self.blocksize}, scale_format={self.scale_format!r}, "
                f"codebook={self.codebook_name!r}, dtype={self.dtype}")

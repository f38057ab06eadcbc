"""``KbitLinear``: an ``nn.Linear`` whose weight is stored in k bits (format version 1).

The forward pass is ``torch.ops.kbit.linear`` (``kbit.dispatch.linear``): on CUDA it dispatches by the number of
activation rows (GEMV, fused tensor-core GEMM, or dequantize + cuBLAS); on the CPU it is the reference (float32;
bfloat16 for bfloat16 inputs) on a dequantized copy of the weight kept between calls
(``kbit.dispatch.linear.cpu_linear``), so a CPU forward costs what an ``nn.Linear`` in that dtype costs, and holds
its memory too (``cache_cpu_weight``). Outside
``torch.compile`` the op's implementation is called directly: going through the dispatcher of ``torch.library``
costs several microseconds a call, which at M = 1 is a sizeable part of a ~10-50 us kernel. Under
``torch.compile`` the op (with its fake impl) is traced.

Layouts: the weight is held once, either in the canonical layout of ``docs/format.md`` (``layout ==
"canonical"``) or in the small-M kernel's layout "mma-v1" (``kbit.ops.mma.layout``): :meth:`KbitLinear.
repack_for_kernels` replaces ``codes`` / ``scales`` by their repacked form (the canonical tensors are freed),
:meth:`KbitLinear.to_canonical` goes back. By default (``auto_repack``) the first CUDA forward that runs the
small-M kernel repacks (outside CUDA-graph capture; run one eager step before capturing). Repacked, the
small-M kernel reads the buffers directly, every other kernel (fused GEMM, dequantize + cuBLAS, Triton GEMV;
the CPU reference) gets a canonical temporary (``kbit.ops.mma.layout.unrepack``, freed after the call), and
``state_dict`` / ``weight()`` / ``kbit.save_quantized`` see the canonical layout (files are unchanged).

Rotation: a weight quantized under a :class:`kbit.format.Rotation` holds ``W R`` (``kbit.quantize(...,
rotation="hadamard")``); the layer keeps it in ``rotation`` (saved in the extra state and in a checkpoint's
module table) and :meth:`KbitLinear.forward` feeds the product ``x R`` (``kbit.ops.hadamard.rotate``, its int8
signs made once per device and cached: run one call before a CUDA graph capture), so ``y = x W^T``.
:meth:`KbitLinear.forward_rotated` takes an ``x`` already rotated (a producer that fused the rotation).
"""

from __future__ import annotations

import torch
from torch import nn

from kbit.dispatch import linear as dispatch
from kbit.format.pack import words_per_row
from kbit.format.spec import (
    DEFAULT_BLOCKSIZE,
    DEFAULT_K,
    DEFAULT_SCALE_FORMAT,
    KbitWeight,
    Rotation,
    check_blocksize,
    check_k,
    check_scale_format,
    padded_k,
)
from kbit.nn._layout import CANONICAL, apply_keeping_format, capturing, check_size, release
from kbit.ops._checks import check_bias, check_x
from kbit.ops.hadamard import rotate
from kbit.ops.mma.layout import LAYOUT, RepackedWeight, repack, unrepack
from kbit.ops.quantize import quantize, rotate_weight
from kbit.utils.checks import fail

__all__ = ["CANONICAL", "KbitLinear", "repack_for_kernels"]


def repack_for_kernels(model: nn.Module) -> int:
    """:meth:`~KbitLinear.repack_for_kernels` on every ``KbitLinear`` / ``KbitMoE`` of ``model`` (in place);
    returns how many were repacked (modules already in layout "mma-v1" are not counted)."""
    n = 0
    for m in model.modules():
        if callable(getattr(m, "repack_for_kernels", None)) and getattr(m, "layout", None) == CANONICAL:
            m.repack_for_kernels()
            n += 1
    return n


class KbitLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W[out_features, in_features]`` k-bit quantized.

    Buffers (saved in the state dict): ``codes`` int32, ``scales`` uint8/fp16, ``tensor_scale`` float32 [],
    ``codebook`` float32 ``[2**k]``, ``bias`` (optional, in ``dtype``). The format parameters (k, blocksize,
    scale_format, shape) are saved in the module's extra state and checked on load.

    ``layout``: ``"canonical"`` (``codes [N, Kp*k/32]``, ``scales [N, Kp/B]``) or ``"mma-v1"`` (``codes``,
    ``scales`` in the small-M kernel's layout, ``kbit.ops.mma.layout``; the state dict still holds the
    canonical tensors). ``auto_repack`` (default True): repack on the first CUDA forward that runs the small-M
    kernel; False keeps the canonical layout (small M then runs the Triton GEMV, which reads it as it is).

    On the CPU the forward keeps the dequantized weight in the product's dtype (float32, or bfloat16 for
    bfloat16 inputs: ``kbit.dispatch.linear.cpu_product_dtype``; the memory of the ``nn.Linear`` it replaces,
    beside the k-bit buffers) and reuses it while the buffers are unchanged, so a CPU decode step runs at the
    speed of ``nn.Linear`` in that dtype. ``cache_cpu_weight = False`` (on the instance or a subclass)
    dequantizes at every call instead: k-bit memory, at the cost of one dequantization a call.

    Parameters
    ----------
    in_features, out_features : the weight is ``[out_features, in_features]``.
    k, blocksize, scale_format : format parameters (``docs/format.md``).
    bias : whether the layer has a bias.
    dtype : activations and output dtype (float16 / bfloat16 on CUDA; any float on the CPU).
    rotation : None, or the :class:`kbit.format.Rotation` the weight was quantized under (the buffers hold
        ``W R``; the forward rotates its input). Fixed at construction: a state dict must match it.

    Example
    -------
    >>> lin = nn.Linear(4096, 4096, dtype=torch.bfloat16)  # doctest: +SKIP
    >>> q = KbitLinear.from_linear(lin, k=4).cuda()  # doctest: +SKIP
    >>> y = q(torch.randn(2, 7, 4096, dtype=torch.bfloat16, device="cuda"))  # doctest: +SKIP
    """

    #: repack on the first CUDA forward that runs the small-M kernel (see the module docstring)
    auto_repack: bool = True
    #: this class's forward is exactly the kernel's, so ``kbit.dispatch.prologue`` may fuse glue into its launch (not
    #: inherited: read from the class's own ``__dict__``)
    fuses_prologue: bool = True
    #: on the CPU, keep the float32 weight between calls (see the class docstring)
    cache_cpu_weight: bool = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, k: int = DEFAULT_K,
                 blocksize: int = DEFAULT_BLOCKSIZE, scale_format: str = DEFAULT_SCALE_FORMAT,
                 dtype: torch.dtype = torch.bfloat16, device=None, codebook_name: str = "custom",
                 rotation: Rotation | None = None):
        super().__init__()
        self.in_features = check_size("in_features", in_features)
        self.out_features = check_size("out_features", out_features)
        self.k = check_k(k)
        self.blocksize = check_blocksize(blocksize)
        self.scale_format = check_scale_format(scale_format)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            fail(TypeError, "dtype", "a floating-point torch.dtype", dtype)
        if not isinstance(codebook_name, str):
            fail(TypeError, "codebook_name", "a str", type(codebook_name).__name__)
        if rotation is not None:
            if not isinstance(rotation, Rotation):
                fail(TypeError, "rotation", "None or a kbit.format.Rotation", type(rotation).__name__)
            rotation.check_width(self.in_features, "in_features")
        self.dtype = dtype
        self.codebook_name = codebook_name
        #: the rotation of the input dimension the weight was quantized under (None: unrotated)
        self.rotation = rotation
        self.layout = CANONICAL
        kp = padded_k(self.in_features, self.blocksize)
        sdt = torch.uint8 if scale_format == "log8" else torch.float16
        N = self.out_features
        self.register_buffer("codes", torch.zeros(N, words_per_row(k, kp), dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(N, kp // blocksize, dtype=sdt, device=device))
        self.register_buffer("tensor_scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("codebook", torch.linspace(-1, 1, 2**k, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(N, dtype=dtype, device=device))
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
                dtype=dtype, device=qw.device, codebook_name=qw.codebook_name, rotation=qw.rotation)
        m.codes, m.scales, m.tensor_scale, m.codebook = qw.codes, qw.scales, qw.tensor_scale, qw.codebook
        if bias is not None:
            m.bias = bias.detach().to(device=qw.device, dtype=dtype).clone()
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear, k: int = DEFAULT_K, blocksize: int = DEFAULT_BLOCKSIZE,
                    codebook=None, scale_format: str = DEFAULT_SCALE_FORMAT, dtype: torch.dtype | None = None,
                    rotation=None, seed: int = 0) -> KbitLinear:
        """Quantize ``linear.weight`` (``kbit.quantize``, on the weight's device); the bias is kept in
        ``dtype`` (default: the weight's dtype, or bfloat16 for a float32/float64 weight on CUDA).
        ``rotation`` / ``seed``: as in ``kbit.quantize`` (``"hadamard"``: a rotated layer, same outputs)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if dtype is None:
            dtype = w.dtype if (w.dtype in (torch.float16, torch.bfloat16) or not w.is_cuda) else torch.bfloat16
        qw = quantize(w, k=k, blocksize=blocksize, codebook=codebook, scale_format=scale_format, rotation=rotation,
                      seed=seed)
        return cls.from_weight(qw, linear.bias, dtype)

    def weight(self) -> KbitWeight:
        """The layer's weight as a :class:`~kbit.format.KbitWeight` in the canonical layout: sharing the buffers,
        or (layout "mma-v1") with unrepacked copies of ``codes`` / ``scales``."""
        codes, scales = self._canonical_codes()
        return KbitWeight(codes, scales, self.tensor_scale, self.codebook,
                          (self.out_features, self.in_features), self.k, self.blocksize, self.scale_format,
                          self.codebook_name, self.rotation)

    def kernel_weight(self) -> KbitWeight | RepackedWeight:
        """The weight as held (sharing the buffers): a ``KbitWeight`` or a ``kbit.ops.mma.layout.RepackedWeight``."""
        if self.layout == CANONICAL:
            return self.weight()
        return RepackedWeight(self.codes, self.scales, self.tensor_scale, self.codebook,
                                       (self.out_features, self.in_features), self.k, self.blocksize,
                                       self.scale_format, self.codebook_name)

    # -- layout --------------------------------------------------------------------------------------------
    def _fmt(self) -> dict:
        return dict(k=self.k, blocksize=self.blocksize, N=self.out_features, K=self.in_features)

    def _canonical_codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout == CANONICAL:
            return self.codes, self.scales
        return unrepack(self.codes, self.scales, **self._fmt())

    def canonical_buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers (``self._buffers``, same names and order) with codes and scales in the canonical
        layout (unrepacked copies when the module holds layout "mma-v1")."""
        codes, scales = self._canonical_codes()
        return {n: codes if n == "codes" else scales if n == "scales" else t for n, t in self._buffers.items()}

    def repack_for_kernels(self) -> KbitLinear:
        """Hold ``codes`` / ``scales`` in layout "mma-v1" only (in place; the canonical tensors are dropped, so
        freed unless referenced elsewhere, e.g. by a ``KbitWeight`` the module was built from). Idempotent;
        returns self."""
        if self.layout != CANONICAL:
            return self
        old = [self.codes, self.scales]
        rc, rs = repack(self.codes, self.scales, scale_format=self.scale_format, **self._fmt())
        release(old)
        self.codes, self.scales = rc, rs
        self.layout = LAYOUT
        return self

    def to_canonical(self) -> KbitLinear:
        """Undo :meth:`repack_for_kernels` (bit-exact, in place). Returns self."""
        if self.layout == CANONICAL:
            return self
        old = [self.codes, self.scales]
        codes, scales = self._canonical_codes()
        release(old)
        self.codes, self.scales = codes, scales
        self.layout = CANONICAL
        return self

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x [..., in_features]``; a rotated layer multiplies x by ``R`` first."""
        if self.rotation is not None:
            if not isinstance(x, torch.Tensor):
                fail(TypeError, "x", "a torch.Tensor", type(x).__name__)
            # float64 (a CPU reference dtype) has no kernel: the plain-torch butterflies in float64
            x = rotate_weight(x, self.rotation) if x.dtype == torch.float64 else rotate(x, self.rotation)
        return self.forward_rotated(x)

    def forward_rotated(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ (W R).T + bias`` with ``x`` already multiplied by ``R`` (``self.rotation``): for a producer that
        fused the rotation into its own kernel. The same as :meth:`forward` for an unrotated layer."""
        if not isinstance(x, torch.Tensor):
            fail(TypeError, "x", "a torch.Tensor", type(x).__name__)
        if torch.compiler.is_compiling():
            op = torch.ops.kbit.linear if self.layout == CANONICAL else torch.ops.kbit.linear_mma_v1
            return op(*self._op_args(x))
        if x.is_cpu:
            return self._cpu_forward(x)
        if self.layout != CANONICAL:
            # on CUDA through a launcher prepared once a signature (dispatch.fast_linear; host cost ~ a launch)
            return dispatch.linear_mma_v1(x, self.codes, self.scales, self.tensor_scale, self.codebook,
                                          scale_format=self.scale_format, bias=self.bias, **self._fmt())
        if dispatch.serves(x, self.out_features, self.in_features, self.k):
            if self.auto_repack and not capturing():
                return self.repack_for_kernels().forward_rotated(x)  # x is rotated already
            # the small-M kernel would cache a repacked copy beside ours: the choice without it
            return dispatch.linear(*self._parts(x), mma=False, **self._kw())
        return dispatch.linear(x, self.codes, self.scales, self.tensor_scale, self.codebook, k=self.k,
                               blocksize=self.blocksize, scale_format=self.scale_format, N=self.out_features,
                               K=self.in_features, bias=self.bias)

    def _op_args(self, x: torch.Tensor) -> tuple:
        return (x, self.codes, self.scales, self.tensor_scale, self.codebook, self.k, self.blocksize,
                self.scale_format, self.out_features, self.in_features, self.bias)

    def _parts(self, x: torch.Tensor) -> tuple:
        return (x, self.codes, self.scales, self.tensor_scale, self.codebook)

    def _kw(self) -> dict:
        return dict(k=self.k, blocksize=self.blocksize, scale_format=self.scale_format, N=self.out_features,
                    K=self.in_features, bias=self.bias)

    def _cpu_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The CPU path (``kbit.dispatch.linear.cpu_linear``: weight and product in float32 or bfloat16, result in
        x's dtype) on the weight dequantized once and kept while no buffer is replaced or changed in place
        (re-dequantizing every layer at every decode step made CPU generation half as fast as float32
        transformers)."""
        b = self._buffers
        codes, bias = b["codes"], self.bias
        check_x(x, self.in_features)
        if x.device != codes.device:
            fail(ValueError, "x", f"device {codes.device} (that of the module's weight)", x.device)
        check_bias(bias, self.out_features, x.device)
        return dispatch.cpu_linear(x, codes, b["scales"], b["tensor_scale"], b["codebook"], bias=bias,
                                   cache=self.cache_cpu_weight, **self._cpu_kw())

    def _cpu_kw(self) -> dict:
        return dict(k=self.k, blocksize=self.blocksize, scale_format=self.scale_format, N=self.out_features,
                    K=self.in_features, mma_v1=self.layout != CANONICAL)

    def kept_cpu_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The ``dtype`` weight the CPU path keeps for this module (see ``cache_cpu_weight``), or None."""
        b = self._buffers
        return dispatch.kept_cpu_weight(b["codes"], b["scales"], b["tensor_scale"], b["codebook"], dtype=dtype,
                                        **self._cpu_kw())

    def _apply(self, fn, recurse=True):
        return apply_keeping_format(self, super()._apply, fn, recurse, model_dtype=("bias",))

    # -- state dict ----------------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.layout != CANONICAL:  # the file format is the canonical layout
            codes, scales = self._canonical_codes()
            destination[prefix + "codes"], destination[prefix + "scales"] = codes, scales

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self._check_state(state_dict, prefix, strict)  # all of it before any copy: a failed load changes nothing
        if self.layout == CANONICAL:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        self.to_canonical()  # load into the canonical buffers (shape checks, in-place copies), then repack
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self.repack_for_kernels()

    def _expected_state(self) -> dict[str, tuple[torch.dtype | None, tuple[int, ...]]]:
        """(dtype, shape) of each tensor of the state dict (canonical layout); bias: any float dtype."""
        kp = padded_k(self.in_features, self.blocksize)
        N = self.out_features
        want = {"codes": (torch.int32, (N, words_per_row(self.k, kp))),
                "scales": (torch.uint8 if self.scale_format == "log8" else torch.float16, (N, kp // self.blocksize)),
                "tensor_scale": (torch.float32, ()), "codebook": (torch.float32, (2**self.k,))}
        if self.bias is not None:
            want["bias"] = (None, (N,))
        return want

    def _check_state(self, state_dict, prefix: str, strict: bool) -> None:
        """This module's part of ``state_dict``: the format parameters (extra state), then every tensor's type, shape
        and dtype, then the weight's own invariants (``KbitWeight``); with ``strict``, no key missing or
        unexpected. ValueError / TypeError naming the key."""
        fmt = f"k={self.k}, blocksize={self.blocksize}, scale_format={self.scale_format!r}, " \
              f"shape=[{self.out_features}, {self.in_features}]"
        want = self._expected_state()
        mine = {key[len(prefix):] for key in state_dict if key.startswith(prefix)}
        if strict:
            missing = sorted(prefix + n for n in (*want, "_extra_state") if n not in mine)
            unexpected = sorted(prefix + n for n in mine - {*want, "_extra_state"}
                                if n.split(".")[0] not in self._modules)  # a subclass's children load themselves
            if missing or unexpected:
                fail(ValueError, "state_dict", f"the keys of a KbitLinear ({fmt})",
                     f"missing {missing}, unexpected {unexpected}")
        if prefix + "_extra_state" in state_dict:
            self._check_extra(state_dict[prefix + "_extra_state"])
        for name, (dtype, shape) in want.items():
            if prefix + name not in state_dict:
                continue
            t, what = state_dict[prefix + name], f"state_dict[{prefix + name!r}]"
            if not isinstance(t, torch.Tensor):
                fail(TypeError, what, "a torch.Tensor", type(t).__name__)
            if tuple(t.shape) != shape:
                fail(ValueError, what, f"shape {shape} ({fmt})", tuple(t.shape))
            if (t.dtype != dtype) if dtype is not None else not t.dtype.is_floating_point:
                fail(TypeError, what, f"dtype {dtype or 'float'} ({fmt})", t.dtype)
        parts = [state_dict.get(prefix + n) for n in ("codes", "scales", "tensor_scale", "codebook")]
        if all(t is not None for t in parts):
            KbitWeight(*parts, (self.out_features, self.in_features), self.k, self.blocksize, self.scale_format,
                       rotation=self.rotation)

    def get_extra_state(self) -> dict:
        """The format parameters; ``rotation`` ({"kind", "seed", "block"}) only for a rotated layer (a state
        without it is unrotated: older states load as they did)."""
        out = {"format_version": 1, "k": self.k, "blocksize": self.blocksize, "scale_format": self.scale_format,
               "shape": [self.out_features, self.in_features], "codebook": self.codebook_name}
        if self.rotation is not None:
            out["rotation"] = self.rotation.metadata()
        return out

    def _check_extra(self, state) -> None:
        if not isinstance(state, dict):
            fail(TypeError, "KbitLinear state", "a dict (the module's extra state)", type(state).__name__)
        mine = self.get_extra_state()
        for key in ("format_version", "k", "blocksize", "scale_format", "shape"):
            got = state.get(key)
            if key == "shape" and isinstance(got, (tuple, list)):
                got = list(got)
            if got != mine[key]:
                raise ValueError(f"KbitLinear state: expected {key}={mine[key]!r}, got {state.get(key)!r} "
                                 "(build the module with the saved format parameters)")
        got, want = state.get("rotation"), mine.get("rotation")
        if isinstance(got, dict):
            got = {key: got.get(key) for key in ("kind", "seed", "block")}
        if got != want:
            what = "an unrotated" if got is None else f"a rotated ({got})"
            raise ValueError(f"KbitLinear state: expected rotation={want!r}, got {got!r}: {what} weight cannot load "
                             f"into a layer {'with' if want else 'without'} a rotation (build the module with the "
                             "saved rotation, e.g. KbitLinear(..., rotation=kbit.format.Rotation(seed, block)))")

    def set_extra_state(self, state: dict) -> None:
        self._check_extra(state)
        self.codebook_name = state.get("codebook", self.codebook_name)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"k={self.k}, blocksize={self.blocksize}, scale_format={self.scale_format!r}, "
                f"codebook={self.codebook_name!r}, dtype={self.dtype}"
                + (f", rotation={self.rotation!r}" if self.rotation is not None else "")
                + (f", layout={self.layout!r}" if self.layout != CANONICAL else ""))

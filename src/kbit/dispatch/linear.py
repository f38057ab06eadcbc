"""Dense ``y = x @ W.T (+ bias)`` on a k-bit weight: the only place that chooses its kernel.

By M (``x.numel() / K``) and the GPU: the CUDA small-M kernels (``kbit.ops.gemv_mma``; kernels 1, 3, 4 up to
M = 64, with kernel 7 on sm_90 up to :data:`~kbit.tuning.mma.LARGE7_MAX_M` and on big weights beyond), else the
per-GPU table of ``kbit.tuning.gemm``: the Triton GEMV (``kbit.ops.gemv``, M <= 8), the fused Triton GEMM
(``kbit.ops.gemm``) or dequantize + cuBLAS. Without the CUDA kernels (no NVRTC, the Triton interpreter,
``kbit.options`` backend ``"triton"``) the Triton kernels serve; on the CPU (or backend ``"torch"``) the plain-torch
reference (:func:`cpu_linear`: float32, or bfloat16 for bfloat16 inputs; on the CPU on a dequantized weight kept per
weight, :data:`CPU_WEIGHTS`).

Every path validates its arguments with ``kbit.ops._checks.check_linear`` (metadata only: no host sync, traceable),
the fake implementations of the torch ops too, so a bad call raises the same ``TypeError`` / ``ValueError`` eagerly,
on the CPU and under ``torch.compile``.

Weights in layout "mma-v1" (``kbit.nn.KbitLinear`` after ``repack_for_kernels``) go through :func:`linear_mma_v1`,
whose small-M calls reuse a launch prepared once per signature (:func:`fast_linear`): the host cost of a decode call
is then about that of the launch itself.

Torch ops (with fake implementations, so they trace under ``torch.compile`` and run in CUDA graphs):
``kbit::linear``, ``kbit::linear_mma_v1``, ``kbit::gemv`` (small M), ``kbit::linear_small_m``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kbit import options
from kbit.format.reference import dequantize_reference
from kbit.format.spec import KbitWeight
from kbit.ops import gemm, gemv, gemv_mma
from kbit.ops._checks import check_dense, check_linear, check_not_meta
from kbit.ops.dequant import dequantize_tensors
from kbit.ops.mma.common import check_repacked, deterministic, kernels_available, usable
from kbit.ops.mma.layout import repacked, unrepack
from kbit.tuning.gemm import MMA_MAX_M, Choice, gemm_choice
from kbit.tuning.mma import large_ok, large_serves
from kbit.tuning.tables import gpu_key
from kbit.tuning.tuned import tuned_candidate
from kbit.utils.cache import TensorCache
from kbit.utils.checks import fail

__all__ = ["CPU_WEIGHTS", "choice", "cpu_linear", "cpu_product_dtype", "cpu_weight", "pick", "dequant_mm",
           "fast_linear", "kbit_gemv", "kept_cpu_weight", "kbit_linear", "kbit_linear_small_m", "linear",
           "linear_mma_v1", "serves", "small_m", "tuned_choice"]

_X16 = (torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------------------------ the choice


def choice(M: int, N: int, K: int, k: int, device) -> Choice:
    """The kernel for ``M`` rows on a k-bit ``[N, K]`` weight on ``device``: ``"gemv"`` (a small-M kernel),
    ``"fused"`` (with its config) or ``"dequant_mm"``. Cached per shape, device and ``kbit.options``."""
    return _choice(M, N, K, k, device, options.get())


@functools.lru_cache(maxsize=4096)
def _choice(M, N, K, k, device, opts) -> Choice:
    mma = opts.backend in ("auto", "cuda") and kernels_available(device)
    large = mma and large_ok(device)
    tuned = tuned_choice(M, N, K, k, device, mma=mma, large=large)
    return tuned if tuned is not None else pick(M, N, K, k, device, mma=mma, large=large)


def tuned_choice(M: int, N: int, K: int, k: int, device, *, mma: bool = False, large: bool = False) -> Choice | None:
    """What this GPU's tuned table (``kbit tune``, in the cache directory: the shape's entry, else its fitted rule)
    says, where that kernel runs here; None (the built-in rules decide) without a table or a match. Never searches.
    The small-M kernels' configs come from the same table, in ``kbit.ops.gemv_mma``."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    cand = tuned_candidate(k, M, N, K, gpu_key(device))
    if cand is None:
        return None
    if (cand.family == "mma" and mma) or (cand.family == "large" and large) or (cand.family == "gemv" and not mma):
        return Choice("gemv")
    if cand.family == "fused":
        return Choice("fused", cand.config)
    if cand.family == "dequant_mm":
        return Choice("dequant_mm")
    return None


def pick(M: int, N: int, K: int, k: int, device=None, *, mma: bool = False, large: bool = False) -> Choice:
    """:func:`choice` given the facts: ``mma``, the CUDA small-M kernels run (then they serve every M up to
    ``MMA_MAX_M``); ``large``, kernel 7 too (then they serve where ``kbit.tuning.mma.large_serves``); else the
    per-GPU table (``kbit.tuning.gemm.gemm_choice``)."""
    if mma and (large_serves(M, N, K) if large else M <= MMA_MAX_M):
        return Choice("gemv")
    return gemm_choice(M, N, K, k, device)


def serves(x: torch.Tensor, N: int, K: int, k: int) -> bool:
    """Whether :func:`linear` runs this call (``x [..., K]`` on a ``[N, K]`` weight) on the CUDA small-M kernels:
    they can run here (``kbit.ops.mma.common.usable``) and the choice for M is ``"gemv"``."""
    if not x.is_cuda or not K or not usable(x):
        return False
    M = x.numel() // K
    return M > 0 and choice(M, N, K, k, x.device).kernel == "gemv"


# ------------------------------------------------------------------------------------------------ canonical


def linear(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K, bias=None,
           mma: bool = True) -> torch.Tensor:
    """``x @ W.T (+ bias)`` on canonical weight tensors through the kernel :func:`choice` picks for x's GPU (a
    float32 x on a GPU: :func:`dequant_mm` in float32, correct but not fast: decode in bf16); the float32 reference on
    the CPU. ``mma=False``: choose as if the CUDA small-M kernels did not exist (the table's
    choice; ``kbit.nn.KbitLinear`` in the canonical layout uses it rather than caching a repacked copy)."""
    if not x.is_cuda or options.get().backend == "torch":
        check_linear(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
        return cpu_linear(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                          scale_format=scale_format, N=N, K=K, bias=bias, cache=x.is_cpu)
    kw = dict(k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K, bias=bias)
    if x.dtype == torch.float32:  # every CUDA GEMV / GEMM kernel reads 16-bit x: W dequantized to float32, cuBLAS
        return dequant_mm(x, codes, scales, tensor_scale, codebook, **kw)
    M = x.numel() // K if K else 0
    ch = choice(M, N, K, k, x.device) if mma else gemm_choice(M, N, K, k, x.device)
    if ch.kernel == "gemv":
        if mma:
            return small_m(x, codes, scales, tensor_scale, codebook, **kw)
        return gemv.gemv(x, codes, scales, tensor_scale, codebook, **kw)
    if ch.kernel == "dequant_mm":
        return dequant_mm(x, codes, scales, tensor_scale, codebook, **kw)
    return gemm.gemm_fused(x, codes, scales, tensor_scale, codebook, config=ch.config, **kw)


#: weights the CPU path dequantized (float32 or bfloat16: :func:`cpu_product_dtype`), per weight (keyed by the
#: quantized tensors' identity and version, held weakly: an entry goes with its ``codes``, and a buffer replaced or
#: changed in place is not served again)
CPU_WEIGHTS = TensorCache(max_entries=4096)


def cpu_product_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype the CPU path multiplies in for inputs of ``x_dtype``: bfloat16 for bfloat16 (oneDNN's bf16 GEMM
    accumulates in float32 and reads half the bytes: 1.9-2.5x faster than float32 at M = 1..512 on an AVX512-BF16
    CPU, ``docs/notes``), else float32 (float16 GEMM on the CPU measured 1.1-4.8x slower than float32 from M = 4)."""
    return torch.bfloat16 if x_dtype == torch.bfloat16 else torch.float32


def _cpu_key(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, mma_v1, dtype) -> tuple:
    return (codes, scales, tensor_scale, codebook), (k, blocksize, scale_format, N, K, mma_v1, dtype)


def kept_cpu_weight(codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                    mma_v1: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """The ``dtype`` weight :func:`cpu_weight` keeps for these tensors, or None (not kept, or kept no longer)."""
    return CPU_WEIGHTS.get(*_cpu_key(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, mma_v1,
                                     dtype))


def cpu_weight(codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
               mma_v1: bool = False, cache: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W [N, K]`` in ``dtype`` of canonical tensors (``mma_v1``: of tensors in layout "mma-v1"), dequantized by
    the reference in float32 (bit-exact), rounded to ``dtype``, and kept in :data:`CPU_WEIGHTS` while the tensors
    are unchanged (``cache``). Tensors made under ``torch.inference_mode`` carry no version counter: their
    weight is never kept."""
    parts, extra = _cpu_key(codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, mma_v1, dtype)
    w = None
    if cache:
        try:
            w = CPU_WEIGHTS.get(parts, extra)
        except RuntimeError:  # an inference tensor (no version counter) at the id of a kept one
            cache = False
    if w is None:
        if mma_v1:
            codes, scales = unrepack(codes, scales, k=k, blocksize=blocksize, N=N, K=K)
        qw = KbitWeight(codes, scales, tensor_scale, codebook, (N, K), k, blocksize, scale_format)
        w = dequantize_reference(qw, torch.float32).to(dtype)
        if cache and not any(t.is_inference() for t in parts):
            CPU_WEIGHTS.put(parts, extra, w)
    return w


def cpu_linear(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K, bias=None,
               mma_v1: bool = False, cache: bool = True) -> torch.Tensor:
    """The CPU path: ``x @ W.T (+ bias)`` with W from :func:`cpu_weight`, the product in
    :func:`cpu_product_dtype` (float32: the numbers of ``kbit.ops.reference.linear_tensors_reference``; bfloat16
    for bfloat16 x, with float32 accumulation, as the CUDA kernels), the result in x's dtype. The arguments are
    taken as checked (:func:`linear` checks them). Holding W costs 4 (bfloat16: 2) bytes a weight beside the
    k-bit tensors while they live (``cache=False``, or ``CPU_WEIGHTS.clear()``, gives it back), in exchange for
    no dequantization per call: a decode step then costs what it costs an ``nn.Linear`` in that dtype."""
    dt = cpu_product_dtype(x.dtype)
    w = cpu_weight(codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format, N=N,
                   K=K, mma_v1=mma_v1, cache=cache, dtype=dt)
    # no .to() where the dtype is right already: a call costs ~1 us even then
    y = F.linear(x if x.dtype == dt else x.to(dt), w, bias if bias is None or bias.dtype == dt else bias.to(dt))
    return y if y.dtype == x.dtype else y.to(x.dtype)


def dequant_mm(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
               bias=None):
    """Dequantize W to x's dtype (``kbit.ops.dequant``, one pass), then cuBLAS ``F.linear``: for large M, where
    decoding once per weight beats decoding once per M tile."""
    check_linear(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    w = dequantize_tensors(codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize,
                           scale_format=scale_format, shape=(N, K), dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def small_m(x, codes, scales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K, bias=None,
            config=None):
    """Small-M ``x @ W.T (+ bias)`` on canonical weight tensors (``kbit.gemv``): the CUDA kernels where they can
    run (on a repacked copy cached per weight, ``kbit.ops.mma.layout.repacked``), else the Triton GEMV.
    ``config``: a ``kbit.tuning.gemv.GemvConfig`` pins the Triton GEMV; an ``MmaConfig`` / ``LargeConfig`` the
    CUDA kernels."""
    check_dense(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    if bias is not None:
        bias = bias.contiguous()
    if (config is None or not isinstance(config, gemv.GemvConfig)) and usable(x):
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], N)
        rc, rs = repacked(codes, scales, k=k, blocksize=blocksize, scale_format=scale_format, N=N, K=K)
        if config is None:
            y = fast_linear(x, rc, rs, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format,
                            N=N, K=K, bias=bias)
            if y is not None:
                return y
        return gemv_mma.run_repacked(x, rc, rs, tensor_scale, codebook, k=k, blocksize=blocksize,
                                     scale_format=scale_format, N=N, K=K, bias=bias, config=config)
    triton_config = config if isinstance(config, gemv.GemvConfig) else None  # a CUDA config does not apply here
    return gemv.gemv(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format,
                     N=N, K=K, bias=bias, config=triton_config)


# ------------------------------------------------------------------------------------------------ layout "mma-v1"

_PREPARED: dict = {}  # fast_linear's launchers by signature
gemv_mma.PLANS.on_clear(_PREPARED.clear)  # they hold plans


def fast_linear(x, rcodes, rscales, tensor_scale, codebook, *, k, blocksize, scale_format, N, K, bias=None):
    """``kbit.ops.gemv_mma.linear_repacked`` through a launcher prepared once per signature (x's shape, strides,
    dtype and device, the weights' addresses and format, the deterministic mode; ``prepare_repacked``) where
    :func:`serves` says the small-M kernels serve it, else None (the caller takes the general path). The weights are
    read through their addresses at each launch, so tensors updated in place are seen; new tensors change the
    signature."""
    key = (x.shape, x.stride(), x.dtype, x.get_device(), rcodes.data_ptr(), rscales.data_ptr(),
           tensor_scale.data_ptr(), codebook.data_ptr(), 0 if bias is None else bias.data_ptr(),
           None if bias is None else bias.dtype, k, blocksize, scale_format, N, K, rcodes.shape, rscales.shape,
           deterministic())
    run = _PREPARED.get(key)
    if run is None:
        if torch.cuda.is_current_stream_capturing():  # building may allocate (workspace) and compile
            return None
        check_repacked(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
        run = serves(x, N, K, k) and gemv_mma.prepare_repacked(
            x, rcodes, rscales, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format, N=N,
            K=K, bias=bias)
        run = run or False
        if len(_PREPARED) >= 1024:
            _PREPARED.clear()
        _PREPARED[key] = run
    return run(x) if run else None


def linear_mma_v1(x, rcodes, rscales, tensor_scale, codebook, *, k, blocksize=32, scale_format="log8", N, K,
                  bias=None):
    """:func:`linear` (any M) on a weight held in layout "mma-v1": the small-M kernels where :func:`serves`
    (prepared launches first: :func:`fast_linear`); where the choice is dequantize + cuBLAS,
    ``kbit.ops.gemv_mma.dequant_repacked`` then ``F.linear``; else an unrepacked temporary (freed after the call)
    through :func:`linear` (fused GEMM, Triton GEMV); on the CPU :func:`cpu_linear` (its weight kept per
    repacked weight)."""
    if x.is_cuda:
        y = fast_linear(x, rcodes, rscales, tensor_scale, codebook, k=k, blocksize=blocksize,
                        scale_format=scale_format, N=N, K=K, bias=bias)
        if y is not None:
            return y
    if serves(x, N, K, k):
        return gemv_mma.linear_repacked(x, rcodes, rscales, tensor_scale, codebook, k=k, blocksize=blocksize,
                                        scale_format=scale_format, N=N, K=K, bias=bias)
    check_repacked(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    if not x.is_cuda or options.get().backend == "torch":
        check_not_meta("x", x)
        return cpu_linear(x, rcodes, rscales, tensor_scale, codebook, k=k, blocksize=blocksize,
                          scale_format=scale_format, N=N, K=K, bias=bias, mma_v1=True, cache=x.is_cpu)
    if (x.is_cuda and x.dtype in _X16 and kernels_available(x.device)
            and choice(x.numel() // K if K else 0, N, K, k, x.device).kernel == "dequant_mm"):
        w = gemv_mma.dequant_repacked(rcodes, rscales, tensor_scale, codebook, k=k, blocksize=blocksize,
                                      scale_format=scale_format, N=N, K=K, dtype=x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    codes, scales = unrepack(rcodes, rscales, k=k, blocksize=blocksize, N=N, K=K)
    return linear(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format,
                  N=N, K=K, bias=bias)


# ------------------------------------------------------------------------------------------------ torch ops


def _fake(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias=None):
    check_linear(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    return x.new_empty(*x.shape[:-1], N)


def _fake_mma_v1(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias=None):
    check_repacked(x, rcodes, rscales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)
    check_not_meta("x", x)
    return x.new_empty(*x.shape[:-1], N)


def _register(name: str, fn, fake=_fake):
    """``torch.ops.kbit.<name>(x, codes, scales, tensor_scale, codebook, k, blocksize, scale_format, N, K, bias)``
    calling ``fn`` with keywords, and its fake implementation."""

    def impl(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
             codebook: torch.Tensor, k: int, blocksize: int, scale_format: str, N: int, K: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        return fn(x, codes, scales, tensor_scale, codebook, k=k, blocksize=blocksize, scale_format=scale_format,
                  N=N, K=K, bias=bias)

    op = torch.library.custom_op(f"kbit::{name}", impl, mutates_args=())
    op.register_fake(fake)
    return op


_register("linear", linear)
_register("linear_mma_v1", linear_mma_v1, _fake_mma_v1)
_register("gemv", small_m)
_register("linear_small_m", small_m)


def _wargs(x, weight, bias) -> tuple:
    """The op's arguments after ``x``: types first (the op's schema would refuse others in its own words)."""
    if not isinstance(x, torch.Tensor):
        fail(TypeError, "x", "a torch.Tensor", type(x).__name__)
    if bias is not None and not isinstance(bias, torch.Tensor):
        fail(TypeError, "bias", "a torch.Tensor or None", type(bias).__name__)
    if not isinstance(weight, KbitWeight):
        fail(TypeError, "weight", "a KbitWeight (from kbit.quantize)", type(weight).__name__)
    if len(weight.shape) != 2:
        fail(ValueError, "weight", "a 2-D KbitWeight [N, K]", f"shape {weight.shape}")
    return (x, weight.codes, weight.scales, weight.tensor_scale, weight.codebook, weight.k, weight.blocksize,
            weight.scale_format, weight.shape[-2], weight.shape[-1], bias)


def kbit_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatched ``x @ W.T (+ bias)`` on a 2-D :class:`~kbit.format.KbitWeight` (``torch.ops.kbit.linear``).

    ``x [..., K]`` floating point (float16/bfloat16 on CUDA), ``bias [N]`` or None, all on the weight's device;
    anything else is a ``TypeError`` / ``ValueError`` naming the argument. On the CPU the float32 weight is kept
    while the weight's tensors live and are unchanged (:data:`CPU_WEIGHTS`; ``CPU_WEIGHTS.clear()`` frees it)."""
    return torch.ops.kbit.linear(*_wargs(x, weight, bias))


def kbit_gemv(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Small-M ``x @ W.T (+ bias)`` on a 2-D :class:`~kbit.format.KbitWeight` (``torch.ops.kbit.gemv``)."""
    return torch.ops.kbit.gemv(*_wargs(x, weight, bias))


def kbit_linear_small_m(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a 2-D ``KbitWeight`` through ``torch.ops.kbit.linear_small_m``."""
    return torch.ops.kbit.linear_small_m(*_wargs(x, weight, bias))

"""The kbit weight format (docs/format.md), and :class:`KbitWeight`, the one quantized-weight class.

Format version 2 keeps the tensor layout of version 1 and adds checksums and a validated schema to the files
(:mod:`kbit.format.serialize`), and an optional :class:`Rotation` of the input dimension K (the weight stored is
``W R``; a layer multiplies its input by the same ``R``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kbit.format.pack import words_per_row
from kbit.utils.checks import check_int, fail

FORMAT_VERSION = 2
K_VALUES = (2, 3, 4, 5)
BLOCKSIZES = (32, 64, 128)
SCALE_FORMATS = ("log8", "fp16")
DEFAULT_K = 4
DEFAULT_BLOCKSIZE = 32
DEFAULT_SCALE_FORMAT = "log8"

#: log8 scales: 1/16-octave steps below the matrix maximum; q == ZERO_BLOCK marks an all-zero block.
LOG8_STEPS_PER_OCTAVE = 16
ZERO_BLOCK = 255


@functools.cache
def _log8_tables_cpu() -> tuple[torch.Tensor, torch.Tensor]:
    j = torch.arange(ZERO_BLOCK - 1, dtype=torch.float64)
    thresholds = torch.exp2(-(j + 0.5) / LOG8_STEPS_PER_OCTAVE).to(torch.float32)  # descending, 254 values
    q = torch.arange(256, dtype=torch.float64)
    values = torch.exp2(-q / LOG8_STEPS_PER_OCTAVE).to(torch.float32)
    values[ZERO_BLOCK] = 0.0
    return thresholds, values


def log8_thresholds(device=None) -> torch.Tensor:
    """``T[j] = float32(2**(-(j + 0.5)/16))``, j = 0..253: q = #{j : absmax/tensor_scale < T[j]}."""
    return _log8_tables_cpu()[0].to(device)


def log8_values(device=None) -> torch.Tensor:
    """``E[q] = float32(2**(-q/16))``, ``E[255] = 0``: the scale of a block relative to tensor_scale."""
    return _log8_tables_cpu()[1].to(device)


def check_k(k) -> int:
    """``k`` is one of K_VALUES; returns it."""
    if isinstance(k, bool) or not isinstance(k, int):
        fail(TypeError, "k", f"an int in {K_VALUES}", type(k).__name__)
    if k not in K_VALUES:
        fail(ValueError, "k", f"one of {K_VALUES}", k)
    return k


def check_blocksize(blocksize) -> int:
    """``blocksize`` is one of BLOCKSIZES; returns it."""
    if isinstance(blocksize, bool) or not isinstance(blocksize, int):
        fail(TypeError, "blocksize", f"an int in {BLOCKSIZES}", type(blocksize).__name__)
    if blocksize not in BLOCKSIZES:
        fail(ValueError, "blocksize", f"one of {BLOCKSIZES}", blocksize)
    return blocksize


def check_scale_format(scale_format) -> str:
    """``scale_format`` is one of SCALE_FORMATS; returns it."""
    if scale_format not in SCALE_FORMATS:
        fail(ValueError, "scale_format", f"one of {SCALE_FORMATS}", repr(scale_format))
    return scale_format


def padded_k(K: int, blocksize: int) -> int:
    return -(-K // blocksize) * blocksize


#: rotation kinds a weight may record
ROTATION_KINDS = ("hadamard",)
#: the largest Walsh-Hadamard block: the online transform holds one block per program (16384 fp32 = 64 KiB)
MAX_ROTATION_BLOCK = 16384
#: seeds are non-negative and fit a signed 64-bit int (torch.Generator.manual_seed takes them all)
MAX_ROTATION_SEED = 2**63 - 1


def rotation_block(K: int, max_block: int = MAX_ROTATION_BLOCK) -> int:
    """The block of a Hadamard rotation along ``K``: the largest power of two dividing K, at most ``max_block``
    (K = 11008 = 2**8 * 43 -> 256, 14336 -> 2048, 4096 -> 4096; an odd K -> 1, random signs only)."""
    check_int("K", K, minimum=1)
    check_int("max_block", max_block, minimum=1)
    b = K & -K
    while b > max_block:
        b //= 2
    return b


@dataclass(frozen=True)
class Rotation:
    """A randomized Hadamard rotation of the input dimension: ``R = diag(signs) @ blockdiag(H_b, ..., H_b)``
    (``R [K, K]``, orthogonal; ``H_b`` the Sylvester Walsh-Hadamard matrix of order ``block`` times
    ``1/sqrt(block)``). A weight stored with a rotation holds ``W R``, so ``y = (x R) (W R)^T = x W^T``.

    ``signs`` are ``torch.randint(0, 2, (K,), generator=torch.Generator().manual_seed(seed)) * 2 - 1``: one int
    stores them, for any K (the rule of ``kbit.calibrate.rotation.RandomHadamard``, so a weight rotated there is
    undone by :func:`kbit.ops.hadamard.rotate`). ``block`` is a power of two dividing K, at most
    MAX_ROTATION_BLOCK; :meth:`for_width` picks the largest (:func:`rotation_block`).
    """

    seed: int = 0
    block: int = 1
    kind: str = "hadamard"

    def __post_init__(self):
        if self.kind not in ROTATION_KINDS:
            fail(ValueError, "kind", f"one of {ROTATION_KINDS}", repr(self.kind))
        check_int("seed", self.seed, minimum=0, maximum=MAX_ROTATION_SEED)
        check_int("block", self.block, minimum=1, maximum=MAX_ROTATION_BLOCK)
        if self.block & (self.block - 1):
            fail(ValueError, "block", "a power of two", self.block)

    @classmethod
    def for_width(cls, K: int, seed: int = 0, max_block: int = MAX_ROTATION_BLOCK) -> Rotation:
        """The rotation of an input width ``K`` in the largest block the rule allows."""
        return cls(seed=seed, block=rotation_block(K, max_block))

    def check_width(self, K: int, name: str = "K") -> None:
        """ValueError unless ``block`` divides ``K``."""
        if K % self.block:
            fail(ValueError, name, f"a multiple of the rotation block {self.block}", K)

    def signs(self, K: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
        """The ``K`` random signs (+1/-1), made on the CPU from ``seed`` (a host computation: cache the result)."""
        g = torch.Generator().manual_seed(self.seed)
        s = torch.randint(0, 2, (K,), generator=g, dtype=torch.int64) * 2 - 1
        return s.to(device=device, dtype=dtype)

    def matrix(self, K: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
        """``R [K, K]`` itself (dense: for tests and references)."""
        self.check_width(K)
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < self.block:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = h / self.block ** 0.5
        R = self.signs(K)[:, None] * torch.block_diag(*([h] * (K // self.block)))
        return R.to(device=device, dtype=dtype)

    def metadata(self) -> dict:
        return {"kind": self.kind, "seed": self.seed, "block": self.block}


@dataclass(eq=False)
class KbitWeight:
    """A quantized weight ``W[..., N, K]`` in the canonical layout (the same in format versions 1 and 2).

    Attributes
    ----------
    codes : int32 ``[..., N, Kp * k / 32]``, bit-plane packed codes (Kp = K padded to whole blocks).
    scales : uint8 (``log8``) or float16 (``fp16``) ``[..., N, Kp / blocksize]``.
    tensor_scale : float32 ``[...]``, one per matrix (the matrix absmax for ``log8``; 1 for ``fp16``).
    codebook : float32 ``[2**k]``, sorted levels in [-1, 1].
    shape : the logical shape ``(..., N, K)``.
    k, blocksize, scale_format : format parameters.
    codebook_name : the name the codebook was made from, or ``"custom"``.
    rotation : None (the weight is ``W``), or the :class:`Rotation` the weight was quantized under (it holds
        ``W R``, and a layer must multiply its input by ``R``: :func:`kbit.ops.hadamard.rotate`).

    The constructor checks dtypes, shapes and devices (:meth:`validate`); where the tensors are on the CPU (and
    not while ``torch.compile`` traces) it also checks the values (:meth:`check_values`). On a GPU that check
    would read the tensors back to the host, a sync on every construction (``KbitWeight.to``, ``qw[e]``, the
    layers' ``weight()``), so it is left out there: :func:`kbit.load_file` checks on the CPU before moving, and
    ``check_values()`` may be called on any device.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor
    codebook: torch.Tensor
    shape: tuple[int, ...]
    k: int
    blocksize: int
    scale_format: str = DEFAULT_SCALE_FORMAT
    codebook_name: str = "custom"
    rotation: Rotation | None = None

    def __post_init__(self):
        self.shape = tuple(int(s) for s in self.shape)
        self.validate()
        if self.codes.device.type == "cpu" and not torch.compiler.is_compiling():
            self.check_values()

    # -- derived ---------------------------------------------------------------------------------------
    @property
    def N(self) -> int:
        return self.shape[-2]

    @property
    def K(self) -> int:
        return self.shape[-1]

    @property
    def padded_k(self) -> int:
        return padded_k(self.K, self.blocksize)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors: codes, scales, tensor scales and the codebook."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def bits_per_weight(self) -> float:
        """Storage per logical weight: codes (with K padding), block scales and tensor scales.

        The codebook (``2**k`` float32, at most 128 bytes per tensor) is left out; ``nbytes`` counts it.
        """
        return 8 * (self.nbytes - self.codebook.numel() * 4) / self.numel

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "codes": self.codes,
            "scales": self.scales,
            "tensor_scale": self.tensor_scale,
            "codebook": self.codebook,
        }

    def to(self, device=None, non_blocking: bool = False) -> KbitWeight:
        """A copy on ``device`` (dtypes never change)."""
        moved = {n: t.to(device=device, non_blocking=non_blocking) for n, t in self.tensors().items()}
        return KbitWeight(**moved, shape=self.shape, k=self.k, blocksize=self.blocksize,
                          scale_format=self.scale_format, codebook_name=self.codebook_name, rotation=self.rotation)

    def cuda(self) -> KbitWeight:
        return self.to("cuda")

    def cpu(self) -> KbitWeight:
        return self.to("cpu")

    def __getitem__(self, index) -> KbitWeight:
        """Select matrices of a stack (``qw[e]`` is expert e's weight); only leading dims can be indexed."""
        if len(self.shape) < 3:
            raise IndexError("only a stacked KbitWeight [..., N, K] with leading dimensions can be indexed")
        ts = self.tensor_scale[index]
        codes, scales = self.codes[index], self.scales[index]
        shape = tuple(ts.shape) + self.shape[-2:]
        return KbitWeight(codes, scales, ts, self.codebook, shape, self.k, self.blocksize,
                          self.scale_format, self.codebook_name, self.rotation)

    def metadata(self) -> dict:
        """The weight's entry in a file's ``kbit.weights`` (``rotation`` only where there is one)."""
        out = {"k": self.k, "blocksize": self.blocksize, "shape": list(self.shape),
               "scale_format": self.scale_format, "codebook": self.codebook_name}
        if self.rotation is not None:
            out["rotation"] = self.rotation.metadata()
        return out

    def __repr__(self) -> str:
        rot = "" if self.rotation is None else f"rotation={self.rotation!r}, "
        return (f"KbitWeight(shape={self.shape}, k={self.k}, blocksize={self.blocksize}, "
                f"scale_format={self.scale_format!r}, codebook={self.codebook_name!r}, {rot}"
                f"bits_per_weight={self.bits_per_weight:.4f}, device={self.device})")

    # -- invariants ------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check dtypes, shapes and devices of the tensors against the parameters; ValueError if off."""
        check_k(self.k)
        check_blocksize(self.blocksize)
        check_scale_format(self.scale_format)
        if len(self.shape) < 2 or min(self.shape) < 1:
            fail(ValueError, "shape", "(..., N, K) with every dimension >= 1", self.shape)
        if self.rotation is not None:
            if not isinstance(self.rotation, Rotation):
                fail(TypeError, "rotation", "None or a kbit.format.Rotation", type(self.rotation).__name__)
            self.rotation.check_width(self.K, "shape[-1] (K)")
        lead = self.shape[:-2]
        kp = self.padded_k
        expect = {
            "codes": (torch.int32, lead + (self.N, words_per_row(self.k, kp))),
            "scales": (torch.uint8 if self.scale_format == "log8" else torch.float16,
                       lead + (self.N, kp // self.blocksize)),
            "tensor_scale": (torch.float32, lead),
            "codebook": (torch.float32, (2**self.k,)),
        }
        for name, t in self.tensors().items():
            if not isinstance(t, torch.Tensor):
                fail(TypeError, name, "a torch.Tensor", type(t).__name__)
            dtype, shape = expect[name]
            if t.dtype != dtype:
                fail(ValueError, name, f"dtype {dtype}", t.dtype)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape} for weight shape {self.shape}, k={self.k}, "
                                 f"blocksize={self.blocksize}, got {tuple(t.shape)}")
            if t.device != self.codes.device:
                fail(ValueError, name, f"device {self.codes.device} (that of codes)", t.device)

    def check_values(self) -> None:
        """Check the values: a finite codebook, finite ``tensor_scale`` >= 0 (0 is an all-zero matrix) and, for
        ``fp16``, finite scales >= 0; ValueError naming the field. Reads the tensors on the host (a sync on a GPU).

        Nothing else can be out of range: every uint8 is a valid ``log8`` code (``E[q]`` is finite, in [0, 1]) and
        every bit pattern of the packed words decodes to a code in [0, 2**k)."""
        _check_finite("codebook", self.codebook, nonnegative=False)
        _check_finite("tensor_scale", self.tensor_scale, nonnegative=True)
        if self.scale_format == "fp16":
            _check_finite("scales", self.scales, nonnegative=True)


def _check_finite(name: str, t: torch.Tensor, nonnegative: bool) -> None:
    if t.dtype == torch.float16 and nonnegative and t.numel():
        # the common case, all valid (bits in [0, 0x7C00)), from numpy's min/max of the bits: torch's CPU float16
        # ops are ~50x slower; the exact search below runs only where something is off (or a -0.0)
        bits = t.detach().reshape(-1).view(torch.int16).numpy()
        if int(bits.min()) >= 0 and int(bits.max()) < 0x7C00:
            return
    bad = ~torch.isfinite(t)
    if nonnegative:
        bad |= t < 0
    if bool(bad.any()):
        i = int(torch.nonzero(bad.reshape(-1))[0])
        where = f" at index {tuple(int(j) for j in torch.unravel_index(torch.tensor(i), t.shape))}" if t.dim() else ""
        fail(ValueError, name, "finite values" + (" >= 0" if nonnegative else ""), f"{t.reshape(-1)[i].item()}{where}")

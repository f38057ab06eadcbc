"""``KbitConfig``: how to quantize a transformers model while loading it, and the ``quantization_config`` that
``config.json`` of a kbit checkpoint holds. A ``transformers`` ``QuantizationConfigMixin`` when transformers is
installed (registered by :mod:`kbit.hf.quantizer`), a plain config otherwise.
"""

from __future__ import annotations

import inspect
import warnings
from collections import Counter

from kbit.format.codebooks import NAMED
from kbit.format.spec import DEFAULT_BLOCKSIZE, DEFAULT_SCALE_FORMAT, check_blocksize, check_k, check_scale_format
from kbit.utils.checks import check_int, check_regex, fail

QUANT_METHOD = "kbit"
OVERRIDE_KEYS = ("k", "blocksize", "codebook", "scale_format", "rotation", "skip")
#: ``rotation=`` by name (``kbit.ops.quantize.ROTATIONS``; the config is JSON)
ROTATIONS = ("hadamard",)

try:  # transformers is optional (kbit[hf]): without it KbitConfig is a plain config
    from transformers.utils.quantization_config import QuantizationConfigMixin
except ImportError:
    QuantizationConfigMixin = object


class KbitConfig(QuantizationConfigMixin):
    """How to quantize a transformers model while loading it (``from_pretrained(..., quantization_config=)``).

    Parameters
    ----------
    k, blocksize, codebook, scale_format : the format of every quantized weight (``kbit.quantize``); codebook
        is ``None`` (the default for k) or a name (``"nf"``, ``"nf0"``, ``"uniform"``, ``"lloyd"``,
        ``"lloyd0"``, ``"fit"``).
    modules_to_not_convert : module-name patterns kept in float (regexes matched at the end of a name).
    overrides : ``{pattern: {"k": 5, "blocksize": ..., "codebook": ..., "scale_format": ...} or None}`` per
        module, as :func:`kbit.quantize_model`'s ``overrides`` (``None`` keeps the modules in float).
    quantize_lm_head : also quantize ``lm_head`` (with the base format unless an override says otherwise).
    joint : quantize q/k/v and gate/up of one layer as one matrix (:func:`kbit.quantize_model`).
    rotation : ``None`` or ``"hadamard"``: weights quantized rotated along K (:func:`kbit.quantize_model`);
        ``rotation_seed`` the seed of the random signs.
    calibration : ``None``, or where the calibrated rounding's text came from (a file path or a description):
        recorded in ``config.json``. Quantizing while loading (``from_pretrained(quantization_config=...)``)
        cannot calibrate (the quantizer sees the weights, not text or a tokenizer) and refuses it: quantize with
        ``kbit.quantize_model(model, calibration=...)`` or ``kbit quantize --calibrate`` and save.
    modules : filled by kbit: each quantized module's format, written to ``config.json`` so the saved model
        loads into empty k-bit modules. Leave it ``None``.
    """

    def __init__(self, k: int = 4, blocksize: int = DEFAULT_BLOCKSIZE, codebook: str | None = None,
                 scale_format: str = DEFAULT_SCALE_FORMAT, modules_to_not_convert=None, overrides=None,
                 quantize_lm_head: bool = False, joint: bool = True, modules: dict | None = None,
                 rotation: str | None = None, rotation_seed: int = 0, calibration: str | None = None, **kwargs):
        method = kwargs.pop("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            fail(ValueError, "quant_method", repr(QUANT_METHOD), repr(method))
        self.quant_method = QUANT_METHOD
        self.k = check_k(k)
        self.blocksize = check_blocksize(blocksize)
        self.scale_format = check_scale_format(scale_format)
        if codebook is not None and codebook not in NAMED:
            fail(ValueError, "codebook", f"None or one of {NAMED} (a name: the config is JSON)", repr(codebook))
        self.codebook = codebook
        skip = [] if modules_to_not_convert is None else modules_to_not_convert
        if isinstance(skip, str) or not all(isinstance(p, str) for p in skip):
            fail(TypeError, "modules_to_not_convert", "a list of module-name patterns", repr(skip))
        for i, pattern in enumerate(skip):
            check_regex(f"modules_to_not_convert[{i}]", pattern)
        self.modules_to_not_convert = list(skip)
        if overrides is not None and not isinstance(overrides, dict):
            fail(TypeError, "overrides", "a dict {pattern: {'k': ..., ...} or None}", type(overrides).__name__)
        for pattern, opts in (overrides or {}).items():
            where = f"overrides[{pattern!r}]"
            if not isinstance(pattern, str) or not (opts is None or isinstance(opts, dict)):
                fail(TypeError, where, "a pattern string -> a dict or None", f"{type(pattern).__name__} -> "
                     f"{type(opts).__name__}")
            if opts is not None and (set(opts) - set(OVERRIDE_KEYS) or not isinstance(opts.get("codebook", ""), str)):
                fail(ValueError, where, f"keys among {OVERRIDE_KEYS} (a codebook by name: the config is JSON)", opts)
            check_regex(f"{where}: the key", pattern)
        self.overrides = dict(overrides or {})
        for name, v in (("quantize_lm_head", quantize_lm_head), ("joint", joint)):
            if not isinstance(v, bool):
                fail(TypeError, name, "a bool", type(v).__name__)
        self.quantize_lm_head, self.joint = quantize_lm_head, joint
        if rotation is not None and rotation not in ROTATIONS:
            fail(ValueError, "rotation", f"None or one of {ROTATIONS}", repr(rotation))
        self.rotation, self.rotation_seed = rotation, check_int("rotation_seed", rotation_seed, minimum=0)
        if calibration is not None and not isinstance(calibration, str):
            fail(TypeError, "calibration", "None or a str (the text's file or a description: the config is JSON)",
                 type(calibration).__name__)
        self.calibration = calibration
        self.modules = modules
        unknown = sorted(key for key in kwargs if not key.startswith("_"))
        if unknown:  # a misspelt argument (bits=2) would otherwise leave the default in force
            fail(TypeError, "KbitConfig", f"arguments among {CONFIG_FIELDS}", unknown)
        for key in kwargs:  # private keys (a leading underscore) pass through config.json as they came
            setattr(self, key, kwargs[key])

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        """From a ``quantization_config`` dict (``config.json``): keys that are not :class:`KbitConfig`'s (a
        checkpoint written by another kbit version) are left out with a warning instead of failing the load."""
        known, unknown = split_fields(config_dict)
        if unknown:
            warnings.warn(f"quantization_config: keys {unknown} are not KbitConfig's (written by another kbit "
                          "version?); ignored", stacklevel=2)
        if QuantizationConfigMixin is object:
            config = cls(**known)
            return (config, kwargs) if return_unused_kwargs else config
        return super().from_dict(known, return_unused_kwargs=return_unused_kwargs, **kwargs)

    def quantize_kwargs(self) -> dict:
        """The arguments of :func:`kbit.quantize_model` this config stands for."""
        overrides = {r"lm_head": {}} if self.quantize_lm_head else {}
        overrides |= self.overrides
        overrides |= dict.fromkeys(self.modules_to_not_convert)  # kept in float: last, so they win
        return {"k": self.k, "blocksize": self.blocksize, "codebook": self.codebook,
                "scale_format": self.scale_format, "overrides": overrides or None, "joint": self.joint,
                "rotation": self.rotation, "seed": self.rotation_seed}

    def to_dict(self) -> dict:
        return {key: v for key, v in self.__dict__.items() if not key.startswith("_")}


#: the argument names of :class:`KbitConfig` (``quant_method`` too)
CONFIG_FIELDS = ("quant_method", *(n for n in inspect.signature(KbitConfig.__init__).parameters
                                   if n not in ("self", "kwargs")))


def split_fields(config_dict: dict) -> tuple[dict, list[str]]:
    """(the items of ``config_dict`` that :class:`KbitConfig` takes, the names of the others); names with a
    leading underscore are taken."""
    known = {key: v for key, v in config_dict.items() if key in CONFIG_FIELDS or key.startswith("_")}
    return known, sorted(key for key in config_dict if key not in known)


def quantization_config_for(model, table: dict) -> dict:
    """The ``quantization_config`` of a quantized ``model`` (``config.json``): its :class:`KbitConfig` settings
    where it was loaded with one, else the most common format of ``table`` (``rotation`` ``"hadamard"`` where
    most modules are rotated, with their most common seed); ``modules`` = ``table``."""
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if isinstance(qc, KbitConfig):
        qc = qc.to_dict()
    if not (isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD):
        common = Counter((m["k"], m["blocksize"], m["scale_format"]) for m in table.values()).most_common(1)[0][0]
        qc = {"k": common[0], "blocksize": common[1], "scale_format": common[2]}
        seeds = Counter(m["rotation"]["seed"] if m.get("rotation") else None for m in table.values()).most_common(1)
        if seeds[0][0] is not None:
            qc |= {"rotation": "hadamard", "rotation_seed": seeds[0][0]}
    out = KbitConfig(**{key: v for key, v in split_fields(qc)[0].items() if key != "modules"}, modules=table).to_dict()
    return out

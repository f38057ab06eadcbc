"""transformers integration: :class:`KbitConfig` and its quantizer, registered through transformers' public
registry (``register_quantization_config`` / ``register_quantizer``) when ``kbit`` is imported, so that

>>> model = AutoModelForCausalLM.from_pretrained(path, quantization_config=kbit.KbitConfig(k=4),
...                                              device_map="cuda")  # doctest: +SKIP
>>> model.save_pretrained(out)  # doctest: +SKIP
>>> AutoModelForCausalLM.from_pretrained(out)  # doctest: +SKIP

quantize while loading, save, and load back bit-exact (``docs/hf.md``). ``KbitConfig(rotation="hadamard")``
quantizes rotated weights; ``KbitConfig(calibration=...)`` is refused here (calibrated rounding needs text and a
model pass: :func:`kbit.quantize_model`).

Quantizing while loading: transformers reads the float checkpoint onto the CPU (the quantizer redirects the
device map there), then :func:`kbit.quantize_model` quantizes module by module on the requested device: each
float weight is copied there, quantized and dropped, so that device holds the k-bit model plus one float weight
(or one q/k/v group) at a time; the unquantized parts (embeddings, norms, routers, ``lm_head``) move last.

Loading a saved model: the empty model gets empty k-bit modules (:func:`kbit.hf.checkpoint.build_shells`, from
``quantization_config.modules``) before transformers fills them from the files like any other buffers.

transformers is optional: without it :class:`~kbit.hf.config.KbitConfig` still exists (a plain config) and
nothing registers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kbit.hf.checkpoint import (
    build_shells,
    check_config_sizes,
    module_table,
    quantized_state_dict,
    untie_quantized_head,
)
from kbit.hf.config import QUANT_METHOD, KbitConfig
from kbit.hf.experts import WEIGHTS as EXPERT_WEIGHTS
from kbit.hf.experts import KbitExperts
from kbit.hf.quantize_model import plan, quantize_model
from kbit.hf.tp import apply_kbit_tp, check_heads, check_k_splits, take_kbit_entries, tp_size_of
from kbit.nn import KbitLinear
from kbit.utils.checks import fail

try:  # transformers is optional (kbit[hf]): without it nothing registers
    from transformers.quantizers import auto as _auto
    from transformers.quantizers.base import HfQuantizer
except ImportError:
    _auto = None
    HfQuantizer = object


class KbitHfQuantizer(HfQuantizer):
    """The transformers quantizer of :class:`KbitConfig` (see the module docstring for the memory story)."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.target = None
        #: tensor parallelism (``tp_plan="auto"``): the plan entries kbit shards after loading (kbit.hf.tp)
        self.kbit_tp_plan: dict[str, str] = {}
        self._tp_override = self._tp_device_map = None

    def validate_environment(self, *args, device_map=None, **kwargs):
        devices = set(device_map.values()) if isinstance(device_map, dict) else set()
        if len(devices) > 1 or devices & {"disk"}:
            fail(ValueError, "device_map", "one device (a string, a torch.device or {'': device}) with kbit",
                 device_map)

    def update_device_map(self, device_map):
        if self.pre_quantized:
            if isinstance(device_map, (dict, torch.device)) and dist.is_initialized():
                # transformers' tensor parallel binds this rank's device before the config is seen: a dict that
                # _take_tp_entries can still point at the CPU, so the whole packed weights never reach the GPU
                self._tp_device_map = device_map if isinstance(device_map, dict) else {"": device_map}
                return self._tp_device_map
            return device_map
        if isinstance(device_map, dict):
            device_map = next(iter(device_map.values()), None)
        if device_map == "auto":
            device_map = "cuda" if torch.cuda.is_available() else "cpu"
        self.target = torch.device(device_map if not isinstance(device_map, int) else f"cuda:{device_map}") \
            if device_map is not None else None
        if self.target is None:
            return None
        return {"": "cpu"}  # float weights land on the CPU; quantize_model moves them one at a time

    def update_attn_implementation(self, config):
        """Sees the config before the model is built (transformers >= 5.24): absurd sizes fail here, fast."""
        check_config_sizes(config.to_dict(), {}, "config")
        # a tp_plan dict is merged into the model's plan after _process_model_before_weight_loading: keep the
        # object transformers merges, to take kbit's entries out of it too
        override = getattr(getattr(config, "distributed_config", None), "tp_plan", None)
        self._tp_override = override if isinstance(override, dict) else None
        return super().update_attn_implementation(config)

    def _process_model_before_weight_loading(self, model, **kwargs):
        qc = self.quantization_config
        if self.pre_quantized:
            if not qc.modules:
                fail(ValueError, "quantization_config.modules", "the quantized modules of a kbit checkpoint",
                     qc.modules)
            build_shells(model, qc.modules, "quantization_config")
            # transformers expects every key of model.state_dict() in the files; the modules' extra state (their
            # format) is in quantization_config instead, so hide it while loading
            self._hook = model.register_state_dict_post_hook(_drop_extra_state)
        else:  # on the empty model: an unsupported architecture fails before any weight is read
            if getattr(qc, "calibration", None) is not None:
                fail(ValueError, "KbitConfig.calibration", "None when quantizing while loading (the quantizer sees "
                     "weights, not text or a tokenizer: load the float model, run kbit.quantize_model(model, "
                     "calibration=text, tokenizer=tok) or `kbit quantize --calibrate`, then save)",
                     repr(qc.calibration))
            kw = qc.quantize_kwargs()
            planned = plan(model, kw["k"], kw["blocksize"], kw["codebook"], kw["scale_format"], kw["overrides"],
                           rotation=kw["rotation"])
        self._take_tp_entries(model, qc.modules if self.pre_quantized else planned)
        return model

    def _take_tp_entries(self, model, modules: dict) -> None:
        """Under tensor parallelism, the ``tp_plan`` entries of the k-bit modules move to ``kbit_tp_plan``
        (``kbit.hf.tp``): transformers loads those weights whole, kbit shards them after loading."""
        kinds = {name: info["kind"] for name, info in modules.items()}
        dc = getattr(model.config, "distributed_config", None)
        ep = getattr(dc, "ep_size", None) or (2 if getattr(dc, "enable_expert_parallel", False) else 1)
        if ep > 1 and "experts" in kinds.values():  # its styles would hook experts whose weights load whole
            fail(ValueError, "ep_size", "1 with k-bit experts (transformers' expert parallel shards parameters; "
                 "tp_plan='auto' splits k-bit experts along their intermediate dimension instead)",
                 getattr(dc, "ep_size", None) or "enable_expert_parallel=True")
        tp = tp_size_of(model.config)
        if tp == 1:
            return
        taken = take_kbit_entries(model, model.tp_plan, kinds)
        override = getattr(model.config.distributed_config, "tp_plan", None)  # a copy of the one transformers reads
        if isinstance(override, dict):
            if not override:  # tp_plan={}: no tensor parallel dense layers (expert parallel only)
                return
            if self._tp_override is None:
                if take_kbit_entries(model, dict(override), kinds):
                    # transformers < 5.24 replaces model.tp_plan by the dict after this hook, no earlier hook sees it
                    fail(ValueError, "tp_plan", "'auto' with kbit on this transformers version (or a dict naming "
                         "float modules only)", "a dict naming k-bit modules")
            else:
                taken |= take_kbit_entries(model, self._tp_override, kinds)  # the user's entries win
                if not self._tp_override and model.tp_plan:
                    # transformers reads an empty dict as "no tensor parallel dense layers": one of the plan's own
                    # entries keeps the merge a no-op
                    self._tp_override.update([next(iter(model.tp_plan.items()))])
        check_heads(model.config, taken, tp, max((info["blocksize"] for info in modules.values()), default=0))
        check_k_splits(taken, modules)
        self.kbit_tp_plan = taken
        if self.pre_quantized and self._tp_device_map and set(self._tp_device_map) == {""}:
            # the packed weights are read on the CPU, sharded there, then the model moves (_apply_tp)
            self.target, self._tp_device_map[""] = self._tp_device_map[""], torch.device("cpu")

    def _process_model_after_weight_loading(self, model, **kwargs):
        qc = self.quantization_config
        if self.pre_quantized:
            hook = getattr(self, "_hook", None)
            if hook is not None:
                hook.remove()
            for m in model.modules():  # the KbitWeight invariants of every loaded module
                if isinstance(m, KbitLinear):
                    m.weight()
                elif isinstance(m, KbitExperts):
                    for w in EXPERT_WEIGHTS:
                        m.weight(w)
            self._apply_tp(model)
            return model
        quantize_model(model, progress=False, device=self.target, **qc.quantize_kwargs())
        if self.target is not None:
            model.to(self.target)
            if getattr(model, "hf_device_map", None) is not None:
                model.hf_device_map = {"": str(self.target)}
        untie_quantized_head(model)
        qc.modules = module_table(model)  # the whole model's table (before the shards replace its modules)
        self._apply_tp(model)
        return model

    def _apply_tp(self, model) -> None:
        if not self.kbit_tp_plan:
            return
        apply_kbit_tp(model, self.kbit_tp_plan, tp_size_of(model.config))
        if self.pre_quantized and self.target is not None:
            model.to(self.target)

    def get_state_dict_and_metadata(self, model, *args, **kwargs):
        if self.kbit_tp_plan and tp_size_of(model.config) > 1:  # the shards' keys are not the checkpoint's
            fail(ValueError, "model", "an unsharded kbit model to save_pretrained (save before loading with "
                 "tp_plan, or write a sharded checkpoint with kbit.parallel.save_sharded)", "a tensor-parallel model")
        return quantized_state_dict(model), {}

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _drop_extra_state(module, state_dict, prefix, local_metadata) -> None:
    for key in [key for key in state_dict if key.endswith("._extra_state")]:
        del state_dict[key]


def register_with_transformers() -> bool:
    """Register :class:`KbitConfig` and its quantizer with transformers (once); False without transformers."""
    if _auto is None:
        return False
    if QUANT_METHOD not in _auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        _auto.register_quantization_config(QUANT_METHOD)(KbitConfig)
    if QUANT_METHOD not in _auto.AUTO_QUANTIZER_MAPPING:
        _auto.register_quantizer(QUANT_METHOD)(KbitHfQuantizer)
    return True


register_with_transformers()

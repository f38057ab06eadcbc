"""``kbit quantize``: quantize a Hugging Face model directory and save it as a kbit checkpoint.

    kbit quantize path/to/model out_dir --k 4
    kbit quantize path/to/model out_dir --k 3 --override 'mlp.down_proj={"k": 4}' --override 'lm_head={}'

Loads with ``transformers.AutoModelForCausalLM`` (``AutoModel`` for encoders) from a local directory, never
from a hub; writes ``config.json``, ``kbit_config.json`` and ``model.safetensors`` (load them back with
``kbit.load_quantized``).
"""

from __future__ import annotations

import argparse
import json

from kbit.format.spec import BLOCKSIZES, DEFAULT_BLOCKSIZE, DEFAULT_K, DEFAULT_SCALE_FORMAT, K_VALUES, SCALE_FORMATS
from kbit.hf.quantize_model import quantize_model, save_quantized


def _override(text: str) -> tuple[str, dict]:
    pattern, sep, value = text.partition("=")
    try:
        params = json.loads(value) if sep else None
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--override: expected PATTERN=JSON, got {text!r}") from e
    return pattern, params


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a local Hugging Face model directory")
    p.add_argument("out", help="output directory")
    p.add_argument("--k", type=int, default=DEFAULT_K, choices=K_VALUES)
    p.add_argument("--blocksize", type=int, default=DEFAULT_BLOCKSIZE, choices=BLOCKSIZES)
    p.add_argument("--codebook", default=None, help="nf, nf0, uniform, lloyd, lloyd0, fit (default: per k)")
    p.add_argument("--scale-format", default=DEFAULT_SCALE_FORMAT, choices=SCALE_FORMATS)
    p.add_argument("--override", type=_override, action="append", default=[],
                   help="PATTERN=JSON per-module settings, e.g. 'down_proj={\"k\": 4}'; PATTERN alone skips it")
    p.add_argument("--encoder", action="store_true", help="load with AutoModel instead of AutoModelForCausalLM")


def main(args: argparse.Namespace) -> int:
    import transformers  # transformers is optional (kbit[hf]): imported when the command runs

    cls = transformers.AutoModel if args.encoder else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(args.model, local_files_only=True)
    quantize_model(model, k=args.k, blocksize=args.blocksize, codebook=args.codebook,
                   scale_format=args.scale_format, overrides=dict(args.override) or None)
    save_quantized(model, args.out)
    print(f"wrote {args.out}")
    return 0

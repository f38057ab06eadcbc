"""``kbit quantize``: quantize a Hugging Face model directory and save it as a kbit checkpoint.

    kbit quantize path/to/model out_dir --k 4
    kbit quantize path/to/model out_dir --k 3 --override 'mlp.down_proj={"k": 4}' --override 'lm_head={}'
    kbit quantize path/to/model out_dir --k 3 --calibrate [text.txt]
    kbit quantize path/to/model out_dir --k 2 --calibrate --finetune-steps 512

Loads with ``transformers.AutoModelForCausalLM`` (``AutoModel`` for encoders) from a local directory, never
from a hub, and refuses (writing nothing) a model that transformers loads with missing, newly initialized or
shape-mismatched weights: quantizing random weights would give a checkpoint that looks fine and is not.
Writes the checkpoint with :func:`kbit.save_quantized` and copies the tokenizer files and the generation
config, so ``kbit generate --model out_dir`` runs on it.

``--rotation`` is ``kbit.quantize_model(rotation=)``; the default ``auto`` rotates only with ``--calibrate``
(the residual rotation where the family supports it, else every input online: ``kbit.hf.quantize_model.
auto_rotation``, chosen from docs/quality.md's measurements), and ``none`` never does. ``--calibrate FILE`` rounds
the decoder layers with GPTQ on Hessians from the text of FILE (UTF-8), ``--calibrate`` alone from the second half
of the Lee corpus in gensim's wheel (``kbit.hf.calibration.default_calibration_text``), with the model's own
tokenizer; it runs the float model on the CPU, layer by layer. ``--finetune-steps N`` then tunes the rounded
weights' codebooks, block scales and the norm gains for N steps against the float model on that text
(``kbit.quantize_model(finetune=N)``; the format is unchanged).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from kbit.format.spec import BLOCKSIZES, DEFAULT_BLOCKSIZE, DEFAULT_K, DEFAULT_SCALE_FORMAT, K_VALUES, SCALE_FORMATS
from kbit.hf.calibration import BATCHES, SEQ_LEN, default_calibration_text
from kbit.hf.checkpoint import check_save_target
from kbit.hf.generate import at_least
from kbit.hf.models import MODELS
from kbit.hf.quantize_model import MODEL_ROTATIONS, auto_rotation, quantize_model, save_quantized

#: Files copied from the source folder next to the checkpoint (those that exist): the tokenizer of every
#: common family (fast and slow), its chat template, and the generation config.
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                "chat_template.json", "generation_config.json")


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
    p.add_argument("--rotation", choices=("none", *MODEL_ROTATIONS), default="auto",
                   help="hadamard: quantize rotated weights (randomized Hadamard along K; the layers rotate their "
                        "inputs); residual: rotate the residual stream offline first (only down_proj rotates "
                        "its input); auto (default): with --calibrate residual where the family supports it, "
                        "else hadamard; without --calibrate none")
    p.add_argument("--seed", type=int, default=0, help="seed of the rotation's random signs")
    p.add_argument("--calibrate", nargs="?", const="", default=None, metavar="FILE",
                   help=f"GPTQ rounding on up to {BATCHES} windows of {SEQ_LEN} tokens of FILE's text (no FILE: "
                        "the Lee corpus of gensim's wheel, second half)")
    p.add_argument("--finetune-steps", type=at_least(int, 0), default=0, metavar="N",
                   help="with --calibrate: then tune the codebooks, block scales and norm gains for N steps (one "
                        f"{SEQ_LEN}-token window each) against the float model's next-token distribution")


def check_loading_info(info: dict, cls_name: str, encoder: bool) -> None:
    """Raise ValueError when transformers' loading info shows weights that the checkpoint did not provide."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(m[0]) if isinstance(m, tuple) else str(m) for m in info.get("mismatched_keys") or ())
    if not missing and not mismatched:
        return
    what = (f"{len(missing)} weights missing from the checkpoint (newly initialized), e.g. {missing[0]}"
            if missing else f"{len(mismatched)} weights of another shape, e.g. {mismatched[0]}")
    hint = "pass --encoder for an encoder (AutoModel)" if not encoder else "check the model folder"
    raise ValueError(f"model: expected every weight of {cls_name} in the checkpoint, got {what}; nothing written; "
                     f"{hint}")


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy :data:`COPIED_FILES` that exist in ``src`` into ``dst``; returns their names."""
    copied = []
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def main(args: argparse.Namespace) -> int:
    import transformers  # transformers is optional (kbit[hf]): imported when the command runs

    if args.finetune_steps and args.calibrate is None:  # before the model loads: minutes for a large one
        raise ValueError(f"--finetune-steps: expected --calibrate as well (the tuning runs on the calibration "
                         f"text), got --finetune-steps {args.finetune_steps} alone")
    src = Path(args.model)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"model: expected a Hugging Face model folder with a config.json, got {str(src)!r}; "
                                f"pass the folder that holds config.json and the *.safetensors files")
    # before the model loads (minutes for a large one): never the float model's own folder, nor another model's
    out = Path(args.out)
    if out.exists() and out.resolve() == src.resolve():
        raise ValueError(f"out: expected a folder other than the model's, got {args.out!r}, the folder of model "
                         f"{args.model!r} (its float weights would be replaced); nothing written")
    check_save_target(out)
    calibration, tokenizer = None, None
    if args.calibrate is not None:  # the text and the tokenizer before the model: a missing one fails in seconds
        if args.calibrate and not Path(args.calibrate).is_file():
            raise FileNotFoundError(f"--calibrate: expected a text file, got {args.calibrate!r} (no such file); "
                                    f"pass a UTF-8 text file, or --calibrate alone for the packaged text")
        calibration = Path(args.calibrate).read_text(encoding="utf-8") if args.calibrate else \
            default_calibration_text()
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(src, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"--calibrate: expected the model's tokenizer files in {str(src)!r} (the calibration "
                             f"text is tokenized with it), got none that load: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from e
    # transformers' own load report and progress bars would bury the one line that says what went wrong
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cls = transformers.AutoModel if args.encoder else transformers.AutoModelForCausalLM
    model, info = cls.from_pretrained(src, local_files_only=True, output_loading_info=True)
    check_loading_info(info, type(model).__name__, args.encoder)
    overrides = dict(args.override) or None
    rotation = None if args.rotation == "none" else args.rotation
    if rotation == "auto":  # resolved here (once), so that the line below can say what was chosen
        rotation, overrides = auto_rotation(model, calibration, overrides=overrides)
    quantize_model(model, k=args.k, blocksize=args.blocksize, codebook=args.codebook,
                   scale_format=args.scale_format, overrides=overrides, rotation=rotation,
                   seed=args.seed, calibration=calibration, tokenizer=tokenizer,
                   finetune=args.finetune_steps or None)
    save_quantized(model, args.out)
    copied = copy_side_files(src, Path(args.out))
    how = "".join([f", rotation={rotation}" if rotation else "",
                   f", calibrated on {args.calibrate or 'the Lee corpus'}" if calibration is not None else "",
                   f", tuned {args.finetune_steps} steps" if args.finetune_steps else ""])
    table = model.config.quantization_config.modules
    kinds = [info["kind"] for info in table.values()]
    what = f"{kinds.count('linear')} Linear" + (f" and {kinds.count('experts')} fused expert modules"
                                                 if "experts" in kinds else "")
    plan = "its table row" if model.config.model_type in MODELS else "its structure"
    print(f"wrote {args.out} (k={args.k}{how}; {what} quantized, chosen by {plan} "
          f"({model.config.model_type!r}); copied {', '.join(copied) if copied else 'no tokenizer files'})")
    return 0

"""The ``kbit`` command. Each subcommand lives in its own module, imported only when it runs.

To add one: write a module with ``configure(parser)`` (adds its arguments) and ``main(args) -> int``, and
list it in SUBCOMMANDS with a one-line help. A subcommand reports a user error by raising an exception whose
message is one line saying what was wrong, what was expected, what it got and what to do; ``main`` prints it
as ``kbit <command>: <message>`` and exits 1 (``--debug``: the traceback instead).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Sequence

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kbit.hf.generate", "generate text with a k-bit model (default: the embedded SmolLM2-135M); "
                                     "--compare: next to the unquantized model"),
    "quantize": ("kbit.hf.cli", "quantize a local Hugging Face model directory to a kbit checkpoint"),
    "bench": ("kbit.bench.cli", "time kbit kernels against bf16 cuBLAS, peers and the read ceiling (CUDA GPU)"),
    "tune": ("kbit.bench.tune", "search kernel configs per (GPU, k, N, K, M bucket) into a tuned table (CUDA GPU)"),
    "eval": ("kbit.eval.cli", "quality of codebooks vs RTN/NF4 on all-MiniLM-L6-v2 and SmolLM2-135M (CPU)"),
    "analyze": ("kbit.analyze.cli", "per-block and workload-weighted kbit/bf16 tables (and plots) from results"),
}

#: Exit status of a run that stopped on an error (argparse's usage errors keep their own, 2).
ERROR_EXIT = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kbit", description="k-bit (2-5 bit) LLM weights")
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        importlib.import_module(module).configure(p)
    return parser


def error_line(command: str, exc: BaseException) -> str:
    """The one line printed for ``exc``: the command, the message's first line, and how to see more."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, ModuleNotFoundError) and exc.name and "pip install" not in text:
        text = f"needs the Python package {exc.name!r}, which is not installed; install kbit's extras: " \
               f"pip install -e '.[hf]' (or '.[eval]')"
    elif not isinstance(exc, (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError, RuntimeError)):
        text = f"{type(exc).__name__}: {text}"
    return f"kbit {command}: error: {text} (kbit --debug {command} ... shows the traceback)"


def warning_line(command: str, message) -> str | None:
    """The one line printed for a warning of kbit's own (its message starts with ``kbit:``, or a
    ``KbitQualityWarning``), else None (other packages' warnings keep Python's format)."""
    text = str(message).strip()
    category = type(message).__name__ if isinstance(message, Warning) else ""
    if not (text.startswith("kbit:") or category == "KbitQualityWarning"):
        return None
    text = text.removeprefix("kbit:").strip().splitlines()[0] if text else category
    return f"kbit {command}: warning: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.debug:  # kbit's warnings as one line each, like its errors (--debug: Python's format)
        default = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            one = warning_line(args.command, message if isinstance(message, Warning) else category(message))
            if one is None:
                return default(message, category, filename, lineno, file, line)
            print(one, file=file or sys.stderr)

        warnings.showwarning = show
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except KeyboardInterrupt:
        print(f"kbit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # every error: one line, unless --debug asks for the traceback
        if args.debug:
            raise
        print(error_line(args.command, exc), file=sys.stderr)
        return ERROR_EXIT
    finally:
        if not args.debug:
            warnings.showwarning = default


if __name__ == "__main__":
    sys.exit(main())

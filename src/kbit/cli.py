"""The ``kbit`` command. Each subcommand lives in its own module, imported only when it runs.

To add one: write a module with ``configure(parser)`` (adds its arguments) and ``main(args) -> int``, and
list it in SUBCOMMANDS with a one-line help.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("kbit.bench.cli", "time kbit kernels against bf16 cuBLAS, peers and the read ceiling"),
    "quantize": ("kbit.hf.cli", "quantize a local Hugging Face model directory to a kbit checkpoint"),
    "generate": ("kbit.hf.generate", "generate text with a k-bit model (default: SmolLM2-135M-Instruct)"),
    "eval": ("kbit.eval.cli", "quality of codebooks vs RTN/NF4 on all-MiniLM-L6-v2 and SmolLM2-135M (CPU)"),
    "analyze": ("kbit.analyze.cli", "per-block and workload-weighted kbit/bf16 tables (and plots) from results"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kbit", description="k-bit (2-5 bit) LLM weights")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        importlib.import_module(module).configure(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

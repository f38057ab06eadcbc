"""Check that the README's install and test commands are the ones .ci/run runs, literally.

The README's first ```bash block under "## Install and test" is what a newcomer types. Every command in it
(trailing "# comments" dropped) must be a line of .ci/run, except:
- ``git clone ...``: CI already runs in a fresh clone;
- the CPU torch line (``... torch==X --index-url .../cpu``): CI installs the same ``torch==X`` from its local
  CPU wheel (``python3 -m pip install -q torch==X``), since the PyTorch index is not reachable from CI.

Usage: ``python3 .ci/check_readme.py`` (exit 1 and one line per problem when they differ).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Install and test"


def readme_commands(readme: str) -> list[str]:
    """The commands of the first ```bash block after SECTION, without comments or blank lines."""
    start = readme.find(SECTION)
    if start < 0:
        raise ValueError(f"README: expected a section {SECTION!r}, got none")
    block = re.search(r"```bash\n(.*?)```", readme[start:], re.S)
    if block is None:
        raise ValueError(f"README: expected a ```bash block under {SECTION!r}, got none")
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in block.group(1).splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def problems(readme: str, run: str) -> list[str]:
    """What differs between the README's commands and .ci/run (empty: they agree)."""
    ci_lines = {line.strip() for line in run.splitlines()}
    out = []
    commands = readme_commands(readme)
    for cmd in commands:
        if cmd.startswith("git clone "):
            continue
        torch_cpu = re.fullmatch(r"python3 -m pip install (torch==\S+) --index-url \S+/cpu", cmd)
        if torch_cpu:
            want = f"python3 -m pip install -q {torch_cpu.group(1)}"
            if want not in ci_lines:
                out.append(f"README installs {torch_cpu.group(1)} (CPU); .ci/run lacks the line {want!r}")
        elif cmd not in ci_lines:
            out.append(f"README command {cmd!r} is not a line of .ci/run")
    if not any("pytest" in c for c in commands):
        out.append("README: expected a pytest command in the install-and-test block, got none")
    return out


def main() -> int:
    found = problems((ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text())
    for line in found:
        print(f"check_readme: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

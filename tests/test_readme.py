"""The README's install and test commands are what CI (.ci/run) runs, literally (.ci/check_readme.py)."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def checker():
    spec = importlib.util.spec_from_file_location("check_readme", ROOT / ".ci" / "check_readme.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_commands_are_what_ci_runs():
    mod = checker()
    readme, run = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert mod.problems(readme, run) == []
    commands = mod.readme_commands(readme)
    assert commands[0].startswith("git clone ") and commands[1].endswith("/cpu")  # clone, then CPU torch first
    assert commands[-1] == "python3 -m pytest -q"


def test_checker_catches_drift():
    mod = checker()
    readme = (ROOT / "README.md").read_text()
    run = (ROOT / ".ci" / "run").read_text()
    assert mod.problems(readme, run.replace("python3 -m pytest -q", "python3 -m pytest -q -x"))
    assert mod.problems(readme, run.replace("torch==2.13.0", "torch==2.12.0"))
    with pytest.raises(ValueError, match="expected a section"):
        mod.readme_commands("# no install section")


def test_readme_states_test_time_and_gpu_skips():
    """Finding 8: the README says how long the tests take and how many skip without a GPU."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert re.search(r"about \d+ minutes on 2 CPU cores", readme)
    assert re.search(r"\d[\d,]* of [\d,]+ tests are marked `gpu`", readme)
    assert "python3 -m pytest -q --co -m gpu | tail -1" in readme


def test_readme_first_screen_serves_a_newcomer():
    """Findings 1-3: clone first, CPU torch line before the project, the main job runs on a CPU."""
    readme = (ROOT / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:60])
    assert first_screen.index("git clone") < first_screen.index("download.pytorch.org/whl/cpu") < \
        first_screen.index('pip install -e ".[test]"')
    assert "kbit generate --compare" in first_screen and "## The main job" in first_screen
    assert first_screen.index("kbit generate --compare") < first_screen.index("kbit bench")
    assert len(readme.splitlines()) < 300


def test_readme_python_examples_compile_and_name_real_functions():
    import ast

    import kbit
    import kbit.hf.generate as gen

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks
    for block in blocks:
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "kbit.hf.generate":
                assert all(hasattr(gen, a.name) for a in node.names)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kbit":
                assert hasattr(kbit, node.attr) or node.attr in ("KbitConfig",), node.attr  # KbitConfig: issue 33

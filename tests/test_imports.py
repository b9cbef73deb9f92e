"""The import graph: layers point one way, no cycles, every module imports on its own, and imports sit at
module top unless deferring them has a measured reason.

memorize_core <- axonn <- memorization; memorize_core <- data_pipelines, evals <- memorization.
evals scores a model on its grid, so it takes the engine's grid, layers and inference helpers from
axonn, never the trainer, its checkpoints or the planner (EVALS_FROM_AXONN).
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
    "evals": {"memorize_core", "axonn"},
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


# the axonn modules evals may use: the grid, the layers, the handle and the forward-only helpers
EVALS_FROM_AXONN = {"axonn", "axonn.grid", "axonn.engine", "axonn.inference", "axonn.layers",
                    "axonn.layers.vocab", "axonn.layers.functions"}


def test_evals_uses_the_engine_not_the_trainer():
    bad = [f"{mod} -> {dep}" for mod, path in MODULES.items() if mod.startswith("evals")
           for dep in _imports(mod, path, top_level_only=False)
           if dep.startswith("axonn") and dep not in EVALS_FROM_AXONN]
    assert not bad, "evals imports axonn beyond grid/layers/inference: " + ", ".join(sorted(bad))


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


# Modules any function may import (the import-time rule: imports at module top unless there is a
# measured reason). Seconds each adds to an import when torch and transformers are already loaded,
# measured on the 2-core dev machine (fresh interpreter, time.perf_counter around the import; the
# figures move by about a third with the machine's load); only some paths need them. Any other
# import inside a function carries `# deferred: <measured reason>` on its line, or sits in a `try:`
# that catches ImportError (an optional dependency).
DEFERRED = {
    "evals": 3.2,  # scikit-learn + rouge-score: only scoring paths
    "peft": 2.7,  # LoRA runs only
    "opacus": 1.9,  # DP-SGD runs only
    "sklearn.metrics": 1.6,  # membership-inference AUCs only
    "rouge_score": 1.6,  # extraction scoring only
    "matplotlib.pyplot": 0.7,  # report plots only
    "wandb": 0.6,  # W&B tracking only
}
_SCRIPT_DIRS = ["benchmarks", "scripts"]


def _on_deferred_list(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in DEFERRED)


def _catches_import_error(node: ast.Try) -> bool:
    names = set()
    for h in node.handlers:
        types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        names |= {t.id for t in types if isinstance(t, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def _function_imports(path: Path) -> list[tuple[int, str]]:
    """(line, source) of every import inside a function body of `path` that no rule allows."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text, str(path))
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        chain, up = [], parent.get(node)
        while up is not None:
            chain.append(up)
            up = parent.get(up)
        if not any(isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for a in chain):
            continue  # module level (including `if __name__ == "__main__":` blocks)
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        if (all(_on_deferred_list(n) for n in names) if isinstance(node, ast.Import)
                else any(_on_deferred_list(n) for n in names)):
            continue
        path_down = [node] + chain  # node, its parent, ...: path_down[i] is a child of path_down[i + 1]
        if any(isinstance(a, ast.Try) and _catches_import_error(a) and path_down[i] in a.body
               for i, a in enumerate(chain)):
            continue  # an optional dependency that may be missing
        source = lines[node.lineno - 1:node.end_lineno]
        if any("# deferred:" in line for line in source):
            continue
        bad.append((node.lineno, source[0].strip()))
    return bad


def test_imports_inside_functions_are_deferred_for_a_measured_reason():
    """Every import inside a function is of a module on DEFERRED, is an optional dependency guarded by
    `except ImportError`, or says `# deferred: <measured cost>` on its line; anything else goes to the
    module top. Covers every package, benchmarks/ and scripts/."""
    files = list(MODULES.values()) + [f for d in _SCRIPT_DIRS for f in sorted((ROOT / d).rglob("*.py"))]
    bad = [f"{f.relative_to(ROOT)}:{line}: {src}" for f in files for line, src in _function_imports(f)]
    assert not bad, ("imports inside functions without a measured reason (move them to the module top, "
                     "or add `# deferred: +N s import, <why>` on the line):\n" + "\n".join(bad))

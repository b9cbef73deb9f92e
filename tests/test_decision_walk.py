"""The decision path of a serial `memorize train` is short and documented as it is: the files of
memorization/ whose functions run before the first optimizer step, in the order they are first
entered, are the list docs/architecture.md shows (at most 10)."""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

from memorization.cli import main

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "memorization"
MAX_FILES = 10


class _FirstStep(Exception):
    """Raised by the first optimizer step: the walk ends there."""


def decision_walk(argv: list[str]) -> list[str]:
    """memorization/ files (relative to the checkout) in which a function runs between `main(argv)`
    and the first AdamW step, in first-call order (module and class bodies are imports, not calls)."""
    seen: list[str] = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_flags & inspect.CO_NEWLOCALS and code.co_filename.startswith(
                str(PACKAGE)):
            rel = Path(code.co_filename).relative_to(ROOT).as_posix()
            if rel not in seen:
                seen.append(rel)

    def first_step(self, *a, **k):
        sys.setprofile(None)
        raise _FirstStep

    original = torch.optim.AdamW.step
    torch.optim.AdamW.step = first_step
    sys.setprofile(profile)
    try:
        main(argv)
    except _FirstStep:
        pass
    else:
        pytest.fail("the run ended without an optimizer step")
    finally:
        sys.setprofile(None)
        torch.optim.AdamW.step = original
    return seen


def documented_walk() -> list[str]:
    """The list under "The decision path, counted" in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- decision-walk -->\n```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md lost its <!-- decision-walk --> block"
    return [line.split()[0] for line in block.group(1).splitlines() if line.strip()]


def test_a_serial_train_decides_in_the_documented_files(tmp_path, cache_dir):
    walk = decision_walk(["train", str(ROOT / "configs/train/tiny-wiki.yaml"), "--out", str(tmp_path / "out"),
                          "--steps", "1", "data.held_out_limit=4", "wandb.mode=disabled"])
    assert len(walk) <= MAX_FILES, walk
    assert walk == documented_walk(), "docs/architecture.md's decision-walk block should read:\n" + \
        "\n".join(walk)

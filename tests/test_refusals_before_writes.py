"""Every refusal a launch can make comes from the run's plan, before OUT is touched: a refused launch
over an earlier run (`--overwrite` included) leaves OUT byte-identical, and its dry run refuses with the
same line (docs/reliability.md's refusal list)."""
from __future__ import annotations

import pytest
from helpers import TINY
from test_overwrite_safety import tree

from memorization.cli import main

# (overrides, what the one line names): each was once refused only after OUT had been cleared
REFUSALS = [
    (["trainer.dp.enabled=true", "trainer.dp.noise_multiplier=1", "trainer.loss_chunk=1024"],
     "trainer.loss_chunk"),
    (["data.min_tokens=5000"], "data.min_tokens"),
]


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A finished tiny run: the results a refused launch must not touch."""
    root = tmp_path_factory.mktemp("earlier")
    cfg = root / "t.yaml"
    cfg.write_text(TINY)
    out = root / "out"
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    return cfg, out


def _one_line(capsys, argv) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("overrides,field", REFUSALS)
def test_a_refused_launch_leaves_an_earlier_run_byte_identical(capsys, earlier_run, overrides, field):
    cfg, out = earlier_run
    before = tree(out)
    err = _one_line(capsys, ["train", cfg, "--out", out, "--overwrite", *overrides])
    assert field in err
    assert tree(out) == before
    dry = _one_line(capsys, ["train", cfg, "--out", out, "--overwrite", "--dry-run", "--world", "1",
                             "--hardware", "local", *overrides])
    assert dry == err  # the dry run refuses exactly what the launch refuses
    assert tree(out) == before


def test_compile_without_a_compiler_is_refused_before_out(capsys, earlier_run, monkeypatch):
    cfg, out = earlier_run
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CXX", "no-such-compiler")
    before = tree(out)
    err = _one_line(capsys, ["train", cfg, "--out", out, "--overwrite", "trainer.compile=true"])
    assert "trainer.compile" in err and "C++ compiler" in err
    assert tree(out) == before

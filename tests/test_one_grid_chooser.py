"""One grid chooser (axonn/plan/choose.py): `memorize eval --grid auto` and `memorize scan --grid auto`
choose the same grid for the same model, launch and batch (inference objective), and an inference fits
where training of the same model does not (no optimizer state)."""
from __future__ import annotations

import pytest

from axonn.plan import get_hardware, load_shape
from axonn.plan.choose import Inference, Train, choose_grid
from memorization.models import zoo_config
from memorization.train.parallel import Launch, plan_inference
from memorize_core import ConfigError


@pytest.mark.parametrize("model", ["llama-8b", "llama-70b"])
@pytest.mark.parametrize("batch", [64, 1024])
def test_eval_and_scan_auto_choose_the_same_grid(model, batch, capsys):
    """`memorize eval --grid auto` plans with plan_inference on its launch; the scan's dry run (and so
    the scan it prints) on the same launch: one grid."""
    import json

    from memorization.cli import main

    ev = plan_inference(zoo_config(model), spec="auto", model=model, batch=batch, width=64, suffix=32,
                        launch=Launch(8, 8, "h100"))
    assert main(["scan", "--model", model, "--dry-run", "--world", "8", "--hardware", "h100", "--batch-size",
                 str(batch), "--prefix", "32", "--suffix", "32", "--limit", "1000", "--json"]) == 0
    scan = json.loads(capsys.readouterr().out)
    assert tuple(ev.dims) == tuple(scan["grid"]), (model, batch, ev, scan["grid"])
    assert "inference" in ev.chosen_by and scan["chosen_by"] == ev.chosen_by
    assert ev.distributed and ev.mode == scan["mode"]


def test_inference_fits_where_training_does_not():
    shape, hw = load_shape(zoo_config("llama-70b")), get_hardware("h100")
    got = choose_grid(shape, 8, 8, hw, Inference(batch=64, width=64, suffix=32))
    assert got.bytes <= hw.memory_bytes * 0.9 and got.objective == "inference"
    with pytest.raises(ConfigError, match=r"fits llama in h100 memory \(training\); the smallest needs"):
        choose_grid(shape, 8, 8, hw, Train(seq=2048, batch=8))


def test_the_scan_dry_run_prints_the_launch_that_runs_what_it_sized(capsys):
    import shlex

    from memorization.cli import main, parse_args

    argv = ["scan", "--model", "llama-70b", "--dry-run", "--world", "8", "--hardware", "h100", "--limit",
            "1000000", "--batch-size", "1024", "--offsets", "stride:16"]
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("launch: "))
    words = shlex.split(line.removeprefix("launch: "))
    launched = parse_args(words[words.index("memorization") + 1:])
    sized = parse_args(argv)
    for name in ("limit", "batch_size", "offsets", "prefix", "suffix", "model"):
        assert getattr(launched, name) == getattr(sized, name), name
    assert launched.grid == "1,8,1,1" and not launched.dry_run


def test_an_explicit_grid_launched_on_a_known_gpu_must_fit(tmp_path):
    from pathlib import Path

    from memorization.config import load_run_config
    from memorization.train.run_plan import plan_run

    cfg = load_run_config(Path(__file__).resolve().parents[1] / "configs/train/llama-70b-finetune.yaml", [])
    launch = Launch(8, 8, "h100")
    with pytest.raises(ConfigError, match=r"--grid='1,1,1,8': needs .* GiB per GPU but h100 has 72.0 GiB"):
        plan_run(cfg, launch=launch, spec="1,1,1,8", here=True)

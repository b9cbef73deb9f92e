"""DP-SGD + LoRA on a tensor-split grid: only the adapters train privately, and the run equals the
serial one (ghost clipping on the engine's adapter layers vs on peft's; sigma = 0 and a clip norm that
bites, so every step clips; fp32, losses within 1e-5 relative)."""
from __future__ import annotations

import json

import pytest

from axonn.spawn import run_ranks
from memorization.cli import main

ARGS = ["model.lora.enabled=true", "model.lora.target_modules=all-linear", "trainer.dp.enabled=true",
        "trainer.dp.noise_multiplier=0.0", "trainer.dp.max_grad_norm=0.01", "trainer.dp.delta=1e-3",
        "eval.extraction=false", "wandb.mode=disabled", "data.limit=40", "trainer.progress=false"]


def _train(rank: int, world: int, out: str) -> None:
    assert main(["train", "configs/train/tiny-wiki.yaml", "--grid", "1,2,1,1", "--out", out, "--steps", "3",
                 *ARGS]) == 0


def _losses(path) -> list[float]:
    return [json.loads(x)["loss"] for x in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_dp_lora_at_a_tensor_split_equals_serial(tmp_path):
    assert main(["train", "configs/train/tiny-wiki.yaml", "--out", str(tmp_path / "serial"), "--steps", "3",
                 *ARGS]) == 0
    results = run_ranks(_train, 2, str(tmp_path / "grid"), init=False, timeout=240)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    serial, grid = _losses(tmp_path / "serial"), _losses(tmp_path / "grid")
    assert len(serial) == len(grid) == 3
    assert grid == pytest.approx(serial, rel=1e-5)
    serial_sum, grid_sum = (json.loads((tmp_path / d / "run.json").read_text())["summary"]
                            for d in ("serial", "grid"))
    assert grid_sum["grid"] == "1,2,1,1" and grid_sum["trainable_params"] == serial_sum["trainable_params"]
    assert grid_sum["trainable_params"] < serial_sum["params"] / 10  # the adapters only

"""One resolved plan of a run (memorization.train.run_plan.plan_run): the grid a launched run takes is the
grid its dry run prints, for every shipped config and launches of 1-8 processes here and 8 / 64 / 6,144
simulated; `auto` honours the run's micro-batch; a real 4-rank launch trains on the dry run's grid.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from axonn.spawn import run_ranks
from memorization.config import load_run_config
from memorization.train.dryrun import dry_run
from memorization.train.parallel import Launch
from memorization.train.prepare import prepare_data
from memorization.train.run_plan import plan_run
from memorize_core import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = sorted((ROOT / "configs" / "train").glob("*.yaml"))
# (processes, per node, hardware preset): this machine's launches, and simulated cluster launches
LAUNCHES = [(1, 1, "local"), (2, 2, "local"), (4, 4, "local"), (8, 8, "local"), (8, 8, "h100"),
            (64, 8, "h100"), (6144, 4, "alps-h100")]
# eval.mia off: its data-dependent check (tokenizing the corpus) does not touch the grid
VARIANTS = [["grid=auto", "eval.mia=false"],
            ["grid=auto", "eval.mia=false", "trainer.micro_batch=4"]]


def _launched(monkeypatch, world: int, per_node: int, hardware: str) -> None:
    """This process as rank 0 of a torchrun/srun launch on `hardware` (no process group is made)."""
    for k, v in {"WORLD_SIZE": world, "RANK": 0, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": per_node,
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setattr("memorization.train.parallel.detect_hardware", lambda: hardware)


def _dry_grid(cfg, world: int, per_node: int, hardware: str) -> tuple[int, ...]:
    g = dry_run(cfg, world=world, gpus_per_node=per_node, hardware=hardware)["grid"]
    return g["x"], g["y"], g["z"], g["data"]


@functools.cache
def _data(config: Path):
    return prepare_data(load_run_config(str(config), []))


def _outcome(fn):
    try:
        return fn()
    except ConfigError as e:
        return f"error: {e}"


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda w: f"{w[0]}x{w[2]}")
@pytest.mark.parametrize("config", TRAIN_CONFIGS, ids=lambda p: p.stem)
def test_the_launch_takes_the_grid_its_dry_run_prints(monkeypatch, config, launch):
    world, per_node, hardware = launch
    for overrides in VARIANTS:
        cfg = load_run_config(str(config), overrides)
        dry = _outcome(lambda: _dry_grid(cfg, world, per_node, hardware))  # noqa: B023
        with monkeypatch.context() as m:
            _launched(m, world, per_node, hardware)
            # as start_run plans it: with the prepared data (a corpus BPE's vocabulary is known only then)
            ran = _outcome(lambda: plan_run(cfg, _data(config)).dims)  # noqa: B023
        if isinstance(ran, str) or isinstance(dry, str):
            # the launch cannot see memory it has not built: a dry run may refuse more (memory), never less
            assert isinstance(dry, str), (config.stem, overrides, launch, ran, dry)
            assert ran == dry or "GiB" in dry, (config.stem, overrides, launch, ran, dry)
        else:
            assert ran == dry, (config.stem, overrides, launch)


def test_auto_honours_the_micro_batch(monkeypatch):
    """The old run-side chooser ignored trainer.micro_batch: 64 x H100 for the 70B config chose
    (1,1,64,1), which its own micro_batch of 4 cannot split (4 x 64 rows > the batch of 128)."""
    cfg = load_run_config(str(ROOT / "configs/train/llama-70b-finetune.yaml"),
                          ["grid=auto", "eval.mia=false", "model.name=llama-70b"])
    _launched(monkeypatch, 64, 8, "h100")
    plan = plan_run(cfg)
    x, y, z, d = plan.dims
    assert cfg.trainer.batch_size % (cfg.trainer.micro_batch * z * d) == 0
    assert plan.micro_batch == cfg.trainer.micro_batch and plan.chosen_by == "the performance model (h100)"
    assert plan.micro_batches * plan.micro_batch * z * d == cfg.trainer.batch_size


def test_the_plan_holds_the_runs_decisions(tmp_path):
    cfg = load_run_config(str(ROOT / "configs/train/tiny-wiki.yaml"), ["eval.extraction=false"])
    plan = plan_run(cfg, out=tmp_path / "out")
    assert plan.dims == (1, 1, 1, 1) and not plan.distributed and plan.chosen_by == "--grid"
    assert "extraction.jsonl" not in plan.files and "run.json" in plan.files
    assert plan.eval_batch == cfg.eval.batch_size and plan.micro_batches * plan.micro_batch == 8
    assert not (tmp_path / "out").exists()




@pytest.mark.parametrize("overrides,hardware,want", [
    # precision auto: fp32 on the CPU profile, bf16 on a GPU preset (the LoRA base is frozen in it)
    ([], "local", dict(precision="fp32", engine=False, stream_weights=False, sharded_lora=False,
                       loss_chunk="auto")),
    (["trainer.precision=auto"], "h100", dict(precision="bf16")),
    (["trainer.precision=fp32"], "h100", dict(precision="fp32")),
    # LoRA on a tensor split adapts the engine's shards; at 1,1,1,D peft's plain modules stay
    (["grid=1,2,1,1", "model.lora.enabled=true"], "local",
     dict(engine=True, sharded_lora=True, lora_targets={"q_proj", "k_proj", "v_proj", "o_proj"})),
    (["grid=1,1,1,2", "model.lora.enabled=true"], "local", dict(engine=False, sharded_lora=False)),
    # Opacus' per-sample DP-SGD keeps the HF modules; ghost clipping runs on the engine's layers
    (["grid=1,1,1,2", "trainer.dp.enabled=true", "trainer.dp.clipping=per_sample",
      "trainer.dp.noise_multiplier=1"], "local", dict(engine=False, loss_chunk="off")),
    (["grid=1,1,1,2", "trainer.dp.enabled=true", "trainer.dp.noise_multiplier=1"], "local",
     dict(engine=True, loss_chunk="off")),
])
def test_the_plan_decides_how_the_run_is_built(overrides, hardware, want):
    """start_run builds what the plan says (precision, LoRA's kind and targets, the engine, streamed
    weights) and decides none of it again; the dry run reads the same fields."""
    cfg = load_run_config(str(ROOT / "configs/train/tiny-wiki.yaml"),
                          ["eval.mia=false", "eval.extraction=false", *overrides])
    world = 1 if cfg.grid in ("", "1,1,1,1", "auto") else 2
    plan = plan_run(cfg, launch=Launch(world, world, hardware), here=False)
    for key, value in want.items():
        # precision and the LM-head setting are decided in the trainer settings the Trainer is handed
        got = getattr(plan.trainer if key in ("precision", "loss_chunk") else plan, key)
        if key == "lora_targets":
            assert {t.rpartition(".")[2] for t in got} == value and "model.layers.0.self_attn.q_proj" in got
        else:
            assert got == value, (key, got)


def test_a_pretrained_model_on_the_engine_streams_its_weights(monkeypatch):
    monkeypatch.setattr("memorization.train.run_plan.is_pretrained", lambda name: True)
    for spec in ("1,2,1,1", "1,1,1,2"):  # data parallel through the engine loads per rank too
        cfg = load_run_config(str(ROOT / "configs/train/tiny-wiki.yaml"), ["eval.mia=false", f"grid={spec}"])
        plan = plan_run(cfg, launch=Launch(2, 2, "local"), here=False)
        assert plan.engine and plan.stream_weights, spec
    plan = plan_run(cfg, launch=Launch(1, 1, "local"), here=False, spec="1,1,1,1")
    assert not plan.engine and not plan.stream_weights  # serial: the HF model loads its weights itself


def _train_rank(rank: int, world: int, config: str, out: str, overrides: list[str]) -> None:
    from memorization.cli import main  # deferred: a forked rank imports the CLI itself

    assert main(["train", config, "--out", out, "--steps", "1", *overrides]) == 0


@pytest.mark.distributed
def test_a_four_rank_launch_trains_on_the_dry_runs_grid(tmp_path):
    """The issue's case: tiny-wiki, grid auto, micro_batch 4 on 4 processes of this machine."""
    overrides = ["grid=auto", "trainer.micro_batch=4", "eval.extraction=false", "data.limit=24",
                 "data.held_out_limit=4", "wandb.mode=disabled"]
    config = str(ROOT / "configs/train/tiny-wiki.yaml")
    r = dry_run(load_run_config(config, overrides), world=4, gpus_per_node=4, hardware="local")["grid"]
    results = run_ranks(_train_rank, 4, config, str(tmp_path / "out"), overrides, init=False, timeout=240)
    assert all(x.ok for x in results), [x.error for x in results if not x.ok]
    ran = json.loads((tmp_path / "out" / "run.json").read_text())["summary"]["grid"]
    assert ran == f"{r['x']},{r['y']},{r['z']},{r['data']}"

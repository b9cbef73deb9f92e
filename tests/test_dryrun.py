"""`memorize train|run --dry-run`: figures equal what the shards really allocate, checks refuse bad
grids with one line, the Llama fine-tune configs dry-run clean where axonn-plan puts them.

The exactness test trains one step of a small Llama on gloo ranks and compares, byte for byte, the
parameters, gradients and AdamW state rank 0 holds with the dry run's figures (and each rank's count
with a virtual grid of that rank). The 405B dry run on 6,144 GPUs is `slow` (and in
benchmarks/bench_dryrun.py, which prints its time and peak memory).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from axonn.spawn import run_distributed

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
         "intermediate_size": 80}  # k/v (16 rows), FFN (80) and vocab (320) leave Z = 3 padding


def _cfg(*overrides: str):
    from memorization.config import load_run_config

    return load_run_config(None, ["model.name=tiny", "data.vocab_size=320", "data.block_len=16",
                                  "data.min_tokens=8", "trainer.batch_size=12", "trainer.precision=fp32",
                                  "eval.extraction=false",
                                  *[f"model.overrides.{k}={v}" for k, v in SMALL.items()], *overrides])


def _allocated(rank: int, world: int, dims, mode: str) -> dict:
    """Bytes of parameters, gradients and AdamW state this rank really holds after one step."""
    import axonn
    from axonn.swap import parallelize, trainable
    from memorization.models import build_model

    grid = axonn.ProcessGrid(*dims)
    model = parallelize(build_model("tiny", vocab_size=320, overrides=SMALL), grid, mode=mode)
    virtual = parallelize(build_model("tiny", vocab_size=320, overrides=SMALL, meta=True),
                          axonn.ProcessGrid.virtual(*dims, rank=rank), mode=mode)
    params = trainable(model)
    ids = torch.randint(0, 320, (12, 16), generator=torch.Generator().manual_seed(0))
    rows = axonn.shard_batch(ids, grid)
    loss, count = axonn.cross_entropy(model(input_ids=rows).logits[:, :-1], rows[:, 1:], grid)
    (loss / 180.0).backward()
    axonn.sync_gradients(model, grid)
    opt = torch.optim.AdamW(params, lr=1e-3)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    opt.step()
    moments = sum(t.numel() * t.element_size() for p in params for t in opt.state[p].values()
                  if t.numel() == p.numel())  # exp_avg, exp_avg_sq (not the scalar step counters)
    return {"params": sum(p.numel() for p in params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes": grads, "optimizer_bytes": moments,
            "virtual_params": sum(p.numel() for p in trainable(virtual))}


@pytest.mark.distributed
@pytest.mark.parametrize("dims,mode", [((2, 1, 2, 1), "paired"), ((1, 1, 3, 1), "easy")])
def test_figures_equal_what_the_shards_allocate(dims, mode):
    from memorization.train.dryrun import dry_run

    world = dims[0] * dims[1] * dims[2] * dims[3]
    got = run_distributed(_allocated, world, dims, mode, timeout=240)
    report = dry_run(_cfg(f"parallel_mode={mode}"), world=world, grid=",".join(map(str, dims)))
    r0 = report["rank0"]
    assert got[0]["params"] == r0["params"] == r0["planner_params"]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert got[0][key] == r0[key], key
    assert all(g["virtual_params"] == g["params"] for g in got)  # every rank, not only rank 0


def test_memory_is_the_planners_model_of_the_built_model():
    from axonn.plan import load_shape
    from axonn.plan.memory import memory_breakdown
    from axonn.plan.volumes import Grid
    from memorization.train.dryrun import dry_run
    from memorization.train.run_plan import planned_model_config

    cfg = _cfg("trainer.activation_checkpointing=true", "trainer.micro_batch=1", "parallel_mode=paired")
    r = dry_run(cfg, world=4, grid="1,2,2,1")
    shape = load_shape(planned_model_config(cfg)[0])
    for ck, key in ((True, "checkpointing"), (False, "no_checkpointing")):
        m = memory_breakdown(shape, Grid(1, 2, 2, 1), 16, 1, ck, mode="paired", precision="fp32")
        assert r["rank0"]["activation_bytes"][key] == int(m["activations"])
    assert r["batch"] == {"global": 12, "seq": 16, "tokens_per_step": 192, "micro_batch": 1,
                          "micro_batches": 6, "rows_per_rank": 6}
    assert r["precision"] == "fp32" and r["predicted"]["step_s"] > 0
    assert r["launch"]["torchrun"].startswith("torchrun --nproc-per-node 4 -m memorization train")


def _memorize(*argv: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from memorization.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_cli_json_and_text():
    code, out, _ = _memorize("train", "configs/train/llama-8b-finetune.yaml", "--dry-run", "--world", "4",
                             "--hardware", "alps-h100", "--json")
    r = json.loads(out)
    assert code == 0 and r["grid"]["world"] == 4
    assert r["rank0"]["total_bytes"] <= r["hardware"]["usable_bytes"]
    # the zoo shape's model has data.vocab_size=128256 rows whatever the corpus BPE reached (run_vocab)
    assert r["model"]["params"] == 8_030_261_248 and r["model"]["vocab"] == 128256
    code, out, _ = _memorize("train", "configs/train/llama-8b-finetune.yaml", "--dry-run", "--world", "4",
                             "--hardware", "alps-h100", "--grid", "1,1,4,1")
    assert code == 0 and "(x, y, z, data) = (1, 1, 4, 1)" in out and "MFU" in out and "srun" in out


@pytest.mark.parametrize("argv,field", [
    (["--world", "4", "--grid", "1,1,1,2"], "--grid='1,1,1,2'"),                 # product != world
    (["--world", "3", "--gpus-per-node", "3", "--grid", "1,3,1,1"], "grid.y=3"),  # heads 32
    (["--world", "4", "--grid", "1,1,1,4"], "--grid='1,1,1,4'"),                 # 8B whole on one GPU
    (["--world", "4", "--grid", "1,1,4,1", "trainer.batch_size=6"], "trainer.micro_batch=2"),
    (["--world", "4", "--grid", "1,1,4,1", "model.name=/no/such/model"], "model.name="),
    (["--world", "0"], "--world=0"),
    (["--world", "6", "--gpus-per-node", "4"], "--world=6"),                        # not whole nodes
    (["--grid", "auto"], "--world=None"),                                         # --dry-run needs --world
])
def test_bad_input_one_line(argv, field):
    code, out, err = _memorize("train", "configs/train/llama-8b-finetune.yaml", "--dry-run", "--hardware",
                               "alps-h100", *argv)
    assert code == 2 and not out and err.count("\n") == 1 and field in err, err


def test_world_without_dry_run_and_missing_config():
    code, _, err = _memorize("train", "configs/train/llama-8b-finetune.yaml", "--world", "4")
    assert code == 2 and "--world=4" in err and "--dry-run" in err
    code, _, err = _memorize("train", "configs/train/nope.yaml", "--dry-run", "--world", "4")
    assert code == 2 and "config='configs/train/nope.yaml'" in err


def test_run_dry_runs_every_model_of_an_experiment():
    code, out, err = _memorize("run", "configs/experiments/catastrophic-memorization.yaml", "--dry-run",
                               "--world", "2", "--grid", "1,1,1,2", "--json")
    reports = json.loads(out)
    assert code == 0, err
    assert [r["model"]["hidden"] for r in reports][-4:] == [64, 128, 256, 512]
    assert all(r["command"] == "run" and r["launch"]["srun"].count("memorization run") for r in reports)


@pytest.mark.parametrize("config,gpus", [("llama-8b-finetune", 4), ("llama-70b-finetune", 64),
                                         ("llama-405b-finetune", 6144)])
def test_finetune_configs_dry_run_clean_at_axonn_plans_grid(config, gpus):
    """1 node, 16 nodes and 1,536 Alps nodes: the grid `axonn-plan --strict` ranks first runs."""
    from dataclasses import replace

    from axonn.plan import load_shape, plan
    from memorization.config import load_run_config
    from memorization.train.dryrun import dry_run

    cfg = load_run_config(ROOT / "configs" / "train" / f"{config}.yaml")
    auto = dry_run(replace(cfg, grid="auto"), world=gpus, hardware="alps-h100")
    shape = replace(load_shape(cfg.model.name), vocab=auto["model"]["vocab"])
    t = cfg.trainer  # the planner's best grid for the config as written (its micro-batch, checkpointing)
    top = plan(shape, gpus, 4, cfg.data.block_len, t.batch_size, "alps-h100", strict=True,
               micro_batch=t.micro_batch, checkpoint=t.activation_checkpointing, loss_chunk=t.loss_chunk)[0]
    assert auto["rank0"]["total_bytes"] <= auto["hardware"]["usable_bytes"]
    assert auto["grid"]["nodes"] == gpus // 4
    # `grid: auto` with the config's own settings reaches the planner's best time
    assert auto["predicted"]["step_s"] == pytest.approx(top.time_s)


def _hf_folder(tmp_path: Path, cache: Path) -> Path:
    """A small pretrained-style folder: config.json, model.safetensors and its own tokenizer."""
    from data_pipelines import load_tokenizer
    from memorization.models import build_model

    tok = load_tokenizer("bpe", texts=["the cat sat on the mat"] * 50 + ["a dog ran"] * 50, vocab_size=300,
                         cache_dir=cache)
    model = build_model("tiny", vocab_size=len(tok), overrides=SMALL)
    folder = tmp_path / "hf"
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def test_weights_folder_is_checked_against_the_shards(tmp_path):
    from safetensors.torch import load_file, save_file

    from memorization.train.dryrun import dry_run
    from memorize_core import ConfigError

    folder = _hf_folder(tmp_path, tmp_path / "cache")
    r = dry_run(_cfg(f"model.name={folder}"), world=2, grid="1,1,2,1")
    assert r["weights"]["checked"] == r["weights"]["tensors"] and r["weights"]["files"] == 1
    state = load_file(folder / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:40]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp.up_proj.weight is stored as \[40, 48\]"):
        dry_run(_cfg(f"model.name={folder}"), world=2, grid="1,1,2,1")


@pytest.mark.slow
def test_405b_on_6144_gpus_in_a_minute_and_4_gb():
    """The brief's bound, measured (not asserted as timing): see benchmarks/bench_dryrun.py."""
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "memorization", "train",
                           "configs/train/llama-405b-finetune.yaml",
                           "--dry-run", "--world", "6144", "--hardware", "alps-h100", "--json"],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    took = time.time() - t0
    rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["grid"]["world"] == 6144 and r["rank0"]["total_bytes"] <= r["hardware"]["usable_bytes"]
    print(f"405B dry run on 6,144 GPUs: {took:.1f} s, peak RSS {rss_gb:.2f} GB")

"""A pretrained model on a grid: its weights stream into the shards, and training equals the serial run."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_pretrained

from axonn.spawn import run_distributed

CFG = {"name": "p", "seed": 0,
       "data": {"corpus": "wiki-leads", "limit": 16, "block_len": 32, "min_tokens": 32, "held_out": ""},
       "trainer": {"batch_size": 4, "max_steps": 3, "lr": 1e-2, "warmup_steps": 1, "progress": False,
                   "device": "cpu"},
       "eval": {"extraction": False}, "wandb": {"mode": "disabled"}}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny 'pretrained' HF folder (seeded weights, its own tokenizer) in safetensors."""
    return tiny_pretrained(tmp_path_factory)


def _config(model_dir):
    from axonn.config import build
    from memorization.config import RunConfig

    return build(RunConfig, {**CFG, "model": {"name": model_dir}})


def _grid_run(rank, world, model_dir, out, dims):
    from transformers import AutoModelForCausalLM

    import axonn
    from memorization.train.pipeline import run_training

    loads = []

    real = AutoModelForCausalLM.from_pretrained

    def spy(*a, **k):  # a full from_pretrained on a rank means the weights did not stream
        loads.append(a[0] if a else k)
        return real(*a, **k)

    AutoModelForCausalLM.from_pretrained = spy
    try:
        run_training(_config(model_dir), out, grid=axonn.ProcessGrid(*dims), progress=False)
    finally:
        AutoModelForCausalLM.from_pretrained = real
    return loads


@pytest.mark.distributed
@pytest.mark.parametrize("dims", [(1, 1, 2, 1), (2, 1, 1, 1)])
def test_pretrained_streams_into_shards_and_equals_serial(pretrained, tmp_path, dims):
    from memorization.train.pipeline import run_training

    run_training(_config(pretrained), tmp_path / "serial", progress=False)
    loads = run_distributed(_grid_run, 2, pretrained, str(tmp_path / "grid"), dims, timeout=240)
    assert loads == [[], []]  # no rank loaded the whole model
    serial = [json.loads(x)["loss"] for x in (tmp_path / "serial" / "metrics.jsonl").read_text().splitlines()]
    grid = [json.loads(x)["loss"] for x in (tmp_path / "grid" / "metrics.jsonl").read_text().splitlines()]
    assert len(serial) == 3
    assert grid == pytest.approx(serial, rel=1e-5, abs=1e-6)  # so the streamed shards hold the weights


def test_meta_build_of_a_bf16_saved_folder_is_float32(tmp_path):
    """A grid build (meta) must have the dtype of the loaded weights, not the folder's saved bf16."""
    from helpers import tiny_model

    from memorization.models import build_model

    tiny_model().to(torch.bfloat16).save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"
    meta = build_model(str(tmp_path / "m"), meta=True)
    loaded = build_model(str(tmp_path / "m"))
    assert {p.dtype for p in meta.parameters()} == {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert all(p.is_meta for p in meta.parameters())

"""LoRA in the planner: adapter parameters per rank as the engine shards them, memory of a frozen base
(its load dtype, no gradient or AdamW state), and the dry runs of the issue's LoRA jobs (slow)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from axonn.grid import ProcessGrid
from axonn.plan import load_shape
from axonn.plan.memory import Adapters, adapter_params, local_params, memory_breakdown
from axonn.plan.volumes import Grid
from axonn.swap import parallelize, trainable
from memorization.mitigations.peft_lora import (
    LoraSettings,
    apply_sharded_lora,
    lora_targets,
    planner_adapters,
)

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)


def _meta() -> torch.nn.Module:
    with torch.device("meta"):
        return LlamaForCausalLM(CONFIG)


@pytest.mark.parametrize("dims", [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (2, 2, 2, 1),
                                  (1, 1, 4, 1)])
@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
@pytest.mark.parametrize("mode", ["easy", "paired"])
def test_adapter_params_per_rank_are_the_sharded_models(dims, targets, mode):
    settings = LoraSettings(enabled=True, r=3, target_modules=targets)  # r=3: Z pads A's rows
    model = parallelize(_meta(), ProcessGrid.virtual(*dims, rank=0), mode=mode)
    base = sum(p.numel() for p in trainable(model))
    model = apply_sharded_lora(model, settings, lora_targets(_meta(), settings))
    shape, grid = load_shape(CONFIG), Grid(*dims)
    adapters = planner_adapters(settings, _meta(), "bf16")
    assert adapter_params(shape, grid, adapters, mode) == sum(p.numel() for p in trainable(model))
    assert local_params(shape, grid, mode) == base  # the frozen base is the whole local model
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_memory_of_a_frozen_base_counts_only_adapters_for_gradients_and_state():
    shape, grid = load_shape(CONFIG), Grid(1, 2, 1, 1)
    n = local_params(shape, grid, "paired")
    full = memory_breakdown(shape, grid, 32, 1, False, mode="paired")
    lora = Adapters(rank=4, frozen_bytes=2)
    a = adapter_params(shape, grid, lora, "paired")
    mem = memory_breakdown(shape, grid, 32, 1, False, mode="paired", adapters=lora)
    assert mem["weights"] == 2 * n + 4 * a and mem["gradients"] == 4 * a and mem["optimizer"] == 8 * a
    assert mem["activations"] == full["activations"] and mem["weights"] < full["weights"]


@pytest.mark.slow
@pytest.mark.parametrize("config,world,gpn,hardware,nodes", [
    ("configs/train/llama-70b-finetune.yaml", 8, 8, "h100", 1),
    ("configs/train/llama-405b-finetune.yaml", 64, 4, "alps-h100", 16),
])
def test_the_issues_lora_jobs_dry_run_clean(config, world, gpn, hardware, nodes):
    from memorization.config import load_run_config
    from memorization.train.dryrun import dry_run

    cfg = load_run_config(config, ["model.lora.enabled=true"])
    report = dry_run(cfg, world=world, gpus_per_node=gpn, hardware=hardware)
    r = report["rank0"]
    assert r["fits"] and report["grid"]["nodes"] == nodes and report["evaluation"]["total_bytes"] > 0
    assert r["grad_bytes"] == 4 * r["trained_params"] and r["param_bytes"] == 2 * r["params"] \
        + 4 * r["trained_params"]  # bf16 frozen base, fp32 adapters
    x, y, z, _ = (report["grid"][k] for k in ("x", "y", "z", "data"))
    assert x * y * z > 1  # the base is split: LoRA runs on a tensor-split grid

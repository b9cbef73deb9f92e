"""LoRA through peft: only adapters train, exports are exact, bad input refused, DP == serial (the
tensor-split grids: test_lora_grid.py and test_lora_run.py)."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_pretrained
from safetensors.torch import load_file

from axonn.config import TrainerConfig, build
from axonn.spawn import run_distributed
from axonn.trainer import Trainer
from memorization.mitigations.peft_lora import LoraSettings, apply_lora, export_lora
from memorization.models import trainable_params
from memorize_core import ConfigError

CFG = {"name": "l", "seed": 0,
       "data": {"corpus": "wiki-leads", "limit": 16, "block_len": 32, "min_tokens": 32, "held_out": ""},
       "trainer": {"batch_size": 4, "max_steps": 3, "lr": 1e-2, "warmup_steps": 1, "progress": False,
                   "device": "cpu"},
       "eval": {"extraction": False}, "wandb": {"mode": "disabled"}}
LORA = {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny 'pretrained' HF folder (seeded weights, own tokenizer): adapter exports need a base on disk."""
    return tiny_pretrained(tmp_path_factory)


def _config(model_dir, lora=None, **sections):
    from memorization.config import RunConfig

    data = {**CFG, **sections, "model": {"name": model_dir, "lora": {**LORA, **(lora or {})}}}
    return build(RunConfig, data)


def _base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


class _Rows:
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        return {"input_ids": self.ids[idx], "labels": self.ids[idx]}


@pytest.fixture(scope="module")
def trained(pretrained):
    """(base state before training, the trained peft model, its settings) after 3 AdamW steps."""
    settings = build(LoraSettings, LORA, prefix="model.lora")
    model = apply_lora(_base(pretrained), settings, seed=0)
    before = {k: v.clone() for k, v in _base(pretrained).state_dict().items()}
    ids = torch.randint(0, 300, (8, 24), generator=torch.Generator().manual_seed(0))
    Trainer(model, TrainerConfig(lr=1e-2, warmup_steps=0, batch_size=4, max_steps=3, progress=False,
                                 weight_decay=0.1), _Rows(ids)).fit()
    return before, model, settings


def _delta(model, settings, module):
    """B @ A * alpha/r of one adapted module, computed by hand from the trained adapters."""
    a = dict(model.named_parameters())[f"base_model.model.{module}.lora_A.default.weight"]
    b = dict(model.named_parameters())[f"base_model.model.{module}.lora_B.default.weight"]
    return (b @ a).detach() * settings.alpha / settings.r


def test_only_adapter_parameters_change(trained):
    before, model, _ = trained
    base = model.get_base_model()
    named = base.state_dict()  # tied weights under both names
    trained_names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained_names and all(".lora_A." in n or ".lora_B." in n for n in trained_names)
    for key, value in before.items():  # every base weight bit-identical (peft renames targets)
        name = key.replace("q_proj.weight", "q_proj.base_layer.weight").replace("v_proj.weight",
                                                                              "v_proj.base_layer.weight")
        assert torch.equal(named[name], value), key
    lora_b = [p.detach() for n, p in model.named_parameters() if ".lora_B." in n]
    assert all(float(p.abs().max()) > 0 for p in lora_b)  # B (initialised to 0) moved
    assert trainable_params(model) == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def test_merged_export_equals_base_plus_adapter_delta(trained, tmp_path):
    before, model, settings = trained
    export_lora(model, tmp_path / "m", settings)
    merged = load_file(str(tmp_path / "m" / "model.safetensors"))
    targets = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")]
    for key, base in before.items():
        if key not in merged:  # the tied LM head is stored once
            assert key == "lm_head.weight"
            continue
        module = key.rpartition(".")[0]
        if module in targets:
            torch.testing.assert_close(merged[key], base + _delta(model, settings, module), rtol=0, atol=1e-6)
            assert not torch.equal(merged[key], base)
        else:
            assert torch.equal(merged[key], base), key
    note = json.loads((tmp_path / "m" / "lora.json").read_text())
    assert note["trainable_params"] == trainable_params(model) and note["export"] == "merged"


def test_adapter_export_reloads_to_the_same_logits(trained, pretrained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, model, settings = trained
    adapter = build(LoraSettings, {**LORA, "export": "adapter"}, prefix="model.lora")
    out = export_lora(model, tmp_path / "a", adapter, base_dir=pretrained, base_name=pretrained)
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        by_peft = PeftModel.from_pretrained(_base(pretrained), out).eval()(input_ids=ids).logits
        by_auto = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits  # what evaluators do
        export_lora(model, tmp_path / "m", settings)
        by_merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()(input_ids=ids).logits
    assert torch.equal(by_peft, want) and torch.equal(by_auto, want)
    torch.testing.assert_close(by_merged, want, rtol=0, atol=1e-5)


def test_target_modules_that_match_nothing_are_refused_before_anything_is_written(pretrained, tmp_path):
    from memorization.train.pipeline import run_training

    for bad in (["q_proj", "qproj"], "attn\\..*"):
        with pytest.raises(ConfigError) as e:
            run_training(_config(pretrained, {"target_modules": bad}), tmp_path / "o", progress=False)
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and msg.startswith("model.lora.target_modules=")
        assert "q_proj" in msg and "all-linear" in msg
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError, match=r"^model\.lora\.r="):
        _config(pretrained, {"r": 0})


def test_baseless_adapters_and_sharded_dropout_are_refused(pretrained, tmp_path):
    from memorization.train.pipeline import run_training

    with pytest.raises(ConfigError, match=r"^model\.lora\.export='adapter'.*random-init.*merged"):
        run_training(_config("tiny", {"export": "adapter"}), tmp_path / "o", progress=False)
    for grid in ("2,1,1,1", "1,2,1,1", "1,1,2,1"):  # the grid is checked before the processes are
        with pytest.raises(ConfigError, match=r"^model\.lora\.dropout=0\.1: .*model\.lora\.dropout=0") as e:
            run_training(_config(pretrained, {"dropout": 0.1}, grid=grid), tmp_path / "o", progress=False)
        assert len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_lora_with_goldfish_trains(pretrained, tmp_path):
    from memorization.train.pipeline import run_training

    cfg = _config(pretrained, goldfish={"enabled": True, "k": 2, "h": 4})
    summary = run_training(cfg, tmp_path / "g", progress=False)
    lines = [json.loads(x) for x in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert summary["loss"] == "goldfish" and summary["steps"] == 3 and len(lines) == 3
    assert all(m["dropped_tokens"] > 0 for m in lines)  # the mask applies under LoRA too
    assert 0 < summary["trainable_params"] < summary["params"] / 10
    merged = load_file(str(tmp_path / "g" / "model" / "model.safetensors"))
    base = _base(pretrained).state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[key], base[key])  # the adapters learned something
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])


def _dp_run(rank, world, model_dir, out):
    import axonn
    from memorization.train.pipeline import run_training

    run_training(_config(model_dir), out, grid=axonn.ProcessGrid(1, 1, 1, 2), progress=False)


@pytest.mark.distributed
def test_data_parallel_equals_serial(pretrained, tmp_path):
    from memorization.train.pipeline import run_training

    serial_summary = run_training(_config(pretrained), tmp_path / "serial", progress=False)
    run_distributed(_dp_run, 2, pretrained, str(tmp_path / "dp"), timeout=240)
    runs = {k: [json.loads(x)["loss"] for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
            for k in ("serial", "dp")}
    assert len(runs["serial"]) == 3 and runs["dp"] == pytest.approx(runs["serial"], rel=1e-5, abs=1e-6)
    a, b = (load_file(str(tmp_path / k / "model" / "model.safetensors")) for k in ("serial", "dp"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    summary = json.loads((tmp_path / "dp" / "run.json").read_text())["summary"]
    assert summary["grid"] == "1,1,1,2" and summary["trainable_params"] == serial_summary["trainable_params"]


def test_cli_train_with_lora_writes_a_loadable_model(pretrained, tmp_path):
    import yaml
    from transformers import AutoModelForCausalLM

    from memorization.cli import main

    cfg = {**CFG, "model": {"name": pretrained}, "eval": {"extraction": True, "prefix": 8, "suffix": 8}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    assert main(["train", str(path), "--out", str(out), "--steps", "2", "model.lora.enabled=true",
                 "model.lora.target_modules=all-linear"]) == 0
    summary = json.loads((out / "run.json").read_text())["summary"]
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert summary["trainable_params"] < summary["params"] == sum(p.numel() for p in model.parameters()) \
        + summary["trainable_params"]
    assert not any("lora" in n for n, _ in model.named_parameters()) and summary["docs"] > 0
    assert (out / "extraction.jsonl").is_file()

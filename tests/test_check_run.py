"""One check of a run (memorization.train.run_plan.check_run): every refusal the run makes, its dry run makes
with the same one line; nothing is written; an experiment checks every sub-run before the first trains.

Grids of several processes are refused before any collective, so a single process that announces a
launch of W ranks (WORLD_SIZE=W, as torchrun sets it) shows the run's refusal without starting them.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import TINY, checkpoint_trainer, tiny_base_yaml, tiny_model

from memorization.cli import main

DP = ["trainer.dp.enabled=true", "trainer.dp.noise_multiplier=1.0", "trainer.dp.delta=1e-3"]
LORA = ["model.lora.enabled=true"]

# (overrides, --grid, processes, a phrase of the refusal): TINY has 4 heads, hidden 32, batch 4 and
# 12 documents (about 11 rows)
REFUSALS = [
    (LORA + ["model.lora.dropout=0.1"], "1,2,1,1", 2, "model.lora.dropout=0.1: adapter dropout runs"),
    (LORA + ["model.lora.r=0"], "2,1,1,1", 2, "model.lora.r=0: must be >= 1"),
    (DP + ["trainer.dp.clipping=per_sample"], "1,1,2,1", 2, "per-sample gradients run serial"),
    (DP + ["trainer.dp.clipping=per_sample"], "1,2,1,1", 2, "per-sample gradients run serial"),
    (DP + ["trainer.dp.secure_rng=true"], "1,2,1,1", 2, "trainer.dp.secure_rng=True: ghost clipping on 2"),
    (DP + ["trainer.dp.clipping=fast"], "1,1,1,1", 1, "trainer.dp.clipping='fast': choose one of"),
    (DP + ["trainer.dp.clipping=per_sample", "trainer.activation_checkpointing=true"], "1,1,1,1", 1,
     "trainer.activation_checkpointing"),
    (DP[:2] + ["trainer.dp.delta=0.5"], "1,1,1,1", 1, "trainer.dp.delta=0.5: must be < 1/N"),
    (DP + ["trainer.batch_size=64"], "1,1,1,1", 1, "trainer.batch_size=64: DP-SGD samples"),
    (DP + ["trainer.dp.max_grad_norm=.inf"], "1,1,1,1", 1, "trainer.dp.max_grad_norm=inf"),
    (LORA + ["model.lora.target_modules=[nope]"], "1,1,1,1", 1, "matches no module"),
    (LORA + ["model.lora.target_modules=q_proj[("], "1,1,1,1", 1, "not a valid regular expression"),
    ([], "1,3,1,1", 3, "grid.y=3: must divide hidden_size=32"),
    ([], "1,1,1,3", 3, "trainer.batch_size=4"),
    ([], "1,1,1,2", 3, "x*y*z*data=2 but the job has 3"),
    # grid auto: the planner's choice is the plan's, refused the same way
    (["trainer.micro_batch=3"], "auto", 2, "--grid='auto': no grid of 2 processes can run this config"),
    # data-dependent: membership inference needs held-out documents (the dry run prepares the data)
    (["eval.mia=true", "data.held_out_fraction=0.01"], "1,1,1,1", 1, "eval.mia=True: needs at least 2"),
]


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY)
    return p


def _refusal(capsys, argv) -> str:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    line = err.splitlines()[-1]  # third-party progress output may precede it
    assert line.startswith("error: "), err
    return line


def _launched(monkeypatch, world: int) -> None:
    if world > 1:  # as torchrun announces it; refused before any process group is made
        for k, v in {"WORLD_SIZE": world, "RANK": 0, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": world,
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}.items():
            monkeypatch.setenv(k, str(v))


@pytest.mark.parametrize("overrides,grid,world,phrase", REFUSALS)
def test_the_dry_run_refuses_what_the_run_refuses_with_the_same_line(capsys, monkeypatch, tmp_path, cfg,
                                                                    overrides, grid, world, phrase):
    out = tmp_path / "out"
    dry = _refusal(capsys, ["train", cfg, "--dry-run", "--world", world, "--grid", grid, "--out", out,
                            *overrides])
    _launched(monkeypatch, world)
    ran = _refusal(capsys, ["train", cfg, "--grid", grid, "--out", out, *overrides])
    assert ran == dry and phrase in ran, (ran, dry)
    assert not out.exists()


def test_resume_refusals_are_the_dry_runs_and_leave_nothing(capsys, tmp_path, cfg):
    """A checkpoint of another model, and a plain checkpoint resumed with LoRA on (it used to fail
    after metrics.jsonl and the W&B run were opened)."""
    out = tmp_path / "out"
    other = checkpoint_trainer(tmp_path / "ck", checkpoint_every=2, max_steps=2)
    other.fit()
    ck = tmp_path / "ck" / "step-00000002"
    for extra in ([], LORA):
        argv = ["train", cfg, "--out", out, "--resume", ck, *extra]
        ran = _refusal(capsys, argv)
        assert ran == _refusal(capsys, argv + ["--dry-run", "--world", 1]) and "--resume" in ran
    assert main(["train", str(cfg), "--out", str(out), "--checkpoint-every", "2"]) == 0  # this model's
    (out / "metrics.jsonl").unlink()
    mine = out / "checkpoints" / "step-00000002"
    argv = ["train", cfg, "--out", out, "--resume", mine, *LORA]
    ran = _refusal(capsys, argv)
    assert ran == _refusal(capsys, argv + ["--dry-run", "--world", 1])
    assert "has no tensor" in ran and "checkpoint" in ran
    assert not (out / "metrics.jsonl").exists() and not (out / "wandb").exists()


def test_flags_and_occupied_out_are_refused_by_the_dry_run_too(capsys, tmp_path, cfg):
    out = tmp_path / "out"
    for flags in (["--steps", "0"], ["--checkpoint-every", "0"], ["--resume", "auto", "--overwrite"]):
        argv = ["train", cfg, "--out", out, *flags]
        assert _refusal(capsys, argv) == _refusal(capsys, argv + ["--dry-run", "--world", 1])
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    argv = ["train", cfg, "--out", out]
    ran = _refusal(capsys, argv)
    assert ran == _refusal(capsys, argv + ["--dry-run", "--world", 1]) and "--overwrite" in ran


def test_a_pretrained_model_refuses_a_corpus_bpe_alike(capsys, tmp_path, cfg):
    tiny_model(vocab=64).save_pretrained(tmp_path / "m")
    argv = ["train", cfg, "--out", tmp_path / "out", f"model.name={tmp_path / 'm'}", "data.tokenizer=bpe"]
    ran = _refusal(capsys, argv)
    assert ran == _refusal(capsys, argv + ["--dry-run", "--world", 1]) and "data.tokenizer='bpe'" in ran


def slurm_main(argv):
    spec = importlib.util.spec_from_file_location("slurm_script", Path(__file__).resolve().parents[1]
                                                  / "scripts" / "slurm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_binary_configs_are_one_line(capsys, tmp_path):
    binary = tmp_path / "c.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    for command in ("train", "run"):
        assert "not a text file" in _refusal(capsys, [command, binary])
    capsys.readouterr()
    assert slurm_main(["--cluster", "generic", "--nodes", "1", "--config", str(binary), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a text file" in err[0]
    assert slurm_main(["--cluster", "generic", "--nodes", "1", "--config", str(binary), "--dry-run",
                       "--port", "99999"]) == 2
    assert "--port" in capsys.readouterr().err


def test_export_of_a_model_folder_says_what_it_is(capsys, tmp_path):
    tiny_model(vocab=64).save_pretrained(tmp_path / "m")
    line = _refusal(capsys, ["export", tmp_path / "m", tmp_path / "out"])
    assert "Hugging Face model folder" in line and "interrupted" not in line
    assert not (tmp_path / "out").exists()


# -- an experiment: every arm checked before the first trains -----------------------------------------
BASE = tiny_base_yaml(max_steps=1)

EXPERIMENT = """
kind: mitigations
name: mit
passes: 1
counts: [1]
canaries: {{per_count: 1, template: "the code is {{secret}}", space: {{kind: digits, length: 2}}}}
duplicates: {{per_count: 1}}
bootstrap: 0
other_held_out: lee-news
other_held_out_limit: 4
arms: [{{name: none, mitigation: none}}, {{name: goldfish, mitigation: goldfish,
         overrides: [goldfish.enabled=true]}}, {{name: third, mitigation: x, overrides: {third}}}]
base:
  data: {{corpus: wiki-leads, limit: 28, held_out: "", held_out_fraction: 0.5, block_len: 40, min_tokens: 40}}
  model: {{name: {model}}}
  trainer: {{lr: 3.0e-3, warmup_steps: 1, batch_size: 4, progress: false}}
  eval: {{prefix: 16, suffix: 16, batch_size: 8}}
  wandb: {{mode: disabled}}
"""


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    (root / "base.yaml").write_text(BASE)
    assert main(["train", str(root / "base.yaml"), "--out", str(root / "run")]) == 0
    return root / "run" / "model"


@pytest.mark.parametrize("third,phrase", [
    ("[model.lora.enabled=true, 'model.lora.target_modules=[nope]']", "matches no module"),
    ("[trainer.dp.enabled=true, trainer.dp.noise_multiplier=1.0, trainer.dp.delta=0.5]",
     "trainer.dp.delta=0.5"),
])
def test_an_experiment_refuses_its_third_arm_before_the_first_trains(capsys, tmp_path, pretrained, third,
                                                                     phrase):
    path = tmp_path / "mit.yaml"
    path.write_text(EXPERIMENT.format(third=third, model=pretrained))
    out = tmp_path / "out"
    ran = _refusal(capsys, ["run", path, "--out", out])
    assert phrase in ran
    assert ran == _refusal(capsys, ["run", path, "--dry-run", "--world", 1])
    written = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert written == []  # no manifest.json, no runs/*/inputs.json


def test_an_experiment_dry_run_refuses_its_arms_grids(capsys, monkeypatch, tmp_path, pretrained):
    path = tmp_path / "mit.yaml"
    path.write_text(EXPERIMENT.format(third="[model.lora.enabled=true, model.lora.dropout=0.1]",
                                      model=pretrained))
    dry = _refusal(capsys, ["run", path, "--dry-run", "--world", 2, "--grid", "1,1,2,1"])
    _launched(monkeypatch, 2)
    ran = _refusal(capsys, ["run", path, "--grid", "1,1,2,1", "--out", tmp_path / "out"])
    assert ran == dry and "model.lora.dropout=0.1: adapter dropout" in ran
    assert not (tmp_path / "out").exists()

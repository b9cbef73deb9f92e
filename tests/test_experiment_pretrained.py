"""pretrained-memorization end to end on a micro config: a tiny briefly-trained model stands in
for SmolLM2."""
from __future__ import annotations

import json

import pytest
from helpers import trained_base

from memorization.cli import main

EXPERIMENT = """
kind: pretrained-memorization
name: pm
passes: 2
bootstrap: 50
other_held_out: lee-news
other_held_out_limit: 6
samples: 2
base:
  data: {{corpus: wiki-leads, limit: 24, held_out: "", held_out_fraction: 0.5, block_len: 40, min_tokens: 40}}
  model: {{name: {model}}}
  trainer: {{lr: 3.0e-3, warmup_steps: 1, batch_size: 4, progress: false}}
  eval: {{prefix: 16, suffix: 16, batch_size: 8}}
  wandb: {{mode: disabled}}
"""


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny model trained for 3 steps and exported: a local 'pretrained' HF folder with its tokenizer."""
    return trained_base(tmp_path_factory.mktemp("base"), max_steps=3)


def test_experiment_end_to_end(pretrained, tmp_path, cache_dir):
    cfg = tmp_path / "pm.yaml"
    cfg.write_text(EXPERIMENT.format(model=pretrained))
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    names = [r["name"] for r in report["runs"]]
    assert names == ["pretrained-standard", "pretrained-goldfish", "random-init-standard"]
    for r in report["runs"]:
        assert r["loss"] in ("standard", "goldfish") and isinstance(r["pretrained"], bool)
        assert [p["pass"] for p in r["passes"]] == [0, 1, 2]  # pass 0 first, then every pass
        for p in r["passes"]:
            assert 0 <= p["exact_match_rate"] <= 1 and 0 <= p["rougeL"] <= 1
            assert p["val_loss"] > 0 and p["other_val_loss"] > 0
            assert set(p["mia"]) == {"loss", "zlib", "min_k_plus_plus", "ref_ratio"}
            for m in p["mia"].values():
                lo, hi = m["auc_ci"]
                assert lo <= m["auc"] <= hi and 0 <= m["tpr_at_1fpr"] <= 1
    std, gold, control = report["runs"]
    # pass 0 is the same base model for both pretrained arms; the control starts from other weights
    assert std["passes"][0]["val_loss"] == pytest.approx(gold["passes"][0]["val_loss"], rel=1e-6)
    assert control["passes"][0]["val_loss"] != pytest.approx(std["passes"][0]["val_loss"], rel=1e-3)
    # ref_ratio against the base model is exactly uninformative before fine-tuning: the scores are 0
    assert std["passes"][0]["mia"]["ref_ratio"]["auc"] == pytest.approx(0.5)
    assert (out / "report.md").is_file() and (out / "pretrained-mia.png").is_file()
    assert (out / "runs" / "pretrained-standard" / "passes.jsonl").read_text().count("\n") == 3
    # paired tests against the pretrained standard run, from the last pass's per-document scores in run.json
    tests = report["paired_tests"]
    assert list(tests) == ["pretrained-goldfish", "random-init-standard"]
    per = {n: json.loads((out / "runs" / n / "run.json").read_text())["summary"]["per_document"]
           for n in ("pretrained-standard", "pretrained-goldfish")}
    gold_per = per["pretrained-goldfish"]
    assert len(gold_per["exact_match"]) == len(gold_per["members"]["loss"]) == len(gold_per["rougeL"])
    em = tests["pretrained-goldfish"]["em"]
    assert em["reference"] == "pretrained-standard"
    assert em["rate_a"] == pytest.approx(gold["exact_match_rate"]) and em["rate_b"] == pytest.approx(
        std["exact_match_rate"])
    pairs = list(zip(gold_per["exact_match"], per["pretrained-standard"]["exact_match"]))
    assert (em["a_only"], em["b_only"]) == (sum(a > b for a, b in pairs), sum(a < b for a, b in pairs))
    rouge = tests["pretrained-goldfish"]["rougeL"]
    assert rouge["diff"] == pytest.approx(gold["rougeL"] - std["rougeL"])
    auc = tests["pretrained-goldfish"]["auc_loss"]
    assert auc["auc_a"] == pytest.approx(gold["passes"][-1]["mia"]["loss"]["auc"])
    assert "Paired tests: each run − 'pretrained-standard'" in (out / "report.md").read_text()
    assert all("per_document" not in p for p in gold["passes"])  # kept once, in run.json, not per pass
    # a second invocation reuses every finished run
    assert main(["run", str(cfg), "--out", str(out)]) == 0
    again = json.loads((out / "report.json").read_text())
    assert all(r["reused"] for r in again["runs"])
    assert again["runs"][0]["passes"] == std["passes"]


def test_refuses_a_random_init_base_and_a_foreign_held_out(tmp_path, cache_dir, capsys):
    cfg = tmp_path / "pm.yaml"
    cfg.write_text(EXPERIMENT.format(model="tiny"))
    assert main(["run", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "base.model.name" in capsys.readouterr().err
    cfg.write_text(EXPERIMENT.format(model="smollm2-135m"))
    assert main(["run", str(cfg), "--out", str(tmp_path / "o"), "base.data.held_out=lee-news"]) == 2
    assert "held_out_fraction" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_val_loss_from_mia_scores_equals_corpus_loss(pretrained):
    """The held-out loss derived from the MIA pass equals evals.perplexity.corpus_loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_pipelines import load_corpus, tokenize_documents
    from evals.perplexity import corpus_loss
    from memorization.experiments.questions import MiaSettings, PrivacyUtility

    tok = AutoTokenizer.from_pretrained(pretrained)
    model = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    seqs = list(tokenize_documents(load_corpus("lee-news", limit=12), tok, max_tokens=30, min_tokens=2))
    seqs[8] = seqs[8][:7]  # a ragged non-member: the token weighting matters
    q = PrivacyUtility(MiaSettings(mia_methods=["loss"], bootstrap=0, other_held_out=""), tok,
                       seqs[:6], seqs[6:], [], None)
    got = q(model)
    assert got["val_loss"] == pytest.approx(corpus_loss(model, seqs[6:])["loss"], rel=1e-5)
    assert got["other_val_loss"] is None and set(got["mia"]) == {"loss"}


SIZED = EXPERIMENT.replace("passes: 2\n",
                           "passes: 1\ncontrol: false\nsizes: [{{name: tinyA, model: {model}}}]\n")


@pytest.mark.distributed
def test_a_sharded_experiment_under_srun_scores_as_the_serial_one(pretrained, tmp_path, cache_dir):
    """The experiment kind at stand-in scale: 4 ranks (2 'nodes' x 2 tasks, the stand-in srun) at grid
    1,2,1,2 (vocab and heads split over Y, the batch over data) give the serial run's per-pass exact
    match and AUCs for every arm (standard, goldfish, LoRA, DP-SGD on LoRA): every pass is scored on
    the sharded model, in place."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from axonn.spawn import free_port

    cfg = tmp_path / "pm.yaml"
    # LoRA and DP-SGD on the adapters (no noise, a clip norm that bites) as arms beside the losses
    arms = ("arms: [{name: lora, overrides: [model.lora.enabled=true, model.lora.r=4, trainer.lr=1.0e-2]},\n"
            "  {name: dp-lora, overrides: [model.lora.enabled=true, model.lora.r=4, trainer.lr=1.0e-2,\n"
            "   trainer.dp.enabled=true, trainer.dp.noise_multiplier=0.0, trainer.dp.max_grad_norm=0.01]}]\n")
    sized = SIZED.format(model=pretrained)
    cfg.write_text(sized.replace("base:\n", arms + "base:\n  parallel_mode: paired\n"))
    assert main(["run", str(cfg), "--out", str(tmp_path / "serial")]) == 0
    standin = Path(__file__).resolve().parent / "slurm_standin.py"
    env = dict(os.environ, SLURM_JOB_ID="7", SLURM_JOB_NODELIST="127.0.0.1,127.0.0.2", SLURM_NNODES="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(standin), "srun", "--nodes=2", "--ntasks-per-node=2",
                           sys.executable, "-m", "memorization", "run", str(cfg), "--grid", "1,2,1,2",
                           "--out", str(tmp_path / "sharded")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    serial = json.loads((tmp_path / "serial" / "report.json").read_text())["runs"]
    sharded = json.loads((tmp_path / "sharded" / "report.json").read_text())["runs"]
    assert [r["name"] for r in sharded] == ["tinyA-pretrained-standard", "tinyA-pretrained-goldfish",
                                            "tinyA-pretrained-lora", "tinyA-pretrained-dp-lora"]
    lora, dp = sharded[2:]
    assert lora["arm"] == "lora" and lora["loss"] == "standard"
    assert lora["passes"][1]["val_loss"] != pytest.approx(dp["passes"][1]["val_loss"], rel=1e-6)
    for s, g in zip(serial, sharded, strict=True):
        assert [p["pass"] for p in g["passes"]] == [0, 1]
        for ps, pg in zip(s["passes"], g["passes"]):
            assert pg["exact_match_rate"] == ps["exact_match_rate"]
            assert pg["val_loss"] == pytest.approx(ps["val_loss"], rel=1e-4)
            for m, rec in ps["mia"].items():
                assert pg["mia"][m]["auc"] == pytest.approx(rec["auc"], abs=1e-9), m
    runs = json.loads((tmp_path / "sharded" / "runs" / "tinyA-pretrained-standard" / "run.json").read_text())
    assert runs["summary"]["grid"] == "1,2,1,2"

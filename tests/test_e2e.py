"""End to end through the CLI on a micro setting: train, eval, and the demo's report."""
import json

import pytest
from transformers import AutoModelForCausalLM

from memorization.cli import main

MICRO = [
    "data.limit=12", "data.vocab_size=512", "data.block_len=64", "data.min_tokens=32",
    "data.held_out_limit=8",
    "model.overrides={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 4}",
    "eval.prefix=16", "eval.suffix=16", "trainer.batch_size=4", "trainer.lr=3e-3", "trainer.warmup_steps=5",
    "trainer.progress=false",
]


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    assert main(["demo", "--out", str(out), "--epochs", "60", *MICRO]) == 0
    return out


def test_demo_report_and_the_goldfish_effect(demo_out):
    report = json.loads((demo_out / "report.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {"standard", "goldfish"}
    for r in runs.values():
        for key in ("name", "loss", "goldfish_k", "goldfish_h", "docs", "exact_match_rate", "rougeL",
                    "token_accuracy", "val_loss"):
            assert key in r
        assert r["docs"] == 12
    assert runs["goldfish"]["loss"] == "goldfish" and runs["goldfish"]["goldfish_k"] == 4
    # The core result at micro scale: standard memorizes most documents, goldfish (k=4) almost none.
    assert runs["standard"]["exact_match_rate"] >= 0.75
    assert runs["goldfish"]["exact_match_rate"] <= 0.25
    assert (demo_out / "report.png").stat().st_size > 10_000
    assert "| standard |" in (demo_out / "report.md").read_text()
    assert list((demo_out / "standard" / "wandb").glob("offline-run-*"))
    # each run's own report.png, in its folder and in its W&B run
    assert list((demo_out / "standard" / "wandb").glob("offline-run-*/files/media/images/report_*.png"))
    assert "| final training loss | held-out loss |" in (demo_out / "goldfish" / "report.md").read_text()


def test_metrics_and_export(demo_out):
    run = demo_out / "goldfish"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, len(lines) + 1))
    assert all({"step", "loss", "lr", "tokens", "dropped_loss"} <= set(m) for m in lines)
    model = AutoModelForCausalLM.from_pretrained(run / "model")
    assert model.config.hidden_size == 64
    assert (run / "model" / "model.safetensors").is_file() and (run / "model" / "tokenizer.json").is_file()


def test_eval_command_matches_the_training_run(demo_out, tmp_path, capsys):
    out = tmp_path / "eval"
    args = ["eval", "--model", str(demo_out / "standard" / "model"), "--corpus", "wiki-leads",
            "--limit", "40",
            "--prefix", "16", "--suffix", "16", "--max-tokens", "64", "--out", str(out)]
    assert main(args) == 0
    rows = [json.loads(x) for x in (out / "extraction.jsonl").read_text().splitlines()]
    assert rows and {"doc", "prefix_ids", "target_ids", "generated_ids", "exact_match", "token_accuracy",
                     "lcp", "rougeL"} <= set(rows[0])
    trained = {json.loads(x)["doc"]: json.loads(x)["exact_match"]
               for x in (demo_out / "standard" / "extraction.jsonl").read_text().splitlines()}
    for r in rows:
        if r["doc"] in trained:
            assert r["exact_match"] == trained[r["doc"]]
    summary = json.loads((out / "report.json").read_text())["extraction"]
    assert summary["docs"] == len(rows)


def test_train_command_writes_the_run(tmp_path, capsys):
    out = tmp_path / "train"
    args = ["train", "configs/train/tiny-wiki.yaml", "--out", str(out), "--steps", "3", "wandb.mode=disabled",
            *MICRO]
    assert main(args) == 0
    summary = json.loads((out / "run.json").read_text())["summary"]
    assert summary["steps"] == 3 and summary["loss"] == "standard"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert main(args) == 2, "results already there: refused without --overwrite"
    assert "--overwrite" in capsys.readouterr().err

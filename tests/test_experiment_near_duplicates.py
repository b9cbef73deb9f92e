"""goldfish-near-duplicates end to end on its smallest grid, its config checks, and its 70B dry run."""
from __future__ import annotations

import json

import pytest

from memorization.cli import main
from memorization.experiments import load_experiment, run_experiment
from memorization.experiments.near_duplicates import cells, run_configs
from memorize_core import ConfigError

CONFIG = "configs/experiments/goldfish-near-duplicates.yaml"
SMALL = ["copies=[1,3]", "edit_rates=[0,0.2]", "strategies=[none,apertus]", "clusters=2",
         "base.data.limit=10", "base.data.vocab_size=300", "base.trainer.epochs=1",
         "base.trainer.warmup_steps=1",
         "base.model.overrides={hidden_size: 32, num_hidden_layers: 1, intermediate_size: 64, "
         "num_attention_heads: 2, num_key_value_heads: 2}"]


def test_default_grid_trains_each_corpus_once():
    _, cfg = load_experiment(CONFIG)
    assert len(cells(cfg)) == 13 and len(run_configs(cfg)) == 65  # the one-copy cell once, not four times
    names = [rc.name for rc in run_configs(cfg)]
    assert len(set(names)) == len(names) and "apertus-x64-r0.1" in names
    assert {rc.goldfish.enabled for rc in run_configs(cfg) if rc.name.startswith("none-")} == {False}


@pytest.mark.parametrize("override,field", [("edit_rates=[0.5,2]", "edit_rates[1]"),
                                            ("strategies=[hash,md5]", "strategies[1]"),
                                            ("copies=[0]", "copies[0]"), ("clusters=0", "clusters[0]"),
                                            ("dedup.near_threshold=2", "dedup.near_threshold"),
                                            ("strategies=[dedup+md5]", "strategies[0]"),
                                            ("base.data.dedup.enabled=true", "base.data.dedup.enabled"),
                                            ("strategies=[none,dedup] dedup.enabled=false", "dedup.enabled")])
def test_bad_grid_names_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_experiment(CONFIG, override.split(" "))
    assert str(info.value).startswith(f"{field}=")


def test_smallest_grid_end_to_end(tmp_path):
    report = run_experiment(CONFIG, out=tmp_path, overrides=SMALL + ["base.eval.near_verbatim=2",
                                                                     "base.eval.nv_beams=2"])
    rows = report["runs"] if "runs" in report else json.loads((tmp_path / "report.json").read_text())["runs"]
    assert len(rows) == 2 * 2 * 2  # copies x rates x strategies (the one-copy cell repeated)
    assert len(list((tmp_path / "runs").iterdir())) == 3 * 2  # corpora (1, 3@0, 3@0.2) x strategies
    for r in rows:
        assert 0 <= r["exact_match_rate"] <= 1 and r["val_loss"] > 0
        assert r["np_best"] is not None and 0 <= r["np_best"] <= 1  # (n, p) beside greedy
        assert r["np_best"] <= r["near_best"] <= 1  # within 2 changed tokens: never below the exact copy
        if r["strategy"] == "none":
            assert r["suffix_coverage"] == 1.0
        else:
            assert r["single_copy_suffix"] < 1.0 and r["suffix_coverage"] >= r["single_copy_suffix"]
    exact = [r for r in rows if r["strategy"] == "apertus" and r["copies"] == 3 and r["edit_rate"] == 0]
    assert exact[0]["suffix_coverage"] == exact[0]["single_copy_suffix"]  # exact copies add nothing
    assert (tmp_path / "goldfish-near-duplicates.png").stat().st_size > 0
    assert "copies supervise" in (tmp_path / "report.md").read_text()
    assert "within 2 changed, best scheme" in (tmp_path / "report.md").read_text()
    # goldfish's cells against standard loss on the same corpus, original by original
    tests = json.loads((tmp_path / "report.json").read_text())["paired_tests"]
    assert list(tests) == ["apertus-x1-r0", "apertus-x3-r0", "apertus-x3-r0.2"]
    em = tests["apertus-x3-r0.2"]["em"]
    evals = {n: json.loads((tmp_path / "runs" / n / "evals.json").read_text())["values"]["extraction"]
             for n in ("apertus-x3-r0.2", "none-x3-r0.2")}
    pairs = [(a["exact_match"], b["exact_match"])
             for a, b in zip(evals["apertus-x3-r0.2"], evals["none-x3-r0.2"])]
    assert em["reference"] == "none-x3-r0.2" and em["n"] == 2
    assert (em["a_only"], em["b_only"]) == (sum(a > b for a, b in pairs), sum(a < b for a, b in pairs))
    assert "Paired tests: each cell − its reference" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_the_70b_version_dry_runs(capsys):
    rc = main(["run", CONFIG, "--dry-run", "--world", "64", "--hardware", "alps-h100",
               "base.model.name=llama-70b", "base.model.overrides={}", "base.grid=auto",
               "base.parallel_mode=paired", "base.data.vocab_size=128256", "base.data.block_len=2048",
               "base.trainer.batch_size=64"])
    assert rc == 0
    assert "llama-70b" in capsys.readouterr().out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from helpers import tiny_base_yaml

    root = tmp_path_factory.mktemp("base")
    (root / "base.yaml").write_text(tiny_base_yaml(max_steps=2))
    assert main(["train", str(root / "base.yaml"), "--out", str(root / "run")]) == 0
    return root / "run" / "model"


def test_a_pretrained_base_is_asked_before_fine_tuning(pretrained, tmp_path, monkeypatch):
    """The base-model row is the experiment's own evaluation of the starting weights: a fine-tune that
    cannot move them (lr 1e-12) scores exactly as it does; it is cached (a second invocation loads no
    model) and recomputed when an eval setting changes; the held-out loss the table shows equals the
    trainer's validation loss."""
    import memorization.experiments.near_duplicates as nd

    small = ["copies=[1,3]", "edit_rates=[0.2]", "strategies=[none]", "clusters=2", "base.data.limit=16",
             f"base.model.name={pretrained}", "base.model.overrides={}", "base.data.block_len=40",
             "base.data.min_tokens=40", "base.trainer.epochs=1", "base.trainer.warmup_steps=1",
             "base.trainer.lr=1.0e-12", "base.eval.prefix=16", "base.eval.suffix=16"]
    report = run_experiment(CONFIG, out=tmp_path, overrides=small)
    base, cells_ = report["baseline"], report["runs"]
    assert base["strategy"] == "base model" and base["copies"] == 0 and len(cells_) == 2
    for r in cells_:
        for key in ("exact_match_rate", "rougeL", "np_best"):
            assert r[key] == base[key], key
        assert r["val_loss"] == pytest.approx(base["val_loss"], rel=1e-6)
        trained = json.loads((tmp_path / "runs" / r["name"] / "run.json").read_text())["summary"]
        assert r["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-5)  # the trainer's definition
    assert "Base model: the pretrained weights" in (tmp_path / "report.md").read_text()

    def no_model(*_):
        raise AssertionError("the cached baseline loaded the model")

    monkeypatch.setattr(nd, "reference_model", no_model)
    assert run_experiment(CONFIG, out=tmp_path, overrides=small)["baseline"] == base
    with pytest.raises(AssertionError, match="cached baseline"):  # another suffix: evaluated again
        run_experiment(CONFIG, out=tmp_path, overrides=small + ["base.eval.suffix=12"])
    report = run_experiment(CONFIG, out=tmp_path, overrides=small + ["baseline=false"])
    assert [r["copies"] for r in report["runs"]] == [1, 3] and report["baseline"] is None


def test_dedup_strategies_train_on_the_deduplicated_corpus(tmp_path):
    """dedup / dedup+S cells train on the corpus after near-document dedup: the near-copies are gone
    (one copy per original left, its removals in OUT/dedup-x3-r0.1.json), coverage counts only what is
    left, and goldfish is on only for dedup+S."""
    over = [o for o in SMALL if not o.startswith(("copies", "edit_rates", "strategies"))]
    report = run_experiment(CONFIG, out=tmp_path, overrides=over + ["copies=[3]", "edit_rates=[0.1]",
                                                                    "strategies=[none,dedup,dedup+apertus]"])
    rows = {r["strategy"]: r for r in report["runs"]}
    assert rows["none"]["copies_trained"] == 3 and rows["dedup"]["copies_trained"] == 1
    assert rows["dedup+apertus"]["copies_trained"] == 1
    removed = json.loads((tmp_path / "dedup-x3-r0.1.json").read_text())["removals"]
    assert len(removed) == 2 * 2 and {r["kind"] for r in removed} <= {"near-document", "exact-document"}
    assert rows["dedup"]["rows"] == rows["none"]["rows"] - 4
    # the kept copy is the earliest, edited or not: standard loss supervises what it shares with the original
    assert 0.5 < rows["dedup"]["suffix_coverage"] <= rows["none"]["suffix_coverage"] == 1.0
    assert rows["dedup+apertus"]["suffix_coverage"] <= rows["dedup"]["suffix_coverage"]
    inputs = {s: json.loads((tmp_path / "runs" / f"{s}-x3-r0.1" / "inputs.json").read_text())
              for s in rows}
    assert inputs["dedup"]["extra"]["dedup"]["near_documents"] and "dedup" not in inputs["none"]["extra"]
    assert [inputs[s]["run"]["goldfish"]["enabled"] for s in rows] == [False, False, True]
    assert "copies trained" in (tmp_path / "report.md").read_text()

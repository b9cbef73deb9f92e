"""`data.dedup` in a plain training run: the near-copies never become rows, the manifest is written
beside run.json, the removed documents are not members, and a run with dedup off keeps its key."""
from __future__ import annotations

import json

from helpers import tiny_base_yaml

from data_pipelines import DuplicateSpec, inject, load_corpus
from memorization.cli import main


def _corpus(tmp_path):
    """24 Wikipedia leads, 3 of them copied 4 times with 5% of their words edited, as a JSONL file."""
    docs, manifest = inject(load_corpus("wiki-leads", limit=24),
                            duplicates=DuplicateSpec(counts=[4], per_count=3, edit_rate=0.05), seed=0)
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d.text}) + "\n" for d in docs))
    return path, len(docs)


def test_a_run_trains_on_the_deduplicated_documents(tmp_path, capsys):
    path, n_docs = _corpus(tmp_path)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(tiny_base_yaml(max_steps=1).replace("corpus: wiki-leads, limit: 20", f"corpus: {path}"))
    over = ["data.dedup.enabled=true", "data.dedup.near_documents=true", "data.dedup.near_threshold=0.5"]
    assert main(["train", str(cfg), "--out", str(tmp_path / "on"), *over]) == 0
    assert main(["train", str(cfg), "--out", str(tmp_path / "off")]) == 0
    on, off = (json.loads((tmp_path / d / "run.json").read_text()) for d in ("on", "off"))
    manifest = json.loads((tmp_path / "on" / "dedup.json").read_text())
    removed = {r["doc_id"] for r in manifest["removals"]}
    assert len(removed) == 3 * 3 and on["summary"]["dedup"]["kept_documents"] == n_docs - 9
    assert on["summary"]["dedup"]["removed"]["near-document"] >= 7  # some copy may come out unedited
    assert set(on["documents"]["members"]) == set(off["documents"]["members"]) - removed
    assert not (tmp_path / "off" / "dedup.json").exists() and "dedup" not in off["summary"]


def test_dedup_of_a_chat_corpus_is_refused_before_anything_is_written(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(tiny_base_yaml(max_steps=1))
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--out", str(out), "data.corpus=wiki-chat", "data.format=chat",
                 "data.dedup.enabled=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: data.dedup.enabled=True") and not out.exists()


def test_the_audit_canaries_join_the_deduplicated_tokens_and_the_key_stays_when_off(tmp_path):
    """eval.audit's canaries are added after dedup without tokenizing the documents again: the spans the
    span pass cut stay cut. With dedup off the run key holds no dedup settings (older runs reusable)."""
    from memorization.config import load_run_config
    from memorization.experiments.runner import run_key
    from memorization.train.prepare import prepare_data

    path, _ = _corpus(tmp_path)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(tiny_base_yaml(max_steps=1).replace("corpus: wiki-leads, limit: 20",
                                                            f"corpus: {path}"))
    over = ["data.dedup.enabled=true", "data.dedup.min_repeat_tokens=8", "data.block_len=200"]
    plain = prepare_data(load_run_config(cfg_file, over))
    audited = prepare_data(load_run_config(cfg_file, over + ["eval.audit=true", "eval.audit_canaries=4"]))
    assert plain.dedup.counts["repeated-span"]["tokens"] > 0  # the span pass cut something
    assert audited.member_docs == plain.train_docs and audited.member_doc_ids == plain.train_doc_ids
    assert len(audited.train_docs) > len(plain.train_docs)  # the included canaries
    assert "dedup" not in run_key(load_run_config(cfg_file))["data"]
    assert run_key(load_run_config(cfg_file, over))["data"]["dedup"]["min_repeat_tokens"] == 8

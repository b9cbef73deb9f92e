"""Corpus loading: bundled corpora with their known counts, local formats, and every user-error path."""
from __future__ import annotations

import json

import pytest
import torch

from data_pipelines.corpora import CORPORA, Document, load_corpus
from memorize_core import ConfigError

torch.set_num_threads(1)


def _raises(field: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(f"{field}="), str(info.value)
    return str(info.value)


def test_wiki_leads_counts_and_cleaning():
    docs = load_corpus("wiki-leads")
    assert len(docs) == 99
    assert docs[0].id == "wiki-leads/Anarchism" and docs[0].source == "wiki-leads"
    assert docs[0].text.startswith("Anarchism is a political philosophy")
    assert len({d.id for d in docs}) == len(docs)
    for d in docs:
        assert "''" not in d.text and "==" not in d.text and "[[" not in d.text
        assert not d.text.startswith("Percentage of diffusely")  # Albedo's image caption is gone
    assert "wiki-leads/Albedo" in {d.id for d in docs}
    assert "wiki-leads/Ada" not in {d.id for d in docs}  # "Ada may refer to:" is a stub


def test_wiki_articles_are_longer_than_leads():
    leads = {d.id.split("/", 1)[1]: d.text for d in load_corpus("wiki-leads")}
    articles = load_corpus("wiki-articles", limit=5)
    assert len(articles) == 5
    for a in articles:
        title = a.id.split("/", 1)[1]
        assert len(a.text) > len(leads[title])
        assert not any(line.startswith("=") for line in a.text.splitlines())


def test_lee_news_and_test_split():
    docs = load_corpus("lee-news")
    assert len(docs) == 300
    assert docs[17].id == "lee-news/17"
    assert docs[0].text.startswith("Hundreds of people have been forced to vacate")
    test = load_corpus("lee-news-test")
    assert len(test) == 50
    assert any("\u00a3" in d.text for d in test)  # lee.cor is latin-1: the pound sign survives


def test_shakespeare_scenes():
    docs = load_corpus("shakespeare")
    assert len(docs) == 775
    assert docs[0].id == "shakespeare/a-midsummer-night-s-dream/0"
    assert all(d.text.startswith(("SCENE", "PROLOGUE", "Prologue")) for d in docs)
    assert not any(line.startswith("#") for d in docs for line in d.text.splitlines())
    hamlet = [d for d in docs if d.id.startswith("shakespeare/hamlet/")]
    assert hamlet[0].text.startswith("SCENE I. Elsinore.") and "Who's there?" in hamlet[0].text


def test_deterministic_and_limit():
    a, b = load_corpus("lee-news", limit=10), load_corpus("lee-news", limit=10)
    assert a == b and len(a) == 10
    assert isinstance(a[0], Document)


def test_txt_jsonl_parquet_and_directory(tmp_path):
    txt = tmp_path / "notes.txt"
    txt.write_text("first doc\n\n  second doc  \n\nthird\n", encoding="utf-8")
    docs = load_corpus(str(txt))
    assert [d.text for d in docs] == ["first doc", "second doc", "third"]
    assert [d.id for d in docs] == ["notes.txt/1", "notes.txt/3", "notes.txt/5"]

    jl = tmp_path / "data.jsonl"
    jl.write_text(json.dumps({"body": "alpha"}) + "\n\n" + json.dumps({"body": "beta", "x": 1}) + "\n")
    assert [(d.id, d.text) for d in load_corpus(str(jl), text_field="body")] == [
        ("data.jsonl/1", "alpha"), ("data.jsonl/3", "beta")]

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["one", None, "three"]}), tmp_path / "t.parquet")
    parquet = load_corpus(str(tmp_path / "t.parquet"), text_field="content")
    assert [d.text for d in parquet] == ["one", "three"]

    folder = tmp_path / "dir"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("bee\nline two")
    (folder / "sub" / "a.txt").write_text("ay")
    (folder / "empty.txt").write_text("   ")
    docs = load_corpus(str(folder))
    assert [d.id for d in docs] == ["dir/b.txt", "dir/sub/a.txt"]
    assert docs[0].text == "bee\nline two"


def test_user_errors_name_the_field(tmp_path):
    msg = _raises("corpus", load_corpus, "wiki-lead")
    assert all(name in msg for name in CORPORA)
    _raises("corpus", load_corpus, "")
    _raises("corpus", load_corpus, str(tmp_path / "missing.jsonl"))
    _raises("limit", load_corpus, "lee-news", limit=0)
    _raises("split", load_corpus, "lee-news", split="test")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    assert "line 2" in _raises("corpus", load_corpus, str(bad))
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "ok"}\n{"body": "x"}\n')
    assert "line 2" in _raises("text_field", load_corpus, str(nofield))
    _raises("text_field", load_corpus, str(tmp_path / "bad.jsonl"), text_field="body")

    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    _raises("corpus", load_corpus, str(empty))
    (tmp_path / "x.csv").write_text("a,b\n")
    _raises("corpus", load_corpus, str(tmp_path / "x.csv"))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9".encode("latin-1"))
    _raises("corpus", load_corpus, str(latin))


def test_hub_offline_is_a_config_error(monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    # Offline mode fails at once instead of retrying the network for ~25 s.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    msg = _raises("corpus", load_corpus, "hf:memorize-tests/no-such-dataset:cfg")
    assert "hub" in msg and "wiki-leads" in msg

"""Tokenizers: exact GPT-2 ids, BPE training + cache, local folders, save_pretrained, error paths."""
from __future__ import annotations

import pytest
import torch

from data_pipelines.corpora import load_corpus
from data_pipelines.tokenizer import EOT, cache_root, load_tokenizer
from memorize_core import ConfigError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def small_texts() -> list[str]:
    return [d.text for d in load_corpus("lee-news-test")]


def _raises(field: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(f"{field}="), str(info.value)
    return str(info.value)


def test_gpt2_exact_ids(tmp_path):
    tok = load_tokenizer("gpt2", cache_dir=tmp_path)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert len(tok) == 50257 and tok.eos_token_id == 50256 and tok.pad_token_id == 50256
    text = "It's a test , isn't it?\n\nYes."
    assert tok.decode(tok.encode(text)) == text


def test_bpe_trains_round_trips_and_hits_cache(tmp_path, small_texts):
    tok = load_tokenizer("bpe", texts=small_texts, vocab_size=600, cache_dir=tmp_path)
    assert len(tok) == 600
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == EOT
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id
    folders = list(tmp_path.glob("bpe-*/tokenizer.json"))
    assert len(folders) == 1
    for text in small_texts[:10] + ["Hello  world ,  spaces\tand\nnewlines \u00e9\u00e8 \u4e2d"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    mtime = folders[0].stat().st_mtime_ns
    again = load_tokenizer("bpe", texts=small_texts, vocab_size=600, cache_dir=tmp_path)
    assert folders[0].stat().st_mtime_ns == mtime  # loaded, not retrained
    for text in small_texts:
        assert again.encode(text) == tok.encode(text)
    # Other texts or another vocab size get their own cache entry.
    load_tokenizer("bpe", texts=small_texts[:25], vocab_size=600, cache_dir=tmp_path)
    load_tokenizer("bpe", texts=small_texts, vocab_size=512, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("bpe-*/tokenizer.json"))) == 3


def test_bpe_training_is_deterministic(tmp_path, small_texts):
    a = load_tokenizer("bpe", texts=small_texts, vocab_size=512, cache_dir=tmp_path / "a")
    b = load_tokenizer("bpe", texts=small_texts, vocab_size=512, cache_dir=tmp_path / "b")
    assert all(a.encode(t) == b.encode(t) for t in small_texts)


def test_cache_dir_from_environment(tmp_path, monkeypatch, small_texts):
    monkeypatch.setenv("MEMORIZE_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env" / "tokenizers"
    load_tokenizer("bpe", texts=small_texts[:10], vocab_size=300)
    assert list((tmp_path / "env" / "tokenizers").glob("bpe-*/tokenizer.json"))
    monkeypatch.delenv("MEMORIZE_CACHE")
    assert cache_root().parts[-3:] == (".cache", "memorize", "tokenizers")


def test_save_pretrained_then_load_local_folder(tmp_path, small_texts):
    tok = load_tokenizer("bpe", texts=small_texts, vocab_size=512, cache_dir=tmp_path / "cache")
    tok.save_pretrained(tmp_path / "export")
    back = load_tokenizer(str(tmp_path / "export"))
    assert back.pad_token_id == back.eos_token_id == tok.eos_token_id
    assert all(back.encode(t) == tok.encode(t) for t in small_texts[:5])

    g = load_tokenizer("gpt2", cache_dir=tmp_path / "cache")
    g.save_pretrained(tmp_path / "gpt2-export")
    assert load_tokenizer(str(tmp_path / "gpt2-export")).encode("Hello world") == [15496, 995]


def test_wiki_leads_bpe_4096(tmp_path):
    texts = [d.text for d in load_corpus("wiki-leads")]
    tok = load_tokenizer("bpe", texts=texts, vocab_size=4096, cache_dir=tmp_path)
    assert len(tok) == 4096
    lengths = [len(tok.encode(t)) for t in texts]
    assert sum(n >= 64 for n in lengths) >= 90  # the 32+32-token extraction protocol fits most leads
    assert all(tok.decode(tok.encode(t)) == t for t in texts)


def test_user_errors_name_the_field(tmp_path, small_texts):
    _raises("texts", load_tokenizer, "bpe", cache_dir=tmp_path)
    _raises("texts", load_tokenizer, "bpe", texts=[], cache_dir=tmp_path)
    _raises("vocab_size", load_tokenizer, "bpe", texts=small_texts, vocab_size=100, cache_dir=tmp_path)
    _raises("tokenizer", load_tokenizer, str(tmp_path / "no-such-folder"))
    _raises("tokenizer", load_tokenizer, "")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text("{not json")
    _raises("tokenizer", load_tokenizer, str(tmp_path / "junk"))

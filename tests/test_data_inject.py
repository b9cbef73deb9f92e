"""Injection: canary spaces, exact copy counts, manifest round trip, and token positions that hold."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from data_pipelines.canaries import SecretSpace, canary_candidates, render
from data_pipelines.corpora import load_corpus
from data_pipelines.inject import CanarySpec, DuplicateSpec, Manifest, inject, record_token_positions
from data_pipelines.packing import pack, per_document, tokenize_documents
from data_pipelines.tokenizer import load_tokenizer
from memorize_core import ConfigError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base():
    return load_corpus("lee-news-test")


@pytest.fixture(scope="module")
def tok(base, tmp_path_factory):
    return load_tokenizer("bpe", texts=[d.text for d in base], vocab_size=512,
                          cache_dir=tmp_path_factory.mktemp("tok"))


def _raises(field: str, fn, *args, **kwargs) -> None:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(f"{field}="), str(info.value)


def test_secret_spaces():
    digits = SecretSpace("digits", 3)
    assert digits.size == 1000 and digits.secret(7) == "007"
    assert canary_candidates(digits) == [f"{i:03d}" for i in range(1000)]
    words = SecretSpace("words", 2, vocab_size=30, word_seed=1)
    assert words.size == 900 and len(set(words.words)) == 30
    assert words.words == SecretSpace("words", 2, vocab_size=30, word_seed=1).words
    assert words.words != SecretSpace("words", 2, vocab_size=30, word_seed=2).words
    assert len({words.secret(i) for i in range(words.size)}) == 900
    assert all(len(words.secret(i).split()) == 2 for i in range(0, 900, 97))

    big = SecretSpace("digits", 12)
    a = big.sample(5, seed=3)
    assert a == big.sample(5, seed=3) and a != big.sample(5, seed=4) and len(set(a)) == 5
    cands = canary_candidates(big, template="pin {secret}", num=50, include=["000000000042"], seed=9)
    assert cands[0] == "pin 000000000042" and len(set(cands)) == 50
    assert render("my code is {secret}.", "123") == "my code is 123."


def test_inject_counts_and_positions(base):
    canaries = CanarySpec(num_canaries=6, repeats=[1, 2, 4], space=SecretSpace("digits", 6))
    duplicates = DuplicateSpec(counts=[1, 2, 4, 8], per_count=2)
    out, manifest = inject(base, canaries=canaries, duplicates=duplicates, seed=11)

    assert [i.count for i in manifest.of_kind("canary")] == [1, 2, 4, 1, 2, 4]
    assert sorted(i.count for i in manifest.of_kind("duplicate")) == [1, 1, 2, 2, 4, 4, 8, 8]
    assert len(out) == manifest.num_documents == len(base) - 8 + 14 + 30
    assert len({d.id for d in out}) == len(out)
    ids = Counter(d.id for d in out)
    for item in manifest.items:
        assert len(item.positions) == item.count == len(set(item.positions))
        for c, pos in enumerate(item.positions):
            assert out[pos].id == f"{item.id}@{c}" and out[pos].text == item.text
    # A duplicated document appears exactly `count` times in all; other base docs once, in order.
    texts = Counter(d.text for d in out)
    for item in manifest.of_kind("duplicate"):
        assert texts[item.text] == item.count and item.source_id in {d.id for d in base}
    untouched = [d.id for d in out if "@" not in d.id]
    assert untouched == [d.id for d in base if f"duplicate/{d.id}" not in {i.id for i in manifest.items}]
    assert all(ids[k] == 1 for k in ids)
    for item in manifest.of_kind("canary"):
        assert item.text == f"my secret code is {item.secret}" and item.space["length"] == 6

    again, manifest2 = inject(base, canaries=canaries, duplicates=duplicates, seed=11)
    assert again == out and manifest2 == manifest
    other, _ = inject(base, canaries=canaries, duplicates=duplicates, seed=12)
    assert [d.id for d in other] != [d.id for d in out]
    # Copies are scattered, not bunched at the end.
    positions = [p for item in manifest.items for p in item.positions]
    assert min(positions) < len(out) // 4 and max(positions) > 3 * len(out) // 4


@pytest.mark.parametrize("layout", ["packed", "per_document"])
def test_token_positions_find_every_copy(base, tok, tmp_path, layout):
    canaries = CanarySpec(num_canaries=4, repeats=[1, 3], space=SecretSpace("words", 4, vocab_size=200))
    out, manifest = inject(base, canaries=canaries, duplicates=DuplicateSpec(counts=[2, 5]), seed=0)
    token_lists = tokenize_documents(out, tok, max_tokens=200, min_tokens=8)
    if layout == "packed":
        blocks = pack(token_lists, 64, tok.eos_token_id)
    else:
        blocks = per_document(token_lists, 96, tok.pad_token_id)
    record_token_positions(manifest, blocks, token_lists)
    found = 0
    for item in manifest.items:
        limit = 200 if layout == "packed" else 96
        expected = tok.encode(item.text, add_special_tokens=False)[:limit]
        assert len(item.token_positions) == item.count
        for spans in item.token_positions:
            got = [t for r, s, e in spans for t in blocks.input_ids[r, s:e].tolist()]
            assert got == expected
            found += 1
    assert found == sum(i.count for i in manifest.items) == (1 + 3) * 2 + 2 + 5
    assert manifest.blocks["packed"] == (layout == "packed")

    manifest.to_json(tmp_path / "manifest.json")
    assert Manifest.from_json(tmp_path / "manifest.json") == manifest


def test_dropped_copies_have_no_token_positions(base, tok):
    # A long template-free canary survives, a one-word one is dropped by min_tokens.
    out, manifest = inject(base[:5], canaries=CanarySpec(num_canaries=2, template="{secret}",
                                                         space=SecretSpace("digits", 2)), seed=1)
    token_lists = tokenize_documents(out, tok, min_tokens=5)
    record_token_positions(manifest, pack(token_lists, 32, tok.eos_token_id), token_lists.kept)
    assert all(spans == [] for item in manifest.of_kind("canary") for spans in item.token_positions)


def test_exposure_space_matches_injection(base):
    space = SecretSpace("digits", 4)
    _, manifest = inject(base, canaries=CanarySpec(num_canaries=3, space=space), seed=5)
    candidates = canary_candidates(space, template="my secret code is {secret}")
    assert len(candidates) == space.size
    for item in manifest.of_kind("canary"):
        assert item.text in candidates
        assert SecretSpace(**item.space) == space
    assert math.log2(space.size) == pytest.approx(13.2877, abs=1e-3)


def test_user_errors_name_the_field(base, tmp_path):
    _raises("canaries.template", CanarySpec, template="no placeholder")
    _raises("canaries.template", CanarySpec, template="{secret} and {other}")
    _raises("canaries.num_canaries", CanarySpec, num_canaries=0)
    _raises("canaries.repeats", CanarySpec, repeats=[])
    _raises("canaries.repeats", CanarySpec, repeats=[1, 0])
    _raises("canaries.space.kind", SecretSpace, "letters", 3)
    _raises("canaries.space.size", CanarySpec, space={"kind": "digits", "size": 3})
    _raises("canaries.space.length", SecretSpace, "digits", 0)
    _raises("canaries.space.vocab_size", SecretSpace, "words", 3, vocab_size=10**6)
    tiny_space = CanarySpec(num_canaries=20, space=SecretSpace("digits", 1))
    _raises("canaries.num_canaries", inject, base, canaries=tiny_space, seed=0)
    _raises("duplicates.counts", DuplicateSpec, counts=[2, "x"])
    _raises("duplicates.per_count", DuplicateSpec, per_count=0)
    _raises("duplicates.counts", inject, base, duplicates=DuplicateSpec(counts=list(range(1, 60))), seed=0)
    _raises("seed", inject, base, seed=None)
    _raises("num", canary_candidates, SecretSpace("digits", 9))
    _raises("manifest", Manifest.from_json, tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text('{"seed": 1}')
    _raises("manifest", Manifest.from_json, tmp_path / "bad.json")

"""Deduplication: exactly the injected repeats go, hand-checked span rules, a brute-force reference."""
from __future__ import annotations

import random

import numpy as np
import pytest

from axonn.config import build
from data_pipelines import dedup as dedup_module
from data_pipelines.corpora import Document, load_corpus
from data_pipelines.dedup import DedupConfig, DedupManifest, deduplicate
from data_pipelines.inject import CanarySpec, DuplicateSpec, SecretSpace, inject
from data_pipelines.packing import tokenize_documents
from data_pipelines.tokenizer import load_tokenizer
from memorize_core import ConfigError

ON = DedupConfig(enabled=True)


def _docs(n: int) -> list[Document]:
    # Distinct texts, so only the span pass acts on these synthetic token lists.
    return [Document(f"d{i}", f"document {i}", "test") for i in range(n)]


def _spans(lists: list[list[int]], n: int, **kw) -> tuple[list[list[int]], DedupManifest]:
    cfg = DedupConfig(enabled=True, min_repeat_tokens=n, **kw)
    out, manifest = deduplicate(_docs(len(lists)), lists, cfg)
    return [list(t) for t in out], manifest


def _cuts(manifest: DedupManifest) -> list[tuple]:
    return [(r.doc_id, r.kind, r.start, r.end, r.first_id, r.first_start) for r in manifest.removals]


@pytest.fixture(scope="module")
def wiki():
    return load_corpus("wiki-leads")


@pytest.fixture(scope="module")
def wiki_tok(wiki, tmp_path_factory):
    return load_tokenizer("bpe", texts=[d.text for d in wiki], vocab_size=1024,
                          cache_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def injected(wiki, wiki_tok):
    canaries = CanarySpec(num_canaries=6, repeats=[1, 2, 5], space=SecretSpace("digits", 6))
    duplicates = DuplicateSpec(counts=[1, 2, 4, 8], per_count=2)
    out, manifest = inject(wiki, canaries=canaries, duplicates=duplicates, seed=3)
    tokens = tokenize_documents(out, wiki_tok)
    assert tokens.kept == list(range(len(out)))
    return out, manifest, tokens


def _injected_repeats(out: list[Document], manifest) -> dict[str, str]:
    """Every injected copy but the earliest in corpus order -> the id of that earliest copy."""
    extra = {}
    for item in manifest.items:
        first = min(item.positions)
        extra.update({out[p].id: out[first].id for p in item.positions if p != first})
    return extra


def test_natural_wiki_leads_has_no_repeats(wiki, wiki_tok):
    # The base corpus is clean, so every removal in the injected corpus must be an injected repeat.
    _, manifest = deduplicate(wiki, tokenize_documents(wiki, wiki_tok), ON)
    assert manifest.removals == [] and manifest.num_kept_documents == len(wiki)


def test_removes_exactly_the_injected_repeats(injected, tmp_path):
    out, inj, tokens = injected
    kept, manifest = deduplicate(out, tokens, ON)
    expected = _injected_repeats(out, inj)
    assert len(expected) == (1 + 4) * 2 + (1 + 3 + 7) * 2  # canaries x[1,2,5], duplicates x[1,2,4,8] (2 each)
    got = {r.doc_id: r.first_id for r in manifest.removals}
    assert got == expected
    for r in manifest.removals:
        assert (r.kind, r.start, r.end, r.first_start) == ("exact-document", 0, len(tokens[r.doc_index]), 0)
    assert sorted(manifest.dropped) == sorted(expected)
    removed_tokens = sum(len(tokens[r.doc_index]) for r in manifest.removals)
    assert manifest.counts["exact-document"] == {"spans": 32, "documents": 32, "tokens": removed_tokens}
    assert manifest.counts["repeated-span"]["spans"] == manifest.counts["short-remainder"]["spans"] == 0
    # Every other document, original or the first copy of an injected item, is kept unchanged, in order.
    survivors = [i for i, d in enumerate(out) if d.id not in expected]
    assert kept.kept == survivors and [list(t) for t in kept] == [tokens[i] for i in survivors]
    assert manifest.num_kept_documents == len(out) - 32 == len(kept)
    assert manifest.num_kept_tokens + manifest.counts["exact-document"]["tokens"] == manifest.num_tokens
    texts = [out[i].text for i in kept.kept]
    assert all(texts.count(item.text) == 1 for item in inj.items)

    path = manifest.save(tmp_path / "dedup.json")
    assert DedupManifest.load(path) == manifest
    with pytest.raises(ConfigError, match=r"^manifest=.*overwrite=True"):
        manifest.save(path)
    manifest.save(path, overwrite=True)


def test_span_pass_alone_cuts_long_copies_only(injected):
    # Without the exact-document pass, a later copy of a >= 50-token document is one repeated
    # span from its first copy; canaries (~10 tokens) are below the threshold and all stay.
    out, inj, tokens = injected
    kept, manifest = deduplicate(out, tokens, DedupConfig(enabled=True, exact_documents=False))
    expected = {doc: first for doc, first in _injected_repeats(out, inj).items()
                if doc.startswith("duplicate/") and len(tokens[[d.id for d in out].index(doc)]) >= 50}
    assert len(expected) == (1 + 3 + 7) * 2
    assert {r.doc_id: r.first_id for r in manifest.removals} == expected
    for r in manifest.removals:
        assert (r.kind, r.start, r.end, r.first_start) == ("repeated-span", 0, len(tokens[r.doc_index]), 0)
    assert sorted(manifest.dropped) == sorted(expected)
    canary_copies = [out[p].id for item in inj.of_kind("canary") for p in item.positions]
    assert set(canary_copies) <= {out[i].id for i in kept.kept}


def test_natural_duplicates_in_lee_news(tmp_path):
    # Lee news reprints some stories: listed here so the count is a fact, not a tolerance.
    docs = load_corpus("lee-news")
    tok = load_tokenizer("bpe", texts=[d.text for d in docs], vocab_size=1024, cache_dir=tmp_path)
    _, manifest = deduplicate(docs, tokenize_documents(docs, tok), ON)
    pairs = {(r.doc_id.split("/")[1], r.kind[0], r.first_id.split("/")[1]) for r in manifest.removals}
    assert pairs == {("112", "e", "104"), ("119", "e", "115"), ("120", "e", "117"), ("156", "e", "150"),
                     ("236", "e", "230"), ("271", "e", "263"), ("288", "e", "281"),
                     ("72", "r", "59"), ("107", "r", "98"), ("191", "r", "182"), ("241", "r", "232")}


def test_threshold_is_inclusive():
    span = list(range(100, 150))
    base = [[1, 2, 3] + span + [4], [5] + span + [6]]
    out, manifest = _spans(base, 50)
    assert _cuts(manifest) == [("d1", "repeated-span", 1, 51, "d0", 3)] and out[1] == [5, 6]
    out, manifest = _spans([[1, 2, 3] + span[:49] + [4], [5] + span[:49] + [6]], 50)
    assert manifest.removals == [] and out[1] == [5] + span[:49] + [6]
    assert _spans([[1] * 4, [1] * 4], 5)[1].removals == []  # no document holds a whole window


def test_overlapping_repeats():
    # A run of one token keeps exactly one window's worth: the first occurrence stays whole.
    out, manifest = _spans([[7] * 12], 5)
    assert out == [[7] * 5] and _cuts(manifest) == [("d0", "repeated-span", 5, 12, "d0", 0)]
    # Two repeats from two sources overlapping end to end: the whole document goes, in two cuts.
    a, b = list(range(10, 20)), list(range(20, 30))
    out, manifest = _spans([a, b, a[3:] + b[:6]], 5)
    assert _cuts(manifest) == [("d2", "repeated-span", 0, 7, "d0", 3),
                               ("d2", "repeated-span", 7, 13, "d1", 0)]
    assert manifest.dropped == ["d2"] and len(out) == 2
    # Unrepeated windows around a repeat do not shield it; a first occurrence that repeats later does.
    p, q = list(range(40, 50)), [91, 92, 93]
    out, manifest = _spans([p, [90] + p[:5] + [99], p[:7] + q, p[4:7] + q[:2]], 5)
    assert _cuts(manifest) == [("d1", "repeated-span", 1, 6, "d0", 0), ("d2", "repeated-span", 0, 4, "d0", 0),
                               ("d3", "repeated-span", 0, 5, "d2", 4)]
    assert out == [p, [90, 99], p[4:7] + q]


def test_keep_first_in_corpus_order():
    x = list(range(10, 30))
    out, manifest = _spans([x[5:12], x, x[5:12]], 5)
    assert out == [x[5:12], x[:5] + x[12:]]
    assert _cuts(manifest) == [("d1", "repeated-span", 5, 12, "d0", 0),
                               ("d2", "repeated-span", 0, 7, "d0", 0)]
    docs = [Document("a", "same  text\n", "t"), Document("b", "other", "t"), Document("c", " same text", "t")]
    kept, manifest = deduplicate(docs, [[1, 2], [3], [1, 2]], ON)
    assert kept.kept == [0, 1] and _cuts(manifest) == [("c", "exact-document", 0, 2, "a", 0)]


def test_short_remainders_and_alignment():
    x = list(range(10, 30))
    out, manifest = _spans([x, [1, 2] + x[:10] + [3], [8, 9]], 5, min_doc_tokens=4)
    assert out == [x, [8, 9]]  # d1 kept 3 tokens (< 4): dropped; d2 untouched, so kept however short
    assert [r.kind for r in manifest.removals] == ["short-remainder", "repeated-span", "short-remainder"]
    assert [(r.start, r.end) for r in manifest.of_kind("short-remainder")] == [(0, 2), (12, 13)]
    # token lists with .kept (tokenize_documents dropped a document) stay tied to the right documents
    docs = [Document(f"t{i}", t, "t") for i, t in enumerate(["a b c d e f g", "x", "a b c d e f g", "z z"])]
    tokens = tokenize_documents(docs, _WordTokenizer(), min_tokens=2)
    kept, manifest = deduplicate(docs, tokens, ON)
    assert tokens.kept == [0, 2, 3] and kept.kept == [0, 3] and manifest.dropped == ["t2"]


class _WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(w[0]) for w in text.split()]


def _reference(lists: list[list[int]], n: int) -> list[set[int]]:
    """Removed offsets per document, straight from the rule in the module docstring."""
    first, repeats, kept_firsts = {}, [], set()
    for d, toks in enumerate(lists):
        for o in range(len(toks) - n + 1):
            key = tuple(toks[o:o + n])
            if key in first:
                repeats.append((d, o))
                kept_firsts.add(first[key])
            else:
                first[key] = (d, o)
    removed = [set() for _ in lists]
    for d, o in repeats:
        removed[d].update(range(o, o + n))
    for d, o in kept_firsts:
        removed[d].difference_update(range(o, o + n))
    return removed


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force(seed, monkeypatch):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, 4, 6])
    lists = [[rng.randrange(3) for _ in range(rng.randrange(0, 40))] for _ in range(12)]
    lists += [rng.choice(lists)[:] for _ in range(3)]  # whole-document copies: long copied stretches
    out, manifest = _spans(lists, n)
    removed = _reference(lists, n)
    got = [set() for _ in lists]
    for r in manifest.removals:
        d, f = r.doc_index, int(r.first_id[1:])
        got[d].update(range(r.start, r.end))
        assert lists[d][r.start:r.end] == lists[f][r.first_start:r.first_start + r.end - r.start]
    assert got == removed
    assert out == [[t for o, t in enumerate(toks) if o not in removed[d]]
                   for d, toks in enumerate(lists) if not removed[d] or len(removed[d]) < len(toks)]
    # Hash collisions (all windows, or many, in one bucket) change nothing: tokens decide.
    real = dedup_module._window_hashes
    for weak in (lambda flat, n: 0 * flat[: len(flat) - n + 1], lambda flat, n: real(flat, n) % np.uint64(5)):
        monkeypatch.setattr(dedup_module, "_window_hashes", weak)
        assert _spans(lists, n) == (out, manifest)


def test_deterministic_and_disabled(injected):
    out, _, tokens = injected
    assert deduplicate(out, tokens, ON) == deduplicate(out, tokens, ON)
    kept, manifest = deduplicate(out, tokens, DedupConfig())
    assert kept == tokens and kept.kept == tokens.kept and manifest.removals == []
    assert manifest.settings["enabled"] is False


@pytest.mark.parametrize("value", [0, -50, True, 2.5, "50"])
def test_bad_threshold_is_one_line_and_writes_nothing(value, tmp_path):
    cfg = DedupConfig(enabled=True, min_repeat_tokens=value)
    with pytest.raises(ConfigError) as info:
        _, manifest = deduplicate(_docs(2), [[1, 2], [1, 2]], cfg)
        manifest.save(tmp_path / "dedup.json")
    message = str(info.value)
    assert message.startswith(f"dedup.min_repeat_tokens={value!r}: ") and "e.g. 50" in message
    assert "\n" not in message and list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"^data\.dedup\.min_repeat_tokens=0: "):
        build(DedupConfig, {"min_repeat_tokens": 0}, prefix="data.dedup")


def test_other_bad_input():
    with pytest.raises(ConfigError, match=r"^dedup\.min_doc_tokens=0: "):
        deduplicate(_docs(1), [[1]], DedupConfig(enabled=True, min_doc_tokens=0))
    with pytest.raises(ConfigError, match=r"^dedup\.exact_documents='yes': "):
        deduplicate(_docs(1), [[1]], DedupConfig(enabled=True, exact_documents="yes"))
    with pytest.raises(ConfigError, match=r"^token_lists="):
        deduplicate(_docs(3), [[1], [2]], ON)
    with pytest.raises(ConfigError, match=r"^manifest="):
        DedupManifest.load("/nonexistent/dedup.json")

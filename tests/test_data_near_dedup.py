"""Near-duplicate document dedup: the clusters equal brute-force Jaccard, the earliest copy stays, the
manifest says why, and bad settings are one line naming the field."""
from __future__ import annotations

import itertools
import random

import pytest

from data_pipelines import DedupConfig, DedupManifest, deduplicate, inject, load_corpus, tokenize_documents
from data_pipelines.corpora import Document
from data_pipelines.inject import DuplicateSpec
from data_pipelines.near_dedup import bands, jaccard, near_duplicate_clusters, shingles
from data_pipelines.tokenizer import load_tokenizer
from memorize_core import ConfigError


def test_shingles_and_jaccard_by_hand():
    assert shingles([1, 2, 3, 4], 2) == {shingles([a, b], 2).pop() for a, b in ((1, 2), (2, 3), (3, 4))}
    assert len(shingles([7, 7, 7, 7], 2)) == 1 and shingles([5], 3) == shingles([5], 1)
    a, b = shingles([1, 2, 3, 4, 5], 2), shingles([1, 2, 3, 9, 5], 2)  # {12,23,34,45} vs {12,23,39,95}
    assert jaccard(a, b) == pytest.approx(2 / 6)
    b_, r = bands(0.5, 256)
    assert b_ * r <= 256 and (1 - 0.5 ** r) ** b_ <= 1e-3 and (1 - 0.5 ** (r + 1)) ** (256 // (r + 1)) > 1e-3


def _brute(lists, t, n):
    """Connected components of every pair with exact Jaccard >= t, as {kept: sorted removed}."""
    sets = [shingles(x, n) for x in lists]
    parent = list(range(len(lists)))

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for i, j in itertools.combinations(range(len(lists)), 2):
        if jaccard(sets[i], sets[j]) >= t:
            a, b = root(i), root(j)
            parent[max(a, b)] = min(a, b)
    out = {}
    for i in range(len(lists)):
        out.setdefault(root(i), []).append(i)
    return {k: v[1:] for k, v in out.items() if len(v) > 1}


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.8])
def test_clusters_equal_brute_force_jaccard(threshold):
    """60 random documents plus near-copies edited at rates from 2% to 40% of their tokens (similarities
    on both sides of every threshold): LSH + verification finds exactly the brute-force components."""
    rng = random.Random(0)
    lists = [[rng.randrange(400) for _ in range(rng.randrange(40, 90))] for _ in range(60)]
    for src in range(0, 60, 3):
        for rate in (0.02, 0.05, 0.1, 0.2, 0.4):
            lists.insert(rng.randrange(src + 1, len(lists) + 1),
                         [rng.randrange(400) if rng.random() < rate else x for x in lists[src]])
    want = _brute(lists, threshold, 5)
    got = {c.kept: sorted(i for i, _ in c.removed) for c in near_duplicate_clusters(lists, threshold, 5, 256)}
    assert got == want and len(want) >= 10  # a test that found nothing would prove nothing


def test_dedup_removes_near_copies_and_keeps_the_earliest(tmp_path):
    rng = random.Random(1)
    base = [[rng.randrange(300) for _ in range(80)] for _ in range(6)]
    near = [x if i % 20 else 299 - x for i, x in enumerate(base[0])]  # 4 of 80 tokens edited
    lists = base + [list(base[0]), near, list(base[3])]
    docs = [Document(f"d{i}", " ".join(map(str, t)), "x") for i, t in enumerate(lists)]
    on = DedupConfig(enabled=True, repeated_spans=False, near_documents=True, near_threshold=0.6)
    kept, m = deduplicate(docs, lists, on)
    assert kept.kept == [0, 1, 2, 3, 4, 5]
    assert [(r.doc_id, r.kind, r.first_id) for r in m.removals] == [
        ("d6", "exact-document", "d0"), ("d7", "near-document", "d0"), ("d8", "exact-document", "d3")]
    sim = m.of_kind("near-document")[0].similarity
    assert sim == pytest.approx(jaccard(shingles(near, 5), shingles(base[0], 5)), abs=1e-6) and 0.6 <= sim < 1
    assert m.counts["near-document"] == {"spans": 1, "documents": 1, "tokens": 80}
    assert DedupManifest.load(m.save(tmp_path / "d.json")).removals == m.removals  # similarity round-trips
    off, m_off = deduplicate(docs, lists, DedupConfig(enabled=True, repeated_spans=False))
    assert off.kept == [0, 1, 2, 3, 4, 5, 7] and not m_off.of_kind("near-document")  # off by default
    high, _ = deduplicate(docs, lists, DedupConfig(enabled=True, repeated_spans=False, near_documents=True,
                                                   near_threshold=0.99))
    assert high.kept == [0, 1, 2, 3, 4, 5, 7]


def test_near_copies_of_real_text_go_where_exact_spans_stay(tmp_path):
    """Wikipedia leads copied 8 times with 5% of words edited: span dedup at Lee et al.'s 50 tokens
    keeps over a third of the copies' tokens (45%); near-document dedup at Jaccard 0.5 keeps one copy of
    each lead."""
    base = load_corpus("wiki-leads", limit=20)
    tok = load_tokenizer("bpe", texts=[d.text for d in base], vocab_size=512, cache_dir=tmp_path)
    docs, manifest = inject(base, duplicates=DuplicateSpec(counts=[8], per_count=3, edit_rate=0.05), seed=0)

    lists = tokenize_documents(docs, tok)
    spans, m_spans = deduplicate(docs, lists, DedupConfig(enabled=True))
    on = DedupConfig(enabled=True, near_documents=True, near_threshold=0.5)
    near, m_near = deduplicate(docs, lists, on)
    copies = len(docs) - len(base)  # 3 leads x 7 extra copies (copy 0 is the original)
    exact = m_near.counts["exact-document"]["documents"]  # a copy whose dice edited nothing
    assert exact < 3 and m_near.counts["near-document"]["documents"] == copies - exact  # nothing else
    assert m_spans.num_kept_tokens - m_near.num_kept_tokens > 0.3 * m_near.counts["near-document"]["tokens"]
    survivors = [docs[i].id for i in near.kept]
    assert len(survivors) == len(base)
    for item in manifest.items:  # one copy of each lead stays: the earliest in corpus order
        order = {d.id: i for i, d in enumerate(docs)}
        assert [c for c in survivors if c in item.copy_ids] == [min(item.copy_ids, key=order.get)]


@pytest.mark.parametrize("field,value", [("near_threshold", 0), ("near_threshold", 1.5),
                                         ("near_threshold", True), ("near_ngram", 0), ("near_perms", 0),
                                         ("near_documents", "yes"), ("near_perms", 16)])
def test_bad_near_settings_name_the_field(field, value):
    with pytest.raises(ConfigError) as info:
        settings = {"enabled": True, "near_documents": True, "near_threshold": 0.3, field: value}
        DedupConfig(**settings).validate()
    assert str(info.value).startswith(f"dedup.{field}=") and "\n" not in str(info.value)


def test_too_few_permutations_are_refused_with_the_number_that_works():
    """LSH at 16 permutations would miss more than 1e-3 of the pairs at Jaccard 0.3: refused, naming the
    least count that does not (20: 20 bands of one row miss 0.7^20 < 1e-3, 19 miss 0.7^19 > 1e-3); a
    threshold of 1 works."""
    with pytest.raises(ConfigError, match="use >= 20$"):
        DedupConfig(enabled=True, near_documents=True, near_threshold=0.3, near_perms=16).validate()
    assert bands(0.3, 20) == (20, 1) and bands(0.3, 19) == (0, 0)
    DedupConfig(enabled=True, near_documents=True, near_threshold=0.3, near_perms=20).validate()
    lists = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8]]
    assert [(c.kept, c.removed) for c in near_duplicate_clusters(lists, 1.0, 5, 8)] == [(0, [(1, 1.0)])]


def test_a_run_key_holds_the_near_pass_only_when_it_runs():
    """Runs and experiments keyed before the near pass existed stay reusable: its settings enter a key
    only with near_documents on."""
    before = {"enabled": True, "exact_documents": True, "repeated_spans": True, "min_repeat_tokens": 50,
              "min_doc_tokens": 1}  # what a mitigations run's dedup arm stored in its inputs.json
    assert DedupConfig(enabled=True).key() == before
    assert DedupConfig(enabled=True, near_documents=True).key()["near_threshold"] == 0.8


def test_the_report_says_which_passes_ran():
    assert DedupConfig().describe() == "off"
    lee = DedupConfig(enabled=True)
    assert lee.describe() == "exact documents + repeated spans of >= 50 tokens, keep-first"
    on = DedupConfig(enabled=True, repeated_spans=False, near_documents=True, near_threshold=0.3)
    assert on.describe() == ("exact documents + near documents (Jaccard >= 0.3 of 5-token windows, MinHash "
                             "LSH, 256 permutations), keep-first")

"""Near-duplicate injection: seeded edits, an edit log that replays, an untouched rest of the corpus."""
from __future__ import annotations

import pytest

from data_pipelines.corpora import load_corpus
from data_pipelines.inject import DuplicateSpec, Manifest, inject
from data_pipelines.tokenizer import load_tokenizer
from memorize_core import ConfigError


@pytest.fixture(scope="module")
def base():
    return load_corpus("lee-news-test")[:30]


def _replay(words: list[str], edits: list[dict]) -> list[str]:
    """The copy's words from the original's and the edit log (pos counts the original's words)."""
    by_pos = {e["pos"]: e for e in edits}
    out = []
    for i, w in enumerate(words):
        e = by_pos.get(i)
        if e is None:
            out.append(w)
        elif e["kind"] == "substitute":
            assert e["old"] == w and e["new"] != w
            out.append(e["new"])
        elif e["kind"] == "insert":
            out += [e["new"], w]
        else:
            assert e["kind"] == "delete" and e["old"] == w
    return out


def test_same_seed_same_copies_other_seed_other_edits(base):
    spec = DuplicateSpec(counts=[4, 8], per_count=1, edit_rate=0.05)
    a, ma = inject(base, duplicates=spec, seed=3)
    b, mb = inject(base, duplicates=spec, seed=3)
    assert [d.text for d in a] == [d.text for d in b]
    assert [i.edits for i in ma.items] == [i.edits for i in mb.items]
    _, mc = inject(base, duplicates=DuplicateSpec(counts=[4, 8], per_count=1, edit_rate=0.05), seed=4)
    assert [i.edits for i in ma.items] != [i.edits for i in mc.items]


def test_manifest_records_cluster_and_edits_that_replay(base, tmp_path):
    spec = DuplicateSpec(counts=[16], per_count=2, edit_rate=0.1)
    out, m = inject(base, duplicates=spec, seed=0)
    m.to_json(tmp_path / "manifest.json")
    m = Manifest.from_json(tmp_path / "manifest.json")
    total_words = total_edits = 0
    for item in m.of_kind("duplicate"):
        assert item.cluster == item.source_id and len(item.edits) == len(item.copy_texts) == item.count
        assert item.edits[0] == [] and item.copy_texts[0] == item.text  # keep_original
        words = item.text.split()
        for c, (pos, edits) in enumerate(zip(item.positions, item.edits)):
            assert out[pos].id == f"{item.id}@{c}" and out[pos].text == item.copy_texts[c]
            assert _replay(words, edits) == out[pos].text.split()
            assert {e["kind"] for e in edits} <= {"substitute", "insert", "delete"}
            total_words += len(words) if c else 0
            total_edits += len(edits)
        assert len({t for t in item.copy_texts}) == item.count, "every near-copy differs"
    assert 0.07 < total_edits / total_words < 0.13  # rate 0.1 per word
    assert m.duplicates["edit_rate"] == 0.1


def test_rest_of_corpus_byte_identical_and_copies_where_exact_ones_sit(base):
    exact, me = inject(base, duplicates=DuplicateSpec(counts=[2, 4], per_count=1), seed=1)
    near, mn = inject(base, duplicates=DuplicateSpec(counts=[2, 4], per_count=1, edit_rate=0.2), seed=1)
    assert [d.id for d in exact] == [d.id for d in near]
    injected = {p for item in mn.items for p in item.positions}
    for i, (e, n) in enumerate(zip(exact, near)):
        if i not in injected:
            assert e.text.encode() == n.text.encode() and e.source == n.source
    assert [i.positions for i in me.items] == [i.positions for i in mn.items]


def test_rate_zero_gives_exact_copies(base):
    out, m = inject(base, duplicates=DuplicateSpec(counts=[5], per_count=1, edit_rate=0.0), seed=0)
    item = m.items[0]
    assert item.edits is None and item.copy_texts is None
    assert all(out[p].text == item.text for p in item.positions)
    out2, m2 = inject(base, duplicates=DuplicateSpec(counts=[5], per_count=1, keep_original=False,
                                                     edit_rate=1e-9), seed=0)
    assert all(out2[p].text == item.text for p in m2.items[0].positions)


def test_token_edits_through_the_tokenizer(base, tmp_path):
    tok = load_tokenizer("bpe", texts=[d.text for d in base], vocab_size=512, cache_dir=tmp_path)
    spec = DuplicateSpec(counts=[6], per_count=1, edit_rate=0.1, edit_unit="token", keep_original=False,
                         edit_kinds=["substitute", "delete"])
    out, m = inject(base, duplicates=spec, seed=2, tokenizer=tok)
    item = m.items[0]
    n_tokens = len(tok(item.text, add_special_tokens=False)["input_ids"])
    assert all(e and {x["kind"] for x in e} <= {"substitute", "delete"} for e in item.edits)
    assert 0.04 < sum(map(len, item.edits)) / (6 * n_tokens) < 0.16
    assert all(out[p].text != item.text for p in item.positions)
    with pytest.raises(ConfigError, match="duplicates.edit_unit"):
        inject(base, duplicates=spec, seed=2)


@pytest.mark.parametrize("key,value", [("edit_rate", 1.5), ("edit_rate", -0.1), ("edit_unit", "char"),
                                       ("edit_kinds", ["swap"]), ("edit_kinds", [])])
def test_bad_specs_name_the_field(key, value):
    with pytest.raises(ConfigError) as info:
        DuplicateSpec(**{key: value})
    assert str(info.value).startswith(f"duplicates.{key}=")

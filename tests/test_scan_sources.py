"""The corpus scan's readers and window selection: every source round-trips known tokens, `.idx`
offsets land on the right tokens, windows resume exactly, bad files are one ConfigError."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from helpers import write_indexed

from data_pipelines import load_corpus, load_tokenizer
from data_pipelines.scan_windows import Selection, WindowStats, parse_offsets, windows
from data_pipelines.token_sources import IDX_MAGIC, open_source, read_index
from memorize_core import ConfigError

DOCS = [[5, 6, 7, 8, 9, 10, 11], [300, 301], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [65535, 0, 42, 7]]


def _docs(source):
    return [t.tolist() for _, t in source.documents()]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_indexed_round_trip(tmp_path, dtype):
    docs = [d for d in DOCS if np.iinfo(dtype).max >= max(d)]
    bin_path, idx_path = write_indexed(tmp_path / "corpus", docs, dtype)
    for spec in (bin_path, idx_path, tmp_path / "corpus"):
        source = open_source(str(spec))
        assert source.kind == "indexed" and source.num_documents == len(docs)
        assert source.dtype == np.dtype(dtype).name
        assert _docs(source) == docs
        assert [d for d, _ in source.documents(2)] == list(range(2, len(docs)))


def test_idx_header_fields_and_offsets(tmp_path):
    """The header is the published layout, and each pointer is the byte offset of its document."""
    _, idx = write_indexed(tmp_path / "c", DOCS, np.uint16)
    raw = idx.read_bytes()
    assert raw[:9] == IDX_MAGIC and struct.unpack("<Q", raw[9:17]) == (1,) and raw[17] == 8
    head = read_index(idx)
    assert head.sizes.tolist() == [len(d) for d in DOCS]
    data = np.fromfile(tmp_path / "c.bin", dtype=np.uint16)
    for size, ptr, doc in zip(head.sizes, head.pointers, DOCS):
        assert data[ptr // 2: ptr // 2 + size].tolist() == doc
    assert head.doc_idx.tolist() == list(range(len(DOCS) + 1))


def test_windows_point_back_to_their_tokens(tmp_path):
    """With --seq-len the documents are one stream; each window's (doc, doc_offset) is where it starts."""
    write_indexed(tmp_path / "c", DOCS, np.uint16)
    source = open_source(str(tmp_path / "c.bin"))
    stream = [t for d in DOCS for t in d]
    sel = Selection(prefix=2, suffix=2, seq_len=6, offsets="stride:1")
    got = list(windows(source, sel))
    assert got, "no windows"
    for w in got:
        start = w.sequence * 6 + w.offset
        assert w.tokens.tolist() == stream[start:start + 4]
        assert stream[start] == DOCS[w.doc][w.doc_offset]
        assert sum(len(d) for d in DOCS[:w.doc]) + w.doc_offset == start


def test_npy_and_raw_bin_round_trip(tmp_path):
    flat = np.arange(50, dtype=np.uint16)
    np.save(tmp_path / "flat.npy", flat)
    assert _docs(open_source(str(tmp_path / "flat.npy"))) == [flat.tolist()]
    rows = np.arange(24, dtype=np.int32).reshape(4, 6)
    np.save(tmp_path / "rows.npy", rows)
    assert _docs(open_source(str(tmp_path / "rows.npy"))) == rows.tolist()
    flat.astype(np.uint32).tofile(tmp_path / "raw.bin")
    source = open_source(str(tmp_path / "raw.bin"), dtype="uint32")
    assert source.kind == "bin" and _docs(source) == [flat.tolist()]
    with pytest.raises(ConfigError, match="--dtype=None"):
        open_source(str(tmp_path / "raw.bin"))
    with pytest.raises(ConfigError, match="--dtype='int64'.*not a whole number"):
        np.arange(3, dtype=np.uint32).tofile(tmp_path / "odd.bin")
        open_source(str(tmp_path / "odd.bin"), dtype="int64")


def test_text_sources_use_the_model_tokenizer(tmp_path):
    texts = [" ".join(d.text.split()) for d in load_corpus("wiki-leads", limit=8)]  # one line each
    tok = load_tokenizer("bpe", texts=texts, vocab_size=300, cache_dir=tmp_path / "cache")
    want = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:3]]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t, "n": i + 1}) + "\n\n"
                                              for i, t in enumerate(texts[:3])))
    (tmp_path / "d.txt").write_text("\n".join(texts[:3]) + "\n")
    jsonl = open_source(str(tmp_path / "d.jsonl"), tokenizer=tok, count_key="n")
    assert _docs(jsonl) == want
    assert jsonl.counts == {0: 1, 1: 2, 2: 3} and jsonl.doc_id(1) == "d.jsonl/3"
    assert _docs(open_source(str(tmp_path / "d.txt"), tokenizer=tok)) == want
    bundled = open_source("wiki-leads", tokenizer=tok)
    assert len(_docs(bundled)) == 99 and bundled.doc_id(0).startswith("wiki-leads/")


def test_offsets_limit_short_and_resume(tmp_path):
    np.save(tmp_path / "rows.npy", np.arange(60, dtype=np.int64).reshape(6, 10))
    docs = [[1, 2, 3]] + [list(range(100 + 20 * i, 120 + 20 * i)) for i in range(5)]
    write_indexed(tmp_path / "c", docs, np.uint16)
    source = open_source(str(tmp_path / "c.idx"))
    stats = WindowStats()
    start = list(windows(source, Selection(4, 4), stats=stats))
    assert [w.tokens.tolist() for w in start] == [d[:8] for d in docs[1:]]
    assert (stats.sequences, stats.short, stats.windows) == (6, 1, 5)
    stride = list(windows(source, Selection(4, 4, offsets="stride:5")))
    assert [w.offset for w in stride[:3]] == [0, 5, 10]
    rand_sel = Selection(4, 4, offsets="random:3", seed=7)
    rand = [(w.sequence, w.offset) for w in windows(source, rand_sel)]
    assert rand == [(w.sequence, w.offset) for w in windows(source, rand_sel)]  # seeded: the same again
    assert len(rand) == 15 and len(set(rand)) == 15
    full = list(windows(source, Selection(2, 2, offsets="stride:3", limit=11)))
    assert len(full) == 11
    for r in (0, 4, 10):  # a resumed scan continues with exactly the rows it had not written
        tail = list(windows(source, Selection(2, 2, offsets="stride:3", limit=11), start_row=r))
        assert [(w.row, w.tokens.tolist()) for w in tail] == [(w.row, w.tokens.tolist()) for w in full[r:]]


@pytest.mark.parametrize("text", ["stride", "stride:0", "random:x", "end"])
def test_bad_offsets(text):
    with pytest.raises(ConfigError, match="--offsets"):
        parse_offsets(text)


def test_bad_sources_name_the_field(tmp_path):
    bin_path, idx_path = write_indexed(tmp_path / "c", DOCS, np.uint16)
    with open(bin_path, "r+b") as f:  # the .bin lost its tail: the .idx no longer matches it
        f.truncate(bin_path.stat().st_size - 4)
    with pytest.raises(ConfigError, match=r"--data=.*c\.idx.*does not match c\.bin"):
        open_source(str(bin_path))
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX" * 8)
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="no MMIDIDX header"):
        open_source(str(tmp_path / "x.idx"))
    (tmp_path / "t.parquet").write_bytes(b"")
    with pytest.raises(ConfigError, match="unknown format .parquet"):
        open_source(str(tmp_path / "t.parquet"))
    with pytest.raises(ConfigError, match="unknown source"):
        open_source("no-such-corpus")
    with pytest.raises(ConfigError, match="--model=None"):
        open_source("wiki-leads")  # text needs the model's tokenizer
    with pytest.raises(ConfigError, match="--dtype='float16'"):
        open_source(str(bin_path), dtype="float16")

"""Packing: EOS placement, doc ids, padding, pack/unpack round trip, seeded splits and shuffles."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from data_pipelines.corpora import Document
from data_pipelines.packing import (
    IGNORE_INDEX,
    Blocks,
    pack,
    per_document,
    split_documents,
    tokenize_documents,
    unpack,
)
from memorize_core import ConfigError

torch.set_num_threads(1)
EOS = 99


def _raises(field: str, fn, *args, **kwargs) -> None:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(f"{field}="), str(info.value)


def test_pack_layout_eos_and_padding():
    blocks = pack([[1, 2, 3], [4], [5, 6]], block_len=4, eos_id=EOS)
    assert blocks.input_ids.tolist() == [[1, 2, 3, EOS], [4, EOS, 5, 6], [EOS, EOS, EOS, EOS]]
    assert blocks.doc_ids.tolist() == [[0, 0, 0, 0], [1, 1, 2, 2], [2, -1, -1, -1]]
    assert blocks.labels.tolist() == [[1, 2, 3, EOS], [4, EOS, 5, 6], [EOS] + [IGNORE_INDEX] * 3]
    assert blocks.num_tokens == 9 and len(blocks) == 3 and blocks.block_len == 4
    assert blocks.input_ids.dtype == blocks.doc_ids.dtype == blocks.labels.dtype == torch.long
    assert unpack(blocks) == [[1, 2, 3], [4], [5, 6]]

    dropped = pack([[1, 2, 3], [4], [5, 6]], block_len=4, eos_id=EOS, drop_last=True)
    assert len(dropped) == 2 and dropped.num_tokens == 8
    assert unpack(dropped) == [[1, 2, 3], [4], [5, 6]]  # doc 2 lost only its separator

    exact = pack([[1, 2, 3]], block_len=4, eos_id=EOS)
    assert len(exact) == 1 and exact.num_tokens == 4


def test_pack_keeps_empty_documents():
    blocks = pack([[1], [], [2, 3]], block_len=3, eos_id=EOS)
    assert blocks.doc_ids.reshape(-1).tolist()[:5] == [0, 0, 1, 2, 2]
    assert unpack(blocks) == [[1], [], [2, 3]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), max_size=12), min_size=1, max_size=8), st.integers(1, 9))
def test_pack_unpack_round_trip(token_lists, block_len):
    blocks = pack(token_lists, block_len, EOS)
    assert unpack(blocks) == token_lists
    total = sum(len(t) + 1 for t in token_lists)
    assert blocks.num_tokens == total and len(blocks) == -(-total // block_len)
    real = blocks.doc_ids >= 0
    assert torch.equal(blocks.labels[real], blocks.input_ids[real])
    assert (blocks.labels[~real] == IGNORE_INDEX).all()
    # Exactly one EOS per document, and it is that document's last token.
    flat_ids, flat_docs = blocks.input_ids[real], blocks.doc_ids[real]
    for d, toks in enumerate(token_lists):
        mine = flat_ids[flat_docs == d].tolist()
        assert mine == toks + [EOS]
        # each token knows its offset in its document, also after a row boundary cut it
        assert blocks.positions[blocks.doc_ids == d].tolist() == list(range(len(toks) + 1))
    assert (blocks.positions[~real] == -1).all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), max_size=12), min_size=1, max_size=8), st.integers(1, 9))
def test_per_document_round_trip(token_lists, block_len):
    blocks = per_document(token_lists, block_len, pad_id=0)
    assert len(blocks) == len(token_lists)
    assert unpack(blocks) == [t[:block_len] for t in token_lists]
    for i, toks in enumerate(token_lists):
        k = min(len(toks), block_len)
        assert blocks.doc_ids[i].tolist() == [i] * k + [-1] * (block_len - k)
        assert blocks.labels[i].tolist() == toks[:k] + [IGNORE_INDEX] * (block_len - k)
        assert blocks.input_ids[i].tolist() == toks[:k] + [0] * (block_len - k)
        assert blocks.positions[i].tolist() == list(range(k)) + [-1] * (block_len - k)


def test_getitem_forms_and_dataloader():
    blocks = per_document([[1, 2], [3], [4, 5, 6]], block_len=3, pad_id=0)
    assert blocks[1]["input_ids"].tolist() == [3, 0, 0]
    assert blocks[[2, 0]]["doc_ids"].tolist() == [[2, 2, 2], [0, 0, -1]]
    assert blocks[torch.tensor([1])]["labels"].tolist() == [[3, IGNORE_INDEX, IGNORE_INDEX]]
    assert blocks[1:]["input_ids"].shape == (2, 3)
    loader = torch.utils.data.DataLoader(blocks, batch_size=2)
    first = next(iter(loader))
    assert (set(first) == {"input_ids", "labels", "doc_ids", "positions"}
            and first["input_ids"].shape == (2, 3))


def test_blocks_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        Blocks(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long),
               torch.zeros(2, 3, dtype=torch.long))


class _CharTokenizer:
    """A stand-in tokenizer (one id per character) so these tests need no trained vocabulary."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_tokenize_documents_truncates_and_reports_kept():
    docs = [Document("a", "hello", "t"), "hi", Document("c", "abcdefgh", "t")]
    out = tokenize_documents(docs, _CharTokenizer(), max_tokens=4, min_tokens=3)
    assert out == [[104, 101, 108, 108], [97, 98, 99, 100]]
    assert out.kept == [0, 2]
    assert tokenize_documents(docs, _CharTokenizer()).kept == [0, 1, 2]


def test_splits_and_shuffles_are_deterministic():
    docs = list(range(20))
    train, held = split_documents(docs, 0.25, seed=1)
    assert len(held) == 5 and sorted(train + held) == docs
    assert train == sorted(train) and held == sorted(held)  # input order is kept
    assert split_documents(docs, 0.25, seed=1) == (train, held)
    assert split_documents(docs, 5, seed=2) != (train, held)
    assert split_documents(docs, 0, seed=1) == (docs, [])


def test_user_errors_name_the_field():
    _raises("block_len", pack, [[1]], 0, EOS)
    _raises("block_len", pack, [[1]], 8, EOS, drop_last=True)
    _raises("eos_id", pack, [[1]], 4, None)
    _raises("token_lists", pack, [], 4, EOS)
    _raises("pad_id", per_document, [[1]], 4, -1)
    _raises("max_tokens", tokenize_documents, ["x"], _CharTokenizer(), max_tokens=0)
    _raises("min_tokens", tokenize_documents, ["x"], _CharTokenizer(), max_tokens=4, min_tokens=5)
    _raises("held_out", split_documents, [1, 2, 3], 1.5, seed=0)
    _raises("held_out", split_documents, [1, 2, 3], 3, seed=0)
    _raises("seed", split_documents, [1, 2, 3], 1, seed="x")

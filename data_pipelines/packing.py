"""Token lists -> fixed-length blocks (packed or one document per row), and seeded orderings.

Every token in a `Blocks` remembers the index of the document it came from (`doc_ids`) and its
offset inside that document (`positions`), so evals and manifests can say exactly which document
each trained token belongs to, and a label transform such as goldfish sees where a row cuts a
document. Padding is always doc id -1, position -1 and label -100 (the loss's ignore_index), so
padding is never supervised.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from memorize_core import IGNORE_INDEX, Batch, fail

T = TypeVar("T")


@dataclass
class Blocks:
    """Rows of token ids with per-token source-document index and labels (a map-style Dataset).

    `num_docs` is how many documents the rows were built from (so `unpack` returns one list per
    document even if some left no token); `eos_id` is set by `pack`, whose documents each end
    with one separator EOS that `unpack` removes. `positions` (optional; `pack` and
    `per_document` set it) is each token's offset in its document, -1 on padding: in packed rows
    a document cut at a row boundary continues at a position > 0 in the next row.
    """

    input_ids: torch.Tensor
    doc_ids: torch.Tensor
    labels: torch.Tensor
    num_docs: int | None = None
    eos_id: int | None = None
    positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tensors = [self.input_ids, self.doc_ids, self.labels]
        tensors += [self.positions] if self.positions is not None else []
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1 or self.input_ids.dim() != 2:
            raise ValueError(f"Blocks needs [N, L] tensors of one shape, got {sorted(shapes)}")
        if self.num_docs is None:
            self.num_docs = int(self.doc_ids.max()) + 1 if self.doc_ids.numel() else 0

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, idx: Any) -> Batch:
        """Rows `idx` (int, slice, list or tensor of indices) as a dict of the tensors (positions if set)."""
        if isinstance(idx, list):
            idx = torch.as_tensor(idx, dtype=torch.long)
        out: Batch = {"input_ids": self.input_ids[idx], "labels": self.labels[idx],
                      "doc_ids": self.doc_ids[idx]}
        if self.positions is not None:
            out["positions"] = self.positions[idx]
        return out

    @property
    def block_len(self) -> int:
        """Tokens per row."""
        return self.input_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens (document tokens plus pack's EOS separators)."""
        return int((self.doc_ids >= 0).sum())


class TokenLists(list):
    """`list[list[int]]` of token ids that also records, in `kept`, which input documents survived.

    `self[j]` is the tokenization of input document `kept[j]`; use `kept` to map the doc ids of
    blocks built from these lists back to the original corpus.
    """

    def __init__(self, lists: list[list[int]], kept: list[int]) -> None:
        super().__init__(lists)
        self.kept = kept


def tokenize_documents(docs: Sequence[Any], tokenizer: Any, *, max_tokens: int | None = None,
                       min_tokens: int = 0) -> TokenLists:
    """Token ids of each document (no special tokens), truncated to max_tokens, short ones dropped.

    `docs` holds `Document`s or strings. A document with fewer than `min_tokens` tokens (before
    truncation) is dropped; the result's `.kept` lists the indices of the documents kept.
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise fail("max_tokens", max_tokens, "use a positive integer, or None for whole documents")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise fail("min_tokens", min_tokens, "use an integer >= 0")
    if max_tokens is not None and min_tokens > max_tokens:
        raise fail("min_tokens", min_tokens, f"must not exceed max_tokens={max_tokens}")
    texts = [d if isinstance(d, str) else d.text for d in docs]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The backend skips transformers' "sequence longer than model_max_length" warnings and
        # per-call overhead; ids are identical.
        encoded = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    lists, kept = [], []
    for i, ids in enumerate(encoded):
        if len(ids) >= min_tokens:
            lists.append(list(ids[:max_tokens]) if max_tokens is not None else list(ids))
            kept.append(i)
    return TokenLists(lists, kept)


def _check_len(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(name, value, "use a positive integer, e.g. 128")
    return value


def _check_id(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise fail(name, value, "use a token id (integer >= 0), e.g. tokenizer.eos_token_id")
    return value


def pack(token_lists: list[list[int]], block_len: int, eos_id: int, *, drop_last: bool = False) -> Blocks:
    """Concatenate documents, each followed by one EOS (counted as its own), and cut into rows.

    The last partial row is padded (id eos_id, doc id -1, label -100), or dropped with drop_last.
    """
    block_len, eos_id = _check_len("block_len", block_len), _check_id("eos_id", eos_id)
    if not token_lists:
        raise fail("token_lists", "[]", "there are no documents to pack; check the corpus and min_tokens")
    lengths = torch.tensor([len(t) + 1 for t in token_lists], dtype=torch.long)
    ids = torch.tensor([tok for t in token_lists for tok in (*t, eos_id)], dtype=torch.long)
    docs = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    total = ids.numel()
    positions = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    rows = total // block_len if drop_last else -(-total // block_len)
    if rows == 0:
        raise fail("block_len", block_len, f"the corpus has only {total} tokens, less than one block; "
                   "lower block_len or set drop_last=False")
    pad = rows * block_len - total
    if pad > 0:
        ids = torch.cat([ids, torch.full((pad,), eos_id, dtype=torch.long)])
        docs = torch.cat([docs, torch.full((pad,), -1, dtype=torch.long)])
        positions = torch.cat([positions, torch.full((pad,), -1, dtype=torch.long)])
    ids, docs, positions = (t[: rows * block_len].view(rows, block_len) for t in (ids, docs, positions))
    labels = ids.masked_fill(docs < 0, IGNORE_INDEX)
    return Blocks(ids, docs, labels, num_docs=len(token_lists), eos_id=eos_id, positions=positions)


def per_document(token_lists: list[list[int]], block_len: int, pad_id: int) -> Blocks:
    """One document per row (row i is document i), truncated to block_len and right-padded."""
    block_len, pad_id = _check_len("block_len", block_len), _check_id("pad_id", pad_id)
    if not token_lists:
        raise fail("token_lists", "[]", "there are no documents; check the corpus and min_tokens")
    n = len(token_lists)
    ids = torch.full((n, block_len), pad_id, dtype=torch.long)
    docs = torch.full((n, block_len), -1, dtype=torch.long)
    for i, toks in enumerate(token_lists):
        k = min(len(toks), block_len)
        if k:
            ids[i, :k] = torch.as_tensor(toks[:k], dtype=torch.long)
            docs[i, :k] = i
    labels = ids.masked_fill(docs < 0, IGNORE_INDEX)
    positions = torch.arange(block_len).expand(n, block_len).masked_fill(docs < 0, -1)
    return Blocks(ids, docs, labels, num_docs=n, positions=positions)


def unpack(blocks: Blocks) -> list[list[int]]:
    """Each document's tokens as stored in the blocks, with pack's EOS separators removed.

    Tokens are read in row-major order. For packed blocks the final token of a document is
    removed when it equals `eos_id` (a document cut by drop_last keeps what survived).
    """
    flat_ids, flat_docs = blocks.input_ids.reshape(-1), blocks.doc_ids.reshape(-1)
    real = flat_docs >= 0
    flat_ids, flat_docs = flat_ids[real], flat_docs[real]
    order = torch.sort(flat_docs, stable=True).indices
    counts = torch.bincount(flat_docs, minlength=blocks.num_docs).tolist()
    out = [chunk.tolist() for chunk in torch.split(flat_ids[order], counts)]
    if blocks.eos_id is not None:
        out = [d[:-1] if d and d[-1] == blocks.eos_id else d for d in out]
    return out


def seeded_generator(*parts: Any) -> torch.Generator:
    """A CPU generator seeded by a stable hash of parts (same parts -> same stream, any platform)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _check_seed(seed: Any, name: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise fail(name, seed, "use an integer seed, e.g. 0")
    return seed


def split_documents(docs: Sequence[T], held_out: float | int, seed: int) -> tuple[list[T], list[T]]:
    """Deterministic (train, held_out) split; a float is a fraction, an int a count. Both keep input order."""
    n, seed = len(docs), _check_seed(seed)
    if isinstance(held_out, bool) or not isinstance(held_out, (int, float)):
        raise fail("held_out", held_out, "use a fraction in [0, 1) or a document count")
    if isinstance(held_out, float):
        if not 0.0 <= held_out < 1.0:
            raise fail("held_out", held_out, "a fraction must be in [0, 1), e.g. 0.1")
        k = round(held_out * n)
    else:
        k = held_out
    if not 0 <= k < n:
        raise fail("held_out", held_out, f"hold out between 0 and {n - 1} of the {n} documents")
    perm = torch.randperm(n, generator=seeded_generator("split", seed)).tolist()
    held = set(perm[:k])
    return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]

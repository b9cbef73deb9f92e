"""Which (prefix, suffix) windows of a token source a corpus scan scores, in a fixed, resumable order.

Sequences: without `seq_len` each document of the source is one training sequence; with `seq_len` the
documents are concatenated in source order (a separator id between them when given: the tokenizer's
EOS for text, none for token files, whose documents carry their own) and cut into consecutive
`seq_len`-token sequences, as a trainer cuts its stream (the last one may be shorter).

Windows of P + S tokens per sequence, by `offsets`:
  start       one window at the start of each sequence (Biderman et al. 2023: Pythia's 32 + 32)
  stride:N    windows at offsets 0, N, 2N, ... that fit in the sequence
  random:K    K distinct offsets per sequence, drawn from a generator seeded by (seed, sequence)
A sequence shorter than P + S gives no window; it is counted (`WindowStats.short`). `row` numbers the
windows 0, 1, 2, ...; `windows(..., start_row=r)` continues after row r - 1 exactly (a resumed scan).
Each window points back to its source: the sequence, the document and token offset it starts at.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data_pipelines.token_sources import TokenSource
from memorize_core import fail


@dataclass(frozen=True)
class Selection:
    """How windows are cut: prefix P, suffix S, sequence length, offsets rule, seed, row limit."""

    prefix: int
    suffix: int
    seq_len: int | None = None
    offsets: str = "start"
    seed: int = 0
    limit: int | None = None

    @property
    def width(self) -> int:
        """P + S: the tokens of one window."""
        return self.prefix + self.suffix


def parse_offsets(text: str) -> tuple[str, int]:
    """`start`, `stride:N` or `random:K` as (kind, N); ConfigError naming --offsets otherwise."""
    kind, _, n = str(text).partition(":")
    if kind == "start" and not n:
        return "start", 0
    # ASCII digits only: str.isdigit() passes '²', which int() refuses, and '١٠' would be a second
    # spelling of stride:10 in a resumed scan's fingerprint; 18 digits at most (int() refuses > 4300)
    if kind in ("stride", "random") and n.isascii() and n.isdigit() and len(n) <= 18 and int(n) >= 1:
        return kind, int(n)
    raise fail("--offsets", text, "choose start, stride:N or random:K (1 <= N, K < 10**18, ASCII digits), "
               "e.g. stride:64")


def check_selection(sel: Selection) -> None:
    """ConfigError for a selection that can give no window (each flag named)."""
    for flag, value in (("--prefix", sel.prefix), ("--suffix", sel.suffix)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(flag, value, "must be an integer >= 1")
    if sel.seq_len is not None and sel.seq_len < sel.width:
        raise fail("--seq-len", sel.seq_len, f"is shorter than --prefix + --suffix = {sel.width}; no window "
                   "fits in a sequence: raise it or shorten the prefix/suffix")
    if sel.limit is not None and sel.limit < 1:
        raise fail("--limit", sel.limit, "must be >= 1 (leave it out to scan everything)")
    parse_offsets(sel.offsets)


@dataclass
class Window:
    """One scored window and where it came from."""

    row: int
    sequence: int
    offset: int  # token offset of the window in its sequence
    doc: int  # document the window starts in
    doc_offset: int  # token offset in that document
    tokens: np.ndarray  # [P + S] int64


@dataclass
class WindowStats:
    """What the selection met: sequences read, those too short for a window, windows given."""

    sequences: int = 0
    short: int = 0
    windows: int = 0


def _sequences(source: TokenSource, seq_len: int | None, separator: int | None
               ) -> Iterator[tuple[np.ndarray, list[tuple[int, int, int]]]]:
    """(tokens, pieces) per training sequence; pieces = (position in sequence, document, doc offset)."""
    if seq_len is None:
        for doc, toks in source.documents():
            yield toks, [(0, doc, 0)]
        return
    buf: list[tuple[int, int, np.ndarray]] = []  # (document, offset of the piece in it, tokens)
    held = 0
    for doc, toks in source.documents():
        if separator is not None:
            toks = np.concatenate([toks, np.array([separator], dtype=np.int64)])
        buf.append((doc, 0, toks))
        held += len(toks)
        while held >= seq_len:
            yield _take(buf, seq_len)
            held -= seq_len
    if held:
        yield _take(buf, held)


def _take(buf: list[tuple[int, int, np.ndarray]], n: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The first n buffered tokens (removed from `buf`) and where each piece came from."""
    parts, pieces, pos = [], [], 0
    while pos < n:
        doc, off, toks = buf[0]
        k = min(n - pos, len(toks))
        parts.append(toks[:k])
        pieces.append((pos, doc, off))
        pos += k
        if k == len(toks):
            buf.pop(0)
        else:
            buf[0] = (doc, off + k, toks[k:])
    return np.concatenate(parts) if parts else np.zeros(0, np.int64), pieces


def _offsets(kind: str, n: int, length: int, width: int, seed: int, sequence: int) -> list[int]:
    last = length - width
    if kind == "start":
        return [0]
    if kind == "stride":
        return list(range(0, last + 1, n))
    rng = np.random.default_rng([seed, sequence])
    return sorted(rng.choice(last + 1, size=min(n, last + 1), replace=False).tolist())


def _locate(pieces: list[tuple[int, int, int]], pos: int) -> tuple[int, int]:
    """(document, offset in it) of sequence position `pos`."""
    start, doc, off = pieces[0]
    for p in pieces:
        if p[0] > pos:
            break
        start, doc, off = p
    return doc, off + pos - start


def windows(source: TokenSource, sel: Selection, *, separator: int | None = None, start_row: int = 0,
            stats: WindowStats | None = None) -> Iterator[Window]:
    """The selection's windows from row `start_row` on (the rows before it are counted, not built)."""
    kind, n = parse_offsets(sel.offsets)
    stats = stats if stats is not None else WindowStats()
    row = 0
    for sequence, (toks, pieces) in enumerate(_sequences(source, sel.seq_len, separator)):
        stats.sequences += 1
        if len(toks) < sel.width:
            stats.short += 1
            continue
        for off in _offsets(kind, n, len(toks), sel.width, sel.seed, sequence):
            if sel.limit is not None and row >= sel.limit:
                return
            if row >= start_row:
                doc, doc_off = _locate(pieces, off)
                stats.windows += 1
                yield Window(row, sequence, off, doc, doc_off, toks[off:off + sel.width])
            row += 1


__all__ = ["Selection", "Window", "WindowStats", "check_selection", "parse_offsets", "windows"]

"""Deduplication on token ids: exact duplicate documents, near-duplicate documents and repeated long
spans, with a manifest.

The methods of Lee et al. 2022 ("Deduplicating Training Data Makes Language Models Better"), on the
tokenizer's ids so they work for any tokenizer:
- exact documents: two documents are copies when their texts are equal after whitespace
  normalisation (every run of whitespace becomes one space, ends stripped). The earliest copy in
  corpus order stays; later copies are removed whole.
- near documents (off by default, `near_documents`): documents whose sets of `near_ngram`-token
  windows have Jaccard similarity >= `near_threshold` (NearDup: MinHash LSH candidates, each verified
  exactly; data_pipelines.near_dedup) form clusters; the earliest document of each stays, the others
  are removed whole. Runs after the exact pass, before the span pass. The near-copies exact spans
  miss (a word edited every few dozen tokens) are what it is for, e.g. goldfish's leak
  (docs/mitigations.md).
- repeated spans: a window of `min_repeat_tokens` tokens (50 by default, the paper's threshold)
  that already occurred earlier in the corpus (order: document index, then token offset) is a
  later occurrence. A token is removed when a later occurrence covers it, unless it also lies in
  the first occurrence of a window that repeats (so the kept copy stays whole, even when a span
  repeats inside itself, e.g. a long run of one token). Any longer repeated span is a chain of such
  windows and goes too. Windows never cross documents. Runs after the exact-document pass.
A document that lost tokens to span removal and has fewer than `min_doc_tokens` left is dropped;
documents the pass did not touch are never dropped, however short (canaries are short).

Spans are found with a rolling polynomial hash of every window (numpy, mod 2**64); every window
whose hash was seen before is compared token by token with the earliest window of that hash, so
the result never depends on the hash: a collision costs time, never text.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_pipelines.corpora import Document
from data_pipelines.near_dedup import MISS, bands, min_perms, near_duplicate_clusters
from data_pipelines.packing import TokenLists
from memorize_core import fail

__all__ = ["KINDS", "DedupConfig", "DedupManifest", "Removal", "deduplicate", "normalize_whitespace",
           "repeated_spans"]

KINDS = ("exact-document", "near-document", "repeated-span", "short-remainder")
_BASE = 0x9E3779B97F4A7C15  # odd, so it has an inverse mod 2**64
_CHUNK = 1 << 22  # token comparisons per verification batch (bounds memory on very repetitive corpora)


@dataclass
class DedupConfig:
    """Which deduplication passes run and their thresholds (Lee et al. 2022 defaults)."""

    enabled: bool = False  # false: deduplicate() returns its input unchanged (the run-config default)
    exact_documents: bool = True  # drop later copies of a document (whitespace-normalised text)
    repeated_spans: bool = True  # cut later occurrences of spans of >= min_repeat_tokens tokens
    min_repeat_tokens: int = 50
    min_doc_tokens: int = 1  # a trimmed document left shorter than this is dropped (1: only if empty)
    near_documents: bool = False  # drop near-copies of an earlier document (MinHash LSH + exact Jaccard)
    near_threshold: float = 0.8  # Jaccard similarity of the n-token window sets (Lee et al.: 0.8)
    near_ngram: int = 5  # window length in tokens (Lee et al.: 5 words)
    near_perms: int = 256  # MinHash permutations (more: fewer dissimilar candidates to verify)

    def validate(self, prefix: str = "dedup") -> None:
        """Raise ConfigError on bad settings (names the field, the value and the fix)."""
        for name in ("enabled", "exact_documents", "repeated_spans", "near_documents"):
            if not isinstance(getattr(self, name), bool):
                raise fail(f"{prefix}.{name}", getattr(self, name), "use true or false")
        t = self.near_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
            raise fail(f"{prefix}.near_threshold", t, "use a Jaccard similarity in (0, 1], e.g. 0.8 (Lee et "
                       "al. 2022); lower catches more heavily edited copies")
        hints = {"min_repeat_tokens": "(a number of tokens), e.g. 50 (the threshold of Lee et al. 2022)",
                 "min_doc_tokens": "(a number of tokens), e.g. 1 (drop a trimmed document only when nothing "
                                   "is left)",
                 "near_ngram": "(a number of tokens), e.g. 5 (the window of Lee et al. 2022)",
                 "near_perms": "(MinHash permutations), e.g. 256"}
        for name, example in hints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(f"{prefix}.{name}", value, f"use an integer >= 1 {example}")
        if self.near_documents and bands(t, self.near_perms) == (0, 0):
            raise fail(f"{prefix}.near_perms", self.near_perms, f"too few for near_threshold={t:g}: LSH "
                       f"would miss more than {MISS:g} of the pairs at the threshold; use >= {min_perms(t)}")

    def key(self) -> dict:
        """The settings a deduplicated corpus depends on, for run keys: the near pass's only when it
        runs (a key from before it existed stays valid)."""
        out = dataclasses.asdict(self)
        if not self.near_documents:
            for name in ("near_documents", "near_threshold", "near_ngram", "near_perms"):
                out.pop(name)
        return out

    def describe(self) -> str:
        """The passes that run, in words (report notes)."""
        if not self.enabled:
            return "off"
        near = (f"near documents (Jaccard >= {self.near_threshold:g} of {self.near_ngram}-token windows, "
                f"MinHash LSH, {self.near_perms} permutations)")
        spans = f"repeated spans of >= {self.min_repeat_tokens} tokens"
        passes = [name for name, on in (("exact documents", self.exact_documents),
                                        (near, self.near_documents), (spans, self.repeated_spans)) if on]
        return " + ".join(passes) + ", keep-first" if passes else "no pass"


@dataclass
class Removal:
    """Tokens [start, end) of one document that were removed, and where the kept copy lies."""

    doc_id: str
    doc_index: int  # index in the documents passed to deduplicate
    kind: str  # one of KINDS
    start: int  # token offsets in the document's input token list, end exclusive
    end: int
    first_id: str | None = None  # document holding the kept first occurrence (None: short-remainder)
    # repeated-span: tokens [start, end) equal first_id's tokens from first_start on; exact-document: 0
    first_start: int | None = None
    similarity: float | None = None  # near-document: Jaccard similarity of its windows to first_id's


@dataclass
class DedupManifest:
    """Every removal with its settings and counts; JSON-serialisable."""

    settings: dict
    num_documents: int
    num_tokens: int
    num_kept_documents: int
    num_kept_tokens: int
    removals: list[Removal] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # ids of documents removed whole
    counts: dict = field(default_factory=dict)  # kind -> {"spans", "documents", "tokens"}

    def of_kind(self, kind: str) -> list[Removal]:
        """Removals of one kind (see KINDS)."""
        return [r for r in self.removals if r.kind == kind]

    def to_dict(self) -> dict:
        """Plain dict (for JSON and W&B)."""
        return dataclasses.asdict(self)

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write indented JSON; refuses to replace an existing file unless overwrite=True."""
        p = Path(path)
        if p.exists() and not overwrite:
            raise fail("manifest", str(path), "already exists; choose a new path or pass overwrite=True")
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, p)  # a reader never sees half a manifest
        return p

    @classmethod
    def load(cls, path: str | Path) -> DedupManifest:
        """Read a manifest written by save."""
        p = Path(path)
        if not p.is_file():
            raise fail("manifest", str(path), "no such file; pass the path written by DedupManifest.save")
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
            data["removals"] = [Removal(**r) for r in data.get("removals", [])]
            return cls(**data)
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise fail("manifest", str(path), f"not a manifest written by DedupManifest.save ({e})") from None


def normalize_whitespace(text: str) -> str:
    """The text exact-document dedup compares: whitespace runs become one space, ends stripped."""
    return " ".join(text.split())


def deduplicate(docs: Sequence[Document], token_lists: Sequence[Sequence[int]],
                cfg: DedupConfig) -> tuple[TokenLists, DedupManifest]:
    """Token lists with duplicates removed, and the manifest of every removal.

    `token_lists[j]` belongs to `docs[token_lists.kept[j]]` when it has `.kept` (the output of
    `tokenize_documents`), else to `docs[j]`. The result's `.kept` indexes `docs` the same way, so
    `[docs[i] for i in out.kept]` are the surviving documents (a trimmed one's text is its original
    text: its tokens are what remains).
    """
    if not isinstance(cfg, DedupConfig):
        raise fail("dedup", cfg, "pass a DedupConfig, e.g. DedupConfig(enabled=True)")
    cfg.validate()
    kept_in = getattr(token_lists, "kept", None)
    kept_in = list(range(len(docs))) if kept_in is None else list(kept_in)
    if len(kept_in) != len(token_lists) or (kept_in and not 0 <= min(kept_in) <= max(kept_in) < len(docs)):
        raise fail("token_lists", f"<{len(token_lists)} lists>", f"does not match the {len(docs)} documents; "
                   "pass one token list per document, or tokenize_documents(docs, ...)'s output")
    lists = [list(t) for t in token_lists]
    ids = [docs[i].id for i in kept_in]
    removals: list[Removal] = []
    gone = [False] * len(lists)  # removed whole
    if cfg.enabled and cfg.exact_documents:
        seen: dict[str, int] = {}
        for j, i in enumerate(kept_in):
            key = normalize_whitespace(docs[i].text)
            if key in seen:
                gone[j] = True
                removals.append(Removal(ids[j], i, "exact-document", 0, len(lists[j]), ids[seen[key]], 0))
            else:
                seen[key] = j
    if cfg.enabled and cfg.near_documents:
        alive = [j for j in range(len(lists)) if not gone[j]]
        for cluster in near_duplicate_clusters([lists[j] for j in alive], cfg.near_threshold, cfg.near_ngram,
                                               cfg.near_perms):
            f = alive[cluster.kept]
            for a, sim in cluster.removed:
                j = alive[a]
                gone[j] = True
                removals.append(Removal(ids[j], kept_in[j], "near-document", 0, len(lists[j]), ids[f], 0,
                                        similarity=round(sim, 6)))
    out = list(lists)
    if cfg.enabled and cfg.repeated_spans:
        alive = [j for j in range(len(lists)) if not gone[j]]
        cuts = _repeated_spans([lists[j] for j in alive], cfg.min_repeat_tokens)
        for a, start, end, fa, fstart in cuts:
            j, f = alive[a], alive[fa]
            removals.append(Removal(ids[j], kept_in[j], "repeated-span", start, end, ids[f], fstart))
        cut_by_doc: dict[int, list[tuple[int, int]]] = {}
        for a, start, end, _, _ in cuts:
            cut_by_doc.setdefault(alive[a], []).append((start, end))
        for j, spans in cut_by_doc.items():
            mask = np.ones(len(lists[j]), dtype=bool)
            for start, end in spans:
                mask[start:end] = False
            out[j] = np.asarray(lists[j], dtype=np.int64)[mask].tolist()
            if len(out[j]) < cfg.min_doc_tokens:
                gone[j] = True
                for start, end in _runs(mask):
                    removals.append(Removal(ids[j], kept_in[j], "short-remainder", start, end))
    removals.sort(key=lambda r: (r.doc_index, r.start))
    survivors = [j for j in range(len(lists)) if not gone[j]]
    result = TokenLists([out[j] for j in survivors], [kept_in[j] for j in survivors])
    manifest = DedupManifest(
        settings=dataclasses.asdict(cfg), num_documents=len(lists), num_tokens=sum(map(len, lists)),
        num_kept_documents=len(result), num_kept_tokens=sum(map(len, result)), removals=removals,
        dropped=[ids[j] for j in range(len(lists)) if gone[j]], counts=_counts(removals))
    return result, manifest


def repeated_spans(token_lists: Sequence[Sequence[int]], n: int) -> list[tuple[int, int, int, int, int]]:
    """(doc, start, end, first doc, first start) of every stretch whose n-token windows occurred earlier
    (the repeated-span pass without removing anything; e.g. to group near-duplicates by shared n-grams)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise fail("min_repeat_tokens", n, "use an integer >= 1 (a number of tokens), e.g. 50")
    return _repeated_spans([list(t) for t in token_lists], n)


def _counts(removals: list[Removal]) -> dict:
    counts = {}
    for kind in KINDS:
        rs = [r for r in removals if r.kind == kind]
        counts[kind] = {"spans": len(rs), "documents": len({r.doc_index for r in rs}),
                        "tokens": sum(r.end - r.start for r in rs)}
    return counts


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a boolean vector."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])]


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: neighbouring ids land far apart, so the polynomial hash sees noise.
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _window_hashes(flat: np.ndarray, n: int) -> np.ndarray:
    """Hash of flat[i:i+n] for every i in [0, len-n], as sum_j mix(x[i+j]) * B**j mod 2**64."""
    m = len(flat)
    powers = np.full(m, _BASE, dtype=np.uint64)
    powers[0] = 1
    inverse = np.full(m, pow(_BASE, -1, 1 << 64), dtype=np.uint64)
    inverse[0] = 1
    prefix = np.zeros(m + 1, dtype=np.uint64)
    # uint64 arithmetic wraps mod 2**64, which is the ring the hash lives in.
    np.cumprod(powers, out=powers)
    np.cumprod(inverse, out=inverse)
    np.cumsum(_mix(flat) * powers, out=prefix[1:])
    return (prefix[n:] - prefix[: m - n + 1]) * inverse[: m - n + 1]


def _equal(flat: np.ndarray, a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """For each k: flat[a[k]:a[k]+n] == flat[b[k]:b[k]+n], compared in bounded batches."""
    out = np.empty(len(a), dtype=bool)
    step = max(1, _CHUNK // n)
    offsets = np.arange(n)
    for s in range(0, len(a), step):
        aa, bb = a[s:s + step, None] + offsets, b[s:s + step, None] + offsets
        out[s:s + step] = (flat[aa] == flat[bb]).all(axis=1)
    return out


def _verify(flat: np.ndarray, w: np.ndarray, lead: np.ndarray, n: int) -> np.ndarray:
    """For each k: window w[k] holds the same tokens as window lead[k] (False only near a collision).

    Window w+1 pairs with lead+1 along any copied stretch, so it is equal iff window w was and
    their last tokens agree: only the head of each stretch is compared in full (O(tokens), not
    O(tokens * n)). A collision makes the rest of its stretch False; callers re-check those.
    """
    at = np.full(len(flat), -1, dtype=np.int64)  # bucket by start instead of sorting: O(tokens)
    at[w] = np.arange(len(w))
    order = at[at >= 0]
    ws, ls = w[order], lead[order]
    chained = np.zeros(len(ws), dtype=bool)
    chained[1:] = (ws[1:] == ws[:-1] + 1) & (ls[1:] == ls[:-1] + 1)
    ok = np.empty(len(ws), dtype=bool)
    heads, tails = np.flatnonzero(~chained), np.flatnonzero(chained)
    ok[heads] = _equal(flat, ws[heads], ls[heads], n)
    ok[tails] = flat[ws[tails] + n - 1] == flat[ls[tails] + n - 1]
    bad = np.cumsum(~ok)
    before = bad[heads] - (~ok[heads]).astype(np.int64)  # failures before each stretch starts
    out = np.empty(len(w), dtype=bool)
    out[order] = bad == before[np.cumsum(~chained) - 1]
    return out


def _repeated_spans(lists: list[list[int]], n: int) -> list[tuple[int, int, int, int, int]]:
    """Cuts (doc, start, end, first doc, first start): maximal removed stretches copied from one place."""
    lengths = np.array([len(t) for t in lists], dtype=np.int64)
    total = int(lengths.sum())
    if total < n:
        return []
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    doc_of = np.repeat(np.arange(len(lists)), lengths)
    pos = np.arange(total)
    with np.errstate(over="ignore"):
        hashes = _window_hashes(flat, n)
    # window i is valid when it ends inside its own document
    starts = np.flatnonzero(pos[: total - n + 1] - offsets[doc_of[: total - n + 1]] + n
                            <= lengths[doc_of[: total - n + 1]])
    if not len(starts):
        return []
    h = hashes[starts]
    order = np.argsort(h, kind="stable")  # stable: inside one hash, windows stay in corpus order
    hs, ws = h[order], starts[order]
    new = np.concatenate([[True], hs[1:] != hs[:-1]])
    group = np.maximum.accumulate(np.where(new, np.arange(len(hs)), 0))
    lead = ws[group]
    members = np.flatnonzero(~new)
    same = _verify(flat, ws[members], lead[members], n)
    first = np.full(total, -1, dtype=np.int64)  # window start -> start of its earliest identical window
    first[ws[members[same]]] = lead[members[same]]
    keep = np.zeros(total, dtype=bool)  # first occurrences of windows that repeat: never cut
    keep[lead[members[same]]] = True
    for g in np.unique(group[members[~same]]):  # hash collisions: settle them by the tokens themselves
        end = g + 1
        while end < len(hs) and not new[end]:
            end += 1
        seen: dict[bytes, int] = {}
        for w in ws[g:end].tolist():
            key = flat[w:w + n].tobytes()
            if key in seen:
                first[w], keep[seen[key]] = seen[key], True
            else:
                seen[key] = w
    repeat = first >= 0
    if not repeat.any():
        return []
    removed = _covered(repeat, n, total) & ~_covered(keep, n, total)
    # Each removed token copies the token at the same offset of the first occurrence of the latest
    # repeated window covering it; a cut ends where that source stops running on.
    latest = np.maximum.accumulate(np.where(repeat, pos, -1))
    src = np.where(removed, first[np.maximum(latest, 0)] + pos - latest, -1)
    idx = np.flatnonzero(removed)
    if not len(idx):
        return []
    s = src[idx]
    brk = np.concatenate([[True], (idx[1:] != idx[:-1] + 1) | (s[1:] != s[:-1] + 1)
                          | (doc_of[idx[1:]] != doc_of[idx[:-1]]) | (doc_of[s[1:]] != doc_of[s[:-1]])])
    heads = np.flatnonzero(brk)
    tails = np.concatenate([heads[1:] - 1, [len(idx) - 1]])
    cuts = _merge(flat, doc_of, list(zip(idx[heads].tolist(), (idx[tails] + 1).tolist(), s[heads].tolist())))
    return [(int(doc_of[a]), a - int(offsets[doc_of[a]]), b - int(offsets[doc_of[a]]), int(doc_of[f]),
             f - int(offsets[doc_of[f]])) for a, b, f in cuts]


Cut = tuple[int, int, int]  # global start, global end, global start of the source


def _merge(flat: np.ndarray, doc_of: np.ndarray, cuts: list[Cut]) -> list[Cut]:
    """Join adjacent cuts when the first one's source simply runs on.

    Inside a self-overlapping repeat (e.g. a long run of one token) the per-token sources jump
    although the text still matches further along the first source; one record reads better.
    """
    out: list[Cut] = []
    for a, b, f in cuts:
        if out:
            pa, pb, pf = out[-1]
            g = pf + (pb - pa)  # where the previous cut's source would continue
            if (pb == a and doc_of[a] == doc_of[pa] and g + (b - a) <= len(flat)
                    and doc_of[g + (b - a) - 1] == doc_of[pf]
                    and np.array_equal(flat[a:b], flat[g:g + b - a])):
                out[-1] = (pa, b, pf)
                continue
        out.append((a, b, f))
    return out


def _covered(window_starts: np.ndarray, n: int, total: int) -> np.ndarray:
    """Tokens lying in at least one window of n tokens starting where window_starts is True."""
    at = np.flatnonzero(window_starts)
    depth = np.bincount(at, minlength=total + n) - np.bincount(at + n, minlength=total + n)
    return np.cumsum(depth)[:total] > 0

"""Mix canaries and repeated documents into a corpus, with a manifest of exactly what went where.

Counting rule: an injected item appears exactly `count` times in the output. A duplicated base
document is taken out of its original place and its `count` copies are scattered, so count 1 is
the seen-once control. Copy `c` of item `x` is the output document with id `x.id@c`, at output
index `x.positions[c]`; after tokenization and packing, `record_token_positions` adds, per copy,
the (row, start, end) token spans it occupies (end exclusive, pack's EOS separator excluded).

Near-duplicates: with `duplicates.edit_rate` r > 0, the copies of a duplicated document (all but copy
0 when `keep_original`) are near-copies: each unit (`edit_unit`: a whitespace-separated word, or a
token of `tokenizer`) is edited with probability r -- substituted by a unit drawn from the corpus'
words (or the vocabulary), preceded by an inserted one, or deleted -- from a generator seeded by
(seed, document, copy). Word edits change the text, which is then tokenized like any other; token
edits are decoded back to text. The item records its cluster (the original's id), each copy's text
and its edits ({"kind", "pos", "old", "new"}, pos in the original's units). Nothing else changes:
the copies sit where exact copies would, and every other document is byte-identical.
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data_pipelines.canaries import DEFAULT_TEMPLATE, SecretSpace, canary_candidates, check_template, render
from data_pipelines.corpora import Document
from data_pipelines.packing import Blocks, seeded_generator
from memorize_core import fail

__all__ = ["CanarySpec", "DuplicateSpec", "InjectedItem", "Manifest", "SecretSpace", "canary_candidates",
           "inject", "near_copy", "record_token_positions", "render", "unit_pool"]


def _check_counts(name: str, counts: Any) -> list[int]:
    if (not isinstance(counts, (list, tuple)) or not counts
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)):
        raise fail(name, counts, "use a non-empty list of positive integers, e.g. [1, 2, 4, 8]")
    return list(counts)


@dataclass
class CanarySpec:
    """`num_canaries` secrets from `space` rendered into `template`; canary i is repeated repeats[i % len]."""

    num_canaries: int = 8
    template: str = DEFAULT_TEMPLATE
    space: SecretSpace = field(default_factory=SecretSpace)
    repeats: list[int] = field(default_factory=lambda: [1])

    def __post_init__(self) -> None:
        if isinstance(self.space, dict):
            known = {f.name for f in dataclasses.fields(SecretSpace)}
            for key, value in self.space.items():
                if key not in known:
                    raise fail(f"canaries.space.{key}", value, f"unknown key; use {', '.join(sorted(known))}")
            self.space = SecretSpace(**self.space)
        n = self.num_canaries
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise fail("canaries.num_canaries", self.num_canaries, "use a positive integer")
        check_template(self.template)
        self.repeats = _check_counts("canaries.repeats", self.repeats)


EDIT_KINDS = ("substitute", "insert", "delete")
EDIT_UNITS = ("word", "token")


@dataclass
class DuplicateSpec:
    """Pick `per_count` base documents for each n in `counts` (seeded) and make each appear n times
    (near-copies with edits at `edit_rate` per word or token; 0: exact copies)."""

    counts: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    per_count: int = 1
    edit_rate: float = 0.0  # probability that a unit of a near-copy is edited
    edit_unit: str = "word"  # word: edit the text's words, then tokenize; token: edit the token ids
    edit_kinds: list[str] = field(default_factory=lambda: list(EDIT_KINDS))  # drawn uniformly per edit
    keep_original: bool = True  # copy 0 stays verbatim; false: every copy is a near-copy

    def __post_init__(self) -> None:
        self.counts = _check_counts("duplicates.counts", self.counts)
        if isinstance(self.per_count, bool) or not isinstance(self.per_count, int) or self.per_count < 1:
            raise fail("duplicates.per_count", self.per_count, "use a positive integer")
        rate = self.edit_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise fail("duplicates.edit_rate", rate, "use a fraction in [0, 1], e.g. 0.05 (0: exact copies)")
        if self.edit_unit not in EDIT_UNITS:
            raise fail("duplicates.edit_unit", self.edit_unit, f"choose one of {', '.join(EDIT_UNITS)}")
        kinds = self.edit_kinds
        if (not isinstance(kinds, (list, tuple)) or not kinds or any(k not in EDIT_KINDS for k in kinds)
                or len(set(kinds)) != len(kinds)):
            raise fail("duplicates.edit_kinds", kinds, f"use distinct names from {', '.join(EDIT_KINDS)}")
        self.edit_kinds = list(kinds)


@dataclass
class InjectedItem:
    """One injected text: where each of its `count` copies sits, in documents and (later) tokens."""

    id: str
    kind: str  # "canary" or "duplicate"
    text: str
    count: int
    positions: list[int]  # output document index of copy c
    secret: str | None = None  # canaries
    template: str | None = None  # canaries
    space: dict | None = None  # canaries: SecretSpace.to_dict()
    # canaries trained as a conversation's answer (inject_dataset on chat rows): the user turn before it
    prompt: str | None = None
    source_id: str | None = None  # duplicates: id of the base document
    cluster: str | None = None  # duplicates: the cluster of every copy, the original's document id
    # near-duplicates: per copy, its text (item.text is the original's) and its edits, in copy order
    copy_texts: list[str] | None = None
    edits: list[list[dict]] | None = None
    # Per copy, the [row, start, end) spans it occupies in the blocks; [] if it was dropped.
    token_positions: list[list[list[int]]] | None = None

    @property
    def copy_ids(self) -> list[str]:
        """Ids of the copies in the output corpus, in copy order."""
        return [f"{self.id}@{c}" for c in range(self.count)]


@dataclass
class Manifest:
    """Everything injected into a corpus, with the seed and specs that reproduce it."""

    seed: int
    num_base_documents: int
    num_documents: int
    items: list[InjectedItem] = field(default_factory=list)
    canaries: dict | None = None  # CanarySpec as a dict
    duplicates: dict | None = None  # DuplicateSpec as a dict
    blocks: dict | None = None  # shape of the blocks token positions refer to

    def of_kind(self, kind: str) -> list[InjectedItem]:
        """Items of one kind ("canary" or "duplicate")."""
        return [item for item in self.items if item.kind == kind]

    def to_json(self, path: str | Path) -> None:
        """Write the manifest as indented JSON."""
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | Path) -> Manifest:
        """Read a manifest written by to_json."""
        p = Path(path)
        if not p.is_file():
            raise fail("manifest", str(path), "no such file; pass the manifest.json written at injection")
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
            data["items"] = [InjectedItem(**item) for item in data.get("items", [])]
            return cls(**data)
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise fail("manifest", str(path), f"not a manifest written by Manifest.to_json ({e})") from None


def inject(base_docs: list[Document], *, canaries: CanarySpec | None = None,
           duplicates: DuplicateSpec | None = None, seed: int,
           tokenizer: Any = None) -> tuple[list[Document], Manifest]:
    """Base documents with canaries and duplicates scattered at seeded places, plus the manifest
    (`tokenizer` only for duplicates.edit_unit=token)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise fail("seed", seed, "use an integer seed, e.g. 0")
    items: list[InjectedItem] = []
    copies: list[Document] = []
    rest = list(base_docs)

    if canaries is not None:
        secrets = canaries.space.sample(canaries.num_canaries, seed)
        for i, secret in enumerate(secrets):
            text = render(canaries.template, secret)
            count = canaries.repeats[i % len(canaries.repeats)]
            items.append(InjectedItem(f"canary/{i}", "canary", text, count, [], secret=secret,
                                      template=canaries.template, space=canaries.space.to_dict()))
            copies += [Document(f"canary/{i}@{c}", text, "canary") for c in range(count)]

    if duplicates is not None:
        wanted = len(duplicates.counts) * duplicates.per_count
        if wanted > len(base_docs):
            raise fail("duplicates.counts", duplicates.counts, f"needs {wanted} distinct base documents but "
                       f"the corpus has {len(base_docs)}; lower per_count or use fewer counts")
        if duplicates.edit_rate > 0 and duplicates.edit_unit == "token" and tokenizer is None:
            raise fail("duplicates.edit_unit", "token", "token edits need the tokenizer: pass tokenizer=, "
                       "or use edit_unit=word")
        perm = torch.randperm(len(base_docs), generator=seeded_generator("duplicates", seed))
        chosen = perm[:wanted].tolist()
        pool = unit_pool(base_docs, duplicates, tokenizer) if duplicates.edit_rate > 0 else []
        for j, idx in enumerate(chosen):
            doc, count = base_docs[idx], duplicates.counts[j // duplicates.per_count]
            item_id = f"duplicate/{doc.id}"
            item = InjectedItem(item_id, "duplicate", doc.text, count, [], source_id=doc.id, cluster=doc.id)
            texts = [doc.text] * count
            if duplicates.edit_rate > 0:
                near = [near_copy(doc.text, duplicates, pool, (seed, doc.id, c), tokenizer)
                        if c or not duplicates.keep_original else (doc.text, []) for c in range(count)]
                texts, item.edits = [t for t, _ in near], [e for _, e in near]
                item.copy_texts = texts
            items.append(item)
            copies += [Document(f"{item_id}@{c}", texts[c], doc.source) for c in range(count)]
        picked = set(chosen)
        rest = [d for i, d in enumerate(base_docs) if i not in picked]

    out = _scatter(rest, copies, seed)
    where = {doc.id: i for i, doc in enumerate(out)}
    for item in items:
        item.positions = [where[cid] for cid in item.copy_ids]
    manifest = Manifest(seed=seed, num_base_documents=len(base_docs), num_documents=len(out), items=items,
                        canaries=dataclasses.asdict(canaries) if canaries is not None else None,
                        duplicates=dataclasses.asdict(duplicates) if duplicates is not None else None)
    return out, manifest


_WORDS = re.compile(r"\S+")


def unit_pool(docs: Sequence[Document], spec: DuplicateSpec, tokenizer: Any) -> list:
    """What a substitution or insertion draws from: the corpus' distinct words, or the plain token ids."""
    if spec.edit_unit == "word":
        return sorted({w for d in docs for w in _WORDS.findall(d.text)})
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(len(tokenizer)) if i not in special]


def near_copy(text: str, spec: DuplicateSpec, pool: Sequence, key: Any,
              tokenizer: Any = None) -> tuple[str, list[dict]]:
    """(the edited text, its edits): each unit edited with probability spec.edit_rate, seeded by `key`."""
    rng = random.Random(repr(key))  # str seeds hash with sha512: the same copy on every platform
    if spec.edit_unit == "word":
        units: list = _WORDS.findall(text)
        gaps = _WORDS.split(text)  # gaps[i] precedes units[i]; gaps[-1] trails the text
    else:
        units = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    out, seps, edits = [], [], []
    for i, unit in enumerate(units):
        sep = gaps[i] if spec.edit_unit == "word" else ""
        if rng.random() >= spec.edit_rate:
            out.append(unit)
            seps.append(sep)
            continue
        kind = rng.choice(spec.edit_kinds)
        new = None if kind == "delete" else _draw(rng, pool, unit)
        edits.append({"kind": kind, "pos": i, "old": None if kind == "insert" else unit, "new": new})
        if kind == "insert":
            out += [new, unit]
            seps += [sep, " " if spec.edit_unit == "word" else ""]
        elif kind == "substitute":
            out.append(new)
            seps.append(sep)
        # delete: the unit goes with the gap before it
    if spec.edit_unit == "token":
        return tokenizer.decode(out), edits
    seps = [gaps[0] if j == 0 else s for j, s in enumerate(seps)]  # the text keeps its own start
    return (gaps[0] if not out else "") + "".join(s + u for s, u in zip(seps, out)) + gaps[-1], edits


def _draw(rng: random.Random, pool: Sequence, old: Any) -> Any:
    """A unit from the pool that differs from `old` (a substitution always changes something)."""
    for _ in range(8):
        new = pool[rng.randrange(len(pool))]
        if new != old:
            return new
    return new


def _scatter(rest: list[Document], copies: list[Document], seed: int) -> list[Document]:
    """Put the copies at uniformly random slots (in random order); base documents keep their order."""
    total = len(rest) + len(copies)
    slots = set(torch.randperm(total, generator=seeded_generator("slots", seed))[: len(copies)].tolist())
    order = torch.randperm(len(copies), generator=seeded_generator("copy-order", seed)).tolist()
    shuffled, base = iter(copies[i] for i in order), iter(rest)
    return [next(shuffled) if i in slots else next(base) for i in range(total)]


def _runs(blocks: Blocks) -> dict[int, list[list[int]]]:
    """doc id -> its [row, start, end) spans, one per row it touches, in row-major order."""
    docs = blocks.doc_ids
    n, length = docs.shape
    flat = docs.reshape(-1)
    if flat.numel() == 0:
        return {}
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::length] = True  # a span never crosses a row boundary
    begin = starts.nonzero().squeeze(1)
    end = torch.cat([begin[1:], torch.tensor([flat.numel()])])
    out: dict[int, list[list[int]]] = {}
    for b, e, d in zip(begin.tolist(), end.tolist(), flat[begin].tolist()):
        if d >= 0:
            out.setdefault(d, []).append([b // length, b % length, (e - 1) % length + 1])
    return out


def record_token_positions(manifest: Manifest, blocks: Blocks, kept: Sequence[int] | None = None) -> Manifest:
    """Fill each item's token_positions from blocks built from the injected corpus.

    `kept` maps block doc ids to output document indices (the `.kept` of `tokenize_documents`,
    or the TokenLists itself); leave it None when every document was kept in order.
    """
    kept = getattr(kept, "kept", kept)
    doc_of = {int(p): j for j, p in enumerate(kept)} if kept is not None else None
    runs = _runs(blocks)
    for item in manifest.items:
        spans_per_copy = []
        for pos in item.positions:
            j = pos if doc_of is None else doc_of.get(pos)
            spans = [list(s) for s in runs.get(j, [])] if j is not None else []
            if spans and blocks.eos_id is not None:
                _drop_separator(spans, blocks)
            spans_per_copy.append(spans)
        item.token_positions = spans_per_copy
    manifest.blocks = {"num_rows": len(blocks), "block_len": blocks.block_len,
                       "packed": blocks.eos_id is not None, "num_docs": blocks.num_docs}
    return manifest


def _drop_separator(spans: list[list[int]], blocks: Blocks) -> None:
    """Trim pack's trailing EOS from a document's spans (it is missing if drop_last cut the document)."""
    row, start, end = spans[-1]
    if int(blocks.input_ids[row, end - 1]) == blocks.eos_id:
        if end - 1 == start:
            spans.pop()
        else:
            spans[-1][2] = end - 1

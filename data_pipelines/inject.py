"""Mix canaries and repeated documents into a corpus, with a manifest of exactly what went where.

Counting rule: an injected item appears exactly `count` times in the output. A duplicated base
document is taken out of its original place and its `count` copies are scattered, so count 1 is
the seen-once control. Copy `c` of item `x` is the output document with id `x.id@c`, at output
index `x.positions[c]`; after tokenization and packing, `record_token_positions` adds, per copy,
the (row, start, end) token spans it occupies (end exclusive, pack's EOS separator excluded).
"""
from __future__ import annotations

import dataclasses
import json
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
           "inject", "record_token_positions", "render"]


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


@dataclass
class DuplicateSpec:
    """Pick `per_count` base documents for each n in `counts` (seeded) and make each appear n times."""

    counts: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    per_count: int = 1

    def __post_init__(self) -> None:
        self.counts = _check_counts("duplicates.counts", self.counts)
        if isinstance(self.per_count, bool) or not isinstance(self.per_count, int) or self.per_count < 1:
            raise fail("duplicates.per_count", self.per_count, "use a positive integer")


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
    source_id: str | None = None  # duplicates: id of the base document
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
           duplicates: DuplicateSpec | None = None, seed: int) -> tuple[list[Document], Manifest]:
    """Base documents with canaries and duplicates scattered at seeded places, plus the manifest."""
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
        perm = torch.randperm(len(base_docs), generator=seeded_generator("duplicates", seed))
        chosen = perm[:wanted].tolist()
        for j, idx in enumerate(chosen):
            doc, count = base_docs[idx], duplicates.counts[j // duplicates.per_count]
            item_id = f"duplicate/{doc.id}"
            items.append(InjectedItem(item_id, "duplicate", doc.text, count, [], source_id=doc.id))
            copies += [Document(f"{item_id}@{c}", doc.text, doc.source) for c in range(count)]
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

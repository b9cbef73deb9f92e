"""Goldfish mask coverage of duplicate clusters: how much of a document its copies supervise together.

Goldfish withholds a token only if no copy of the document is ever supervised on it. Exact copies
share one mask (the decision is a function of the token ids), but a near-copy -- a few words edited
-- changes the hash keys of the h windows after each edit, so its mask differs there, and the union
over many near-copies can cover the whole passage. For a cluster (an original and the copies the
corpus holds, the original included when it is there), every copy's tokens are aligned to the
original's (difflib on token ids: a supervised token of a copy counts for the original position it
matches), and the audit reports per strategy the fraction of the original's positions supervised in
at least one copy: over the whole document, and over its suffix (the positions after the eval
prefix, which extraction asks the model to reproduce). A cluster whose suffix is 100% covered gets a
warning: there goldfish no longer withholds any token.

Clusters come from an injection manifest (`clusters_from_manifest`) or, in any corpus, from shared
n-grams (`find_clusters`, the repeated-span machinery of data_pipelines.dedup). `memorize coverage`
runs the audit alone, without training (`cmd_coverage`).
"""
from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from data_pipelines import DuplicateSpec, inject, load_corpus, load_tokenizer, tokenize_documents
from data_pipelines.dedup import repeated_spans
from data_pipelines.inject import Manifest
from data_pipelines.near_dedup import EarliestUnion
from memorization.mitigations.goldfish import STRATEGIES, check_params, goldfish_mask, special_token_ids
from memorize_core import fail

if TYPE_CHECKING:  # annotations only: the run's types, no import of the training stage
    from memorization.config import RunConfig
    from memorization.train.prepare import PreparedData

AUDITED = ("none",) + STRATEGIES  # none: standard loss, every token supervised (the reference line)


@dataclass
class Cluster:
    """An original document's token ids and those of every copy the corpus holds (cut like the rows)."""

    id: str
    original: list[int]
    copies: list[list[int]]
    member_ids: list[str] = field(default_factory=list)  # corpus ids of the copies, when known


def align(original: Sequence[int], copy: Sequence[int]) -> np.ndarray:
    """For each position of `copy`, the position of `original` it matches (-1: an edit, no match)."""
    out = np.full(len(copy), -1, dtype=np.int64)
    matcher = difflib.SequenceMatcher(None, list(original), list(copy), autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        out[b:b + size] = np.arange(a, a + size)
    return out


def supervised(ids: Sequence[int], strategy: str, k: int, h: int, *, special_ids: Sequence[int] | None = None,
               exempt_special: bool | None = None, generator: torch.Generator | None = None) -> np.ndarray:
    """Positions of a one-document row that are supervised (position 0 is never predicted)."""
    out = np.ones(len(ids), dtype=bool)
    if strategy != "none" and len(ids):
        drop = goldfish_mask(torch.tensor([list(ids)], dtype=torch.long), strategy=strategy, k=k, h=h,
                             generator=generator, special_ids=special_ids, exempt_special=exempt_special)
        out = ~drop[0].numpy()
    out[:1] = False
    return out


def cluster_coverage(cluster: Cluster, strategy: str, k: int, h: int, *, prefix: int = 32,
                     suffix: int | None = 32, special_ids: Sequence[int] | None = None,
                     exempt_special: bool | None = None, seed: int = 0,
                     alignments: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Coverage of one cluster under one strategy: whole document, suffix, and the original alone."""
    n = len(cluster.original)
    gen = torch.Generator().manual_seed(seed)  # only `random` draws from it: one fresh draw per copy
    maps = alignments or [align(cluster.original, c) for c in cluster.copies]
    covered = np.zeros(n, dtype=bool)
    for ids, where in zip(cluster.copies, maps):
        sup = supervised(ids, strategy, k, h, special_ids=special_ids, exempt_special=exempt_special,
                         generator=gen)
        hit = where[sup & (where >= 0)]
        covered[hit] = True
    eligible = np.arange(n) >= 1  # position 0 is never a label
    end = n if suffix is None else min(n, prefix + suffix)
    tail = (np.arange(n) >= max(prefix, 1)) & (np.arange(n) < end)
    alone = supervised(cluster.original, strategy, k, h, special_ids=special_ids,
                       exempt_special=exempt_special, generator=torch.Generator().manual_seed(seed))
    return {
        "cluster": cluster.id, "strategy": strategy, "copies": len(cluster.copies), "tokens": n,
        "coverage": _share(covered, eligible), "suffix_tokens": int(tail.sum()),
        "suffix_coverage": _share(covered, tail), "single_copy": _share(alone, eligible),
        "single_copy_suffix": _share(alone, tail),
    }


def _share(mask: np.ndarray, where: np.ndarray) -> float | None:
    total = int(where.sum())
    return None if total == 0 else float((mask & where).sum() / total)


def audit(clusters: Sequence[Cluster], strategies: Sequence[str], k: int, h: int, *, prefix: int = 32,
          suffix: int | None = 32, special_ids: Sequence[int] | None = None,
          exempt_special: bool | None = None, seed: int = 0) -> dict[str, Any]:
    """Per strategy: every cluster's coverage, the token-weighted overall figures, and the 100% warnings."""
    for s in strategies:
        if s not in AUDITED:
            raise fail("--strategy", s, f"choose from {', '.join(AUDITED)}")
    if s := [s for s in strategies if s != "none"]:
        check_params(s[0], k, h, prefix="goldfish")
    maps = [[align(c.original, x) for x in c.copies] for c in clusters]  # strategy-independent
    out: dict[str, Any] = {"k": k, "h": h, "prefix": prefix, "suffix": suffix, "clusters": len(clusters),
                           "strategies": {}, "warnings": []}
    for strategy in strategies:
        rows = [cluster_coverage(c, strategy, k, h, prefix=prefix, suffix=suffix, special_ids=special_ids,
                                 exempt_special=exempt_special, seed=seed, alignments=m)
                for c, m in zip(clusters, maps)]
        full = [r["cluster"] for r in rows if r["suffix_coverage"] == 1.0]
        out["strategies"][strategy] = {
            "coverage": _weighted(rows, "coverage", "tokens", -1),
            "suffix_coverage": _weighted(rows, "suffix_coverage", "suffix_tokens", 0),
            "single_copy": _weighted(rows, "single_copy", "tokens", -1),
            "single_copy_suffix": _weighted(rows, "single_copy_suffix", "suffix_tokens", 0),
            "clusters_fully_covered": len(full), "rows": rows}
        if strategy != "none":
            out["warnings"] += [f"cluster {c}: {strategy} (k={k}, h={h}) supervises every suffix token across"
                                " its copies: goldfish no longer withholds any token there" for c in full]
    return out


def _weighted(rows: list[dict], key: str, weight: str, offset: int) -> float | None:
    """Token-weighted mean of a share over clusters (`offset` turns a count of tokens into eligible ones)."""
    pairs = [(r[key], r[weight] + offset) for r in rows if r[key] is not None and r[weight] + offset > 0]
    total = sum(w for _, w in pairs)
    return None if not total else sum(v * w for v, w in pairs) / total


def _ids(tokenizer: Any, text: str, max_tokens: int | None) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:max_tokens] if max_tokens else ids


def clusters_from_manifest(docs: Sequence[Any], manifest: Manifest, tokenizer: Any, *,
                           max_tokens: int | None = None) -> list[Cluster]:
    """One cluster per injected duplicate: the original's text and every copy at its manifest position."""
    out = []
    for item in manifest.of_kind("duplicate"):
        copies = [docs[p] for p in item.positions]
        out.append(Cluster(item.cluster or item.source_id or item.id, _ids(tokenizer, item.text, max_tokens),
                           [_ids(tokenizer, d.text, max_tokens) for d in copies], [d.id for d in copies]))
    return out


def find_clusters(ids: Sequence[str], token_lists: Sequence[Sequence[int]], *, ngram: int = 13,
                  min_shared: float = 0.5) -> list[Cluster]:
    """Near-duplicate clusters of any corpus: a document joins the earlier one it shares repeated
    `ngram`-token spans with when those cover >= `min_shared` of it; the earliest member is the original."""
    if not 0 < min_shared <= 1:
        raise fail("--min-shared", min_shared, "use a fraction in (0, 1], e.g. 0.5")
    shared: dict[tuple[int, int], int] = {}
    for doc, start, end, first, _ in repeated_spans(token_lists, ngram):
        shared[(doc, first)] = shared.get((doc, first), 0) + end - start
    union = EarliestUnion(len(token_lists))  # the earliest document roots its cluster
    for (doc, first), n in shared.items():
        if doc != first and n >= min_shared * max(1, len(token_lists[doc])):
            union.join(doc, first)
    groups = union.groups()
    return [Cluster(ids[r], list(token_lists[r]), [list(token_lists[j]) for j in m], [ids[j] for j in m])
            for r, m in sorted(groups.items()) if len(m) > 1]


def run_coverage(cfg: RunConfig, data: PreparedData) -> dict[str, Any] | None:
    """The mask-coverage audit of the run's own near-duplicate clusters (this module:
    documents sharing repeated 13-token spans): what share of each original the union of its copies
    supervises; warns on stderr where goldfish withholds no token of a suffix. None: no cluster."""
    g, e = cfg.goldfish, cfg.eval
    clusters = find_clusters([str(i) for i in data.train_doc_ids], data.train_docs)
    if not clusters:
        return None
    report = audit(clusters, [g.strategy], g.k, g.h, prefix=e.prefix, suffix=e.suffix,
                            special_ids=special_token_ids(data.tokenizer), exempt_special=g.exempt_special,
                            seed=g.seed)
    for warning in report["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    per = report["strategies"][g.strategy]
    keys = ("coverage", "suffix_coverage", "single_copy_suffix", "clusters_fully_covered")
    return {"clusters": len(clusters), **{k: per[k] for k in keys}, "warnings": report["warnings"]}


def format_table(report: dict[str, Any]) -> str:
    """The per-strategy summary as a Markdown table."""
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    lines = [f"{report['clusters']} clusters, k={report['k']}, h={report['h']}, suffix = positions "
             f"[{report['prefix']}, {report['prefix']}+{report['suffix']})", "",
             "| strategy | one copy | union of copies | one copy (suffix) | union (suffix) | suffix 100% |",
             "|---|---|---|---|---|---|"]
    for name, s in report["strategies"].items():
        lines.append(f"| {name} | {pct(s['single_copy'])} | {pct(s['coverage'])} | "
                     f"{pct(s['single_copy_suffix'])} | {pct(s['suffix_coverage'])} | "
                     f"{s['clusters_fully_covered']}/{report['clusters']} |")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: str | Path, *, overwrite: bool = False) -> list[Path]:
    """OUT/report.json (every cluster) and OUT/report.md (the table, the warnings)."""
    out = Path(out)
    paths = [out / "report.json", out / "report.md"]
    if not overwrite and any(p.exists() for p in paths):
        raise fail("--out", str(out), "already holds a coverage report; pass --overwrite or another folder")
    out.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    warn = "".join(f"- {w}\n" for w in report["warnings"]) or "- none\n"
    paths[1].write_text(f"# Goldfish mask coverage\n\n{format_table(report)}\n\n## Warnings\n\n{warn}",
                        encoding="utf-8")
    return paths


def cmd_coverage(args: Any) -> int:
    """`memorize coverage`: the audit of a corpus (its own clusters, or N injected near-copies)."""
    strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    for name, value in (("--max-tokens", args.max_tokens), ("--prefix", args.prefix),
                        ("--ngram", args.ngram)):
        if value < 1:
            raise fail(name, value, "must be >= 1")
    tok = load_tokenizer(args.tokenizer)
    docs = load_corpus(args.corpus, limit=args.limit or None)
    if args.near_copies:
        spec = DuplicateSpec(counts=[args.near_copies], per_count=min(args.clusters, len(docs)),
                             edit_rate=args.edit_rate, edit_unit=args.edit_unit)
        docs, manifest = inject(docs, duplicates=spec, seed=args.seed, tokenizer=tok)
        clusters = clusters_from_manifest(docs, manifest, tok, max_tokens=args.max_tokens)
    elif args.manifest:
        manifest = Manifest.from_json(args.manifest)
        clusters = clusters_from_manifest(docs, manifest, tok, max_tokens=args.max_tokens)
    else:
        lists = tokenize_documents(docs, tok, max_tokens=args.max_tokens)
        clusters = find_clusters([docs[i].id for i in lists.kept], list(lists), ngram=args.ngram,
                                 min_shared=args.min_shared)
    report = audit(clusters, strategies, args.k, args.h, prefix=args.prefix, suffix=args.suffix,
                   special_ids=special_token_ids(tok), seed=args.seed)
    report["corpus"] = args.corpus
    print(format_table(report))
    for w in report["warnings"][:20]:
        print(f"warning: {w}")
    if len(report["warnings"]) > 20:
        print(f"... and {len(report['warnings']) - 20} more warnings (report.json has them all)")
    if args.out:
        for p in write_report(report, args.out, overwrite=args.overwrite):
            print(f"wrote {p}")
    return 0

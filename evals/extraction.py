"""Extraction attack: continue a prefix of each document and score it against the true suffix.

Exact match from a k-token prefix is Carlini et al. (2022) k-extractability; token accuracy,
longest common prefix and RougeL say how close the misses came.

On a sharded model (or with a 1,1,1,D `grid` of replicas) every rank calls these with the same
documents: each batch shard decodes and scores its share, and every rank gets all the results, in
document order (evals/scoring.py).

`decode` picks the greedy decoder of `extract` and `extractability`: `auto` (default) is the
compiled static-cache decode on a CUDA device for a serial model (evals/static_decode.py: CUDA
graphs, every row checked by a teacher-forced forward and decoded again if the check fails) and the
KV-cache decoder with the true suffix as a speculative draft (`verified_greedy`) otherwise; `static`
and `kv` force one. `decode_log` (a DecodeLog) receives how the rows were decoded.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from axonn.grid import ProcessGrid
from evals._model import evaluating
from evals.decoding import beam_generate, beam_local, greedy_generate, verified_local
from evals.metrics import exact_match, ids_text, longest_common_prefix, rouge_l, token_accuracy
from evals.scoring import Scorer
from evals.static_decode import DecodeLog, static_local, uses_static
from memorize_core import fail

__all__ = ["ExtractionResult", "beam_generate", "extract", "extract_pairs", "extractability",
           "greedy_generate", "summarize"]


@dataclasses.dataclass
class ExtractionResult:
    """One document's extraction attempt and its scores."""

    doc: int | str
    prefix_ids: list[int]
    target_ids: list[int]
    generated_ids: list[int]
    exact_match: bool
    token_accuracy: float
    lcp: int
    rougeL: float

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of every field."""
        return dataclasses.asdict(self)


def to_jsonl(results: Sequence[ExtractionResult]) -> str:
    """The text of an extraction.jsonl file: one JSON line per result, every field."""
    return "".join(json.dumps(r.to_dict()) + "\n" for r in results)


def _positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(field, value, "pass an integer >= 1")
    return value


def _check_common(documents: Sequence[Sequence[int]], batch_size: int, num_beams: int,
                  doc_ids: Sequence | None) -> list:
    _positive_int("batch_size", batch_size)
    _positive_int("num_beams", num_beams)
    if doc_ids is None:
        return list(range(len(documents)))
    if len(doc_ids) != len(documents):
        raise fail("doc_ids", f"<{len(doc_ids)} ids>",
                   f"pass one id per document ({len(documents)} documents) or leave it None")
    return list(doc_ids)


def _text(ids: list[int], tokenizer: Any) -> str:
    return tokenizer.decode(ids) if tokenizer is not None else ids_text(ids)


def _result(doc: int | str, prefix: list[int], target: list[int], generated: list[int],
            text: Any) -> ExtractionResult:
    return ExtractionResult(doc=doc, prefix_ids=prefix, target_ids=target, generated_ids=generated,
                            exact_match=exact_match(generated, target),
                            token_accuracy=token_accuracy(generated, target),
                            lcp=longest_common_prefix(generated, target),
                            rougeL=rouge_l(text(generated), text(target)))


def _windows(model: torch.nn.Module, documents: Sequence[Sequence[int]], ids: list, *,
             prefix_len: int, suffix_len: int, target_start: int, tokenizer: Any, batch_size: int,
             num_beams: int, progress: bool, desc: str, need_field: str,
             grid: ProcessGrid | None, decode: str = "auto",
             decode_log: DecodeLog | None = None) -> list[ExtractionResult]:
    """Score documents with target = doc[target_start:+suffix_len], prefix = prefix_len tokens before."""
    need = target_start + suffix_len
    keep = [i for i, d in enumerate(documents) if len(d) >= need]
    if not keep:
        longest = max((len(d) for d in documents), default=0)
        raise fail(need_field, need, f"no document is that long (longest has {longest} tokens); "
                   "use shorter prefix/suffix lengths or longer documents")
    sc = Scorer(model, grid)
    static = uses_static(model, decode, num_beams)
    start = target_start - prefix_len
    rows = sc.rows(len(keep))
    mine: list[ExtractionResult] = []
    log = DecodeLog(path="static" if static else "kv")
    batches = range(0, len(rows), batch_size)
    # counted in documents (docs/s), not batches: the rate reads the same at any batch size
    bar = tqdm(total=len(rows), desc=desc, unit="doc", disable=not (progress and sc.is_main))
    with evaluating(model), bar:
        for b in batches:
            chunk = [keep[r] for r in rows[b:b + batch_size]]
            prefixes = torch.tensor([list(documents[i][start:target_start]) for i in chunk],
                                    dtype=torch.long, device=sc.device)
            targets = [[int(t) for t in documents[i][target_start:need]] for i in chunk]
            tgt = torch.tensor(targets, dtype=torch.long, device=sc.device)
            if static:
                gen = static_local(sc, prefixes, suffix_len, batch=min(batch_size, len(rows)), targets=tgt,
                                   log=log, ids=[ids[i] for i in chunk])
            elif num_beams == 1:
                gen = verified_local(sc, prefixes, tgt)
            else:
                gen = beam_local(sc, prefixes, suffix_len, num_beams)
            for i, g, target in zip(chunk, gen.tolist(), targets):
                mine.append(_result(ids[i], [int(t) for t in documents[i][start:target_start]], target, g,
                                    lambda x: _text(x, tokenizer)))
            bar.update(len(chunk))
        if decode_log is not None:
            _merge_logs(sc, log, decode_log)
        return sc.collect(rows, mine, len(keep))


def _merge_logs(sc: Scorer, mine: DecodeLog, into: DecodeLog) -> None:
    """Add every batch shard's DecodeLog of this call to `into` (the same on every rank)."""
    shards = sc.collect([sc.grid.batch_shard_index] if sc.grid.batch_shards > 1 else [0],
                        [mine], max(1, sc.grid.batch_shards))
    for log in shards:
        into.merge(log)


def extract(model: torch.nn.Module, documents: list[list[int]], *, prefix_len: int, suffix_len: int,
            tokenizer: Any = None, batch_size: int = 32, num_beams: int = 1,
            doc_ids: list | None = None, progress: bool = False, grid: ProcessGrid | None = None,
            decode: str = "auto", decode_log: DecodeLog | None = None) -> list[ExtractionResult]:
    """Continue each document's first prefix_len tokens for suffix_len tokens and score the result.

    Documents shorter than prefix_len+suffix_len are skipped (absent from the result; compare
    `r.doc` with your ids to see which). `doc` is the document's index, or `doc_ids[index]`.
    RougeL is computed on `tokenizer.decode` texts when a tokenizer is given, otherwise on the
    space-joined token ids. num_beams > 1 runs beam search instead of greedy decoding. `decode`:
    the greedy decoder (auto, static, kv; see the module's docstring), reported in `decode_log`.
    """
    _positive_int("prefix_len", prefix_len)
    _positive_int("suffix_len", suffix_len)
    ids = _check_common(documents, batch_size, num_beams, doc_ids)
    return _windows(model, documents, ids, prefix_len=prefix_len, suffix_len=suffix_len,
                    target_start=prefix_len, tokenizer=tokenizer, batch_size=batch_size,
                    num_beams=num_beams, progress=progress, desc=f"extract P={prefix_len}",
                    need_field="prefix_len+suffix_len", grid=grid, decode=decode, decode_log=decode_log)


def _response_text(ids: list[int], tokenizer: Any) -> str:
    # Chat responses end with end-of-turn special tokens; their literal text ("<|im_end|>") is
    # not words of the response and would inflate RougeL.
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ids_text(ids)


def extract_pairs(model: torch.nn.Module, prompts: list[list[int]], targets: list[list[int]], *,
                  tokenizer: Any = None, batch_size: int = 32, doc_ids: list | None = None,
                  progress: bool = False, grid: ProcessGrid | None = None) -> list[ExtractionResult]:
    """Greedy-continue each prompt for len(target) tokens and score it against the target (chat data).

    Prompts and targets may differ in length from pair to pair: pairs with equal (prompt, target)
    lengths are decoded together (no padding, so each equals its own greedy decoding) and results
    come back in input order. `doc` is `doc_ids[i]` or i; RougeL compares decoded texts without
    special tokens when a tokenizer is given, otherwise the space-joined ids.
    """
    if len(prompts) != len(targets):
        raise fail("targets", f"<{len(targets)} targets>",
                   f"pass one target per prompt ({len(prompts)} prompts)")
    ids = _check_common(prompts, batch_size, 1, doc_ids)
    prompts = [[int(t) for t in p] for p in prompts]
    targets = [[int(t) for t in t_] for t_ in targets]
    for i, (p, t) in enumerate(zip(prompts, targets)):
        if not p or not t:
            which = "prompts" if not p else "targets"
            raise fail(f"{which}[{i}]", [], "every prompt and target needs at least one token")
    sc = Scorer(model, grid)
    rows = sc.rows(len(prompts))
    groups: dict[tuple[int, int], list[int]] = {}
    for i in rows:
        groups.setdefault((len(prompts[i]), len(targets[i])), []).append(i)
    chunks = [idx[b:b + batch_size] for idx in groups.values() for b in range(0, len(idx), batch_size)]
    mine: dict[int, ExtractionResult] = {}
    bar = tqdm(total=len(rows), desc="extract pairs", unit="pair", disable=not (progress and sc.is_main))
    with evaluating(model), bar:
        for chunk in chunks:
            p = torch.tensor([prompts[i] for i in chunk], dtype=torch.long, device=sc.device)
            t = torch.tensor([targets[i] for i in chunk], dtype=torch.long, device=sc.device)
            gen = verified_local(sc, p, t)
            for i, g in zip(chunk, gen.tolist()):
                mine[i] = _result(ids[i], prompts[i], targets[i], g, lambda x: _response_text(x, tokenizer))
            bar.update(len(chunk))
        return sc.collect(rows, [mine[i] for i in rows], len(prompts))


def summarize(results: Sequence[ExtractionResult]) -> dict[str, float]:
    """Mean scores over results: docs, exact_match_rate, token_accuracy, lcp_mean, rougeL (NaN if empty)."""
    n = len(results)

    def mean(vals: list[float]) -> float:
        return float(sum(vals) / n) if n else float("nan")

    return {
        "docs": n,
        "exact_match_rate": mean([float(r.exact_match) for r in results]),
        "token_accuracy": mean([r.token_accuracy for r in results]),
        "lcp_mean": mean([float(r.lcp) for r in results]),
        "rougeL": mean([r.rougeL for r in results]),
    }


def extractability(model: torch.nn.Module, documents: list[list[int]], prefix_lens: list[int],
                   suffix_len: int, *, tokenizer: Any = None, batch_size: int = 32,
                   num_beams: int = 1, doc_ids: list | None = None, progress: bool = False,
                   grid: ProcessGrid | None = None, decode: str = "auto") -> dict[int, dict[str, float]]:
    """k-extractability summaries for several prefix lengths k, on one fixed target per document.

    Following Carlini et al. (2022), the suffix stays fixed while the context grows: with
    K = max(prefix_lens), every document of at least K+suffix_len tokens has target
    doc[K:K+suffix_len], and for each k the prefix is the k tokens right before it. So every k is
    scored on the same documents and the same targets; at k = K this equals `extract`.
    """
    if not prefix_lens:
        raise fail("prefix_lens", prefix_lens, "pass at least one prefix length, e.g. [8, 16, 32]")
    lens = [_positive_int(f"prefix_lens[{j}]", k) for j, k in enumerate(prefix_lens)]
    _positive_int("suffix_len", suffix_len)
    ids = _check_common(documents, batch_size, num_beams, doc_ids)
    top = max(lens)
    out: dict[int, dict[str, float]] = {}
    for k in sorted(set(lens)):
        res = _windows(model, documents, ids, prefix_len=k, suffix_len=suffix_len, target_start=top,
                       tokenizer=tokenizer, batch_size=batch_size, num_beams=num_beams,
                       progress=progress, desc=f"extractability k={k}",
                       need_field="max(prefix_lens)+suffix_len", grid=grid, decode=decode)
        out[k] = summarize(res)
    return out

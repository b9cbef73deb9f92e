"""Per-sequence memorization metrics: token accuracy, longest common prefix, exact match, RougeL."""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from rouge_score import rouge_scorer

from memorize_core import fail

Tokens = Sequence[int] | torch.Tensor


def _as_list(ids: Tokens) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return [int(t) for t in ids.reshape(-1).tolist()]
    return [int(t) for t in ids]


def token_accuracy(gen: Tokens, target: Tokens) -> float:
    """Fraction of target positions where the generation has the same token (missing = wrong)."""
    g, t = _as_list(gen), _as_list(target)
    if not t:
        raise fail("target", t, "pass at least one target token")
    return sum(a == b for a, b in zip(g, t)) / len(t)


def longest_common_prefix(gen: Tokens, target: Tokens) -> int:
    """Number of leading tokens on which generation and target agree."""
    n = 0
    for a, b in zip(_as_list(gen), _as_list(target)):
        if a != b:
            break
        n += 1
    return n


def exact_match(gen: Tokens, target: Tokens) -> bool:
    """True when the generation equals the target token for token (same length too)."""
    return _as_list(gen) == _as_list(target)


@functools.lru_cache(maxsize=1)
def _scorer() -> rouge_scorer.RougeScorer:
    # Built once: the scorer is stateless but its construction is not free.
    return rouge_scorer.RougeScorer(["rougeL"])


def rouge_l(pred_text: str, ref_text: str) -> float:
    """RougeL F-measure exactly as rouge-score's RougeScorer(["rougeL"]) defines it."""
    return float(_scorer().score(ref_text, pred_text)["rougeL"].fmeasure)


def ids_text(ids: Tokens) -> str:
    """Space-joined token ids: the text RougeL sees when no tokenizer is given."""
    return " ".join(str(t) for t in _as_list(ids))

"""Canary scores for a trained model: exposure over the secret space and extraction of each secret.

Exposure (Carlini et al. 2019) ranks a canary among the secrets of its randomness space R by the
model's log-perplexity of the secret given the template prefix. With R small enough every secret
is scored and the rank is exact; otherwise a seeded sample of R estimates the rank (and a
skew-normal fit extrapolates it).

Extraction: the attacker knows the template and R, scores every secret and keeps the most likely
ones. A canary counts as extracted when it beats every secret that was never inserted (so with m
inserted canaries, the top m guesses contain it). Greedy decoding of the shared template prefix
gives a single continuation for all canaries; it is reported too, as the model's top guess.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from data_pipelines.canaries import MAX_ENUMERATE, render
from data_pipelines.chat import answer_encoder
from evals import (
    exposure_extrapolated,
    exposure_rank,
    greedy_generate,
    group_exposure,
    sequence_log_perplexity,
)
from memorize_core import fail

CANARY_SCORES = 3  # what canary_scores records: bumped when that changes, so cached answers are
# asked again


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


Encode = Callable[[list[str]], list[list[int]]]  # canary texts -> the token ids each is scored as


def manifest_encoder(tokenizer: Any, items: Sequence[Any]) -> Encode | None:
    """How a manifest's canaries are scored: as the answer to their chat prompt where inject_chat made them
    answers (data_pipelines.chat.answer_encoder, checked on every canary), else None (their own tokens)."""
    if not items or items[0].prompt is None:
        return None
    return answer_encoder(tokenizer, items[0].prompt, check=[it.text for it in items])


def canary_ids(tokenizer: Any, texts: list[str], encode: Encode | None = None) -> list[list[int]]:
    """The token ids each canary text is scored as: `encode(texts)` where given (e.g.
    data_pipelines.chat.answer_encoder: as a chat answer), else the text's own tokens."""
    if encode is not None:
        return encode(texts)
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def secret_start(template: str, id_lists: Sequence[Sequence[int]], tokenizer: Any,
                 encode: Encode | None = None) -> int:
    """First token position that may depend on the secret: the shortest prefix shared with the template
    (encoded as the canaries are: `encode`, default the text's own tokens)."""
    head = template.split("{secret}")[0]
    if not head.strip():
        raise fail("canaries.template", template, "put some text before {secret} (the prompt the secret "
                   "is scored and extracted from)")
    head_ids = encode([head.rstrip()])[0] if encode is not None else \
        tokenizer.encode(head.rstrip(), add_special_tokens=False)
    start = min(_lcp(ids, head_ids) for ids in id_lists)
    return max(1, start)


def candidate_secrets(space: Any, canaries: list[str], num: int, seed: int) -> tuple[list[str], bool]:
    """(secrets to score, exact?): all of R when num == 0, else num sampled secrets that are not canaries."""
    if num == 0:
        if space.size > MAX_ENUMERATE:
            raise fail("canaries.candidates", 0, f"the space holds {space.size} secrets, too many to score "
                       "one by one; set canaries.candidates to a sample size, e.g. 10000")
        return [space.secret(i) for i in range(space.size)], True
    if num > space.size - len(canaries):
        raise fail("canaries.candidates", num, f"the space has only {space.size - len(canaries)} non-canary "
                   "secrets; lower it, or use 0 to score the whole space")
    return space.sample(num, seed, exclude=canaries), False


def secret_logppl(model: torch.nn.Module, tokenizer: Any, template: str, secrets: list[str],
                  batch_size: int = 256, encode: Encode | None = None
                  ) -> tuple[np.ndarray, int, list[list[int]]]:
    """(-log2 p(secret tokens | template prefix) per secret, start position, token ids). `encode` gives
    each canary text's ids where the text is not scored alone (e.g. data_pipelines.chat.answer_encoder:
    as a chat answer); default its own tokens."""
    ids = canary_ids(tokenizer, [render(template, s) for s in secrets], encode)
    start = secret_start(template, ids, tokenizer, encode)
    spans = [(start, len(x)) for x in ids]
    scores = sequence_log_perplexity(model, ids, spans=spans, batch_size=batch_size)
    return scores, start, ids


def canary_scores(model: torch.nn.Module, tokenizer: Any, template: str, space: Any, canaries: list[str],
                  *, candidates: int = 0, seed: int = 0,
                  dropped: Callable[[list[int]], Sequence[bool]] | None = None,
                  encode: Encode | None = None) -> dict[str, Any]:
    """Exposure, rank and extraction of every canary, plus the greedy continuation of the template prefix.

    `dropped(ids)`, where given, says which tokens of a canary's text the training loss never saw (the
    goldfish mask): each canary then records how many of its secret tokens were dropped and, with a token
    dropped and one kept and exposure exact, the exposure of the kept ones (`kept_exposure`, see
    kept_exposure). `encode`: as in secret_logppl (a canary trained as a chat answer is scored in that
    conversation)."""
    pool, exact = candidate_secrets(space, canaries, candidates, seed)
    secrets = pool if exact else canaries + pool
    scores, start, ids = secret_logppl(model, tokenizer, template, secrets, encode=encode)
    index = {s: i for i, s in enumerate(secrets)}
    canary_idx = np.array([index[c] for c in canaries])
    is_canary = np.zeros(len(secrets), dtype=bool)
    is_canary[canary_idx] = True
    best_other = float(scores[~is_canary].min())
    out = []
    for c, i in zip(canaries, canary_idx):
        others = np.delete(scores, i)
        # Exact: every other secret of R is scored. Sampled: the other canaries are left out of the
        # sample the rank is scaled from, so the estimate assumes nothing about them.
        ref = others if exact else scores[~is_canary]
        rank = 1 + int((ref <= scores[i]).sum())
        item = {"secret": c, "logppl_bits": float(scores[i]), "rank": rank if exact else None,
                "exposure": exposure_rank(float(scores[i]), ref, space.size),
                "extracted": bool(scores[i] < best_other)}
        if not exact:
            item["exposure_extrapolated"] = exposure_extrapolated(float(scores[i]), ref)
        if dropped is not None:
            drop = [bool(d) for d in dropped(ids[i])][start:]
            item.update(secret_tokens=len(drop), secret_tokens_dropped=sum(drop),
                        **kept_exposure(scores, ids, start, i, drop, exact))
        out.append(item)
    prefix = torch.tensor([ids[canary_idx[0]][:start]], dtype=torch.long)
    longest = max(len(ids[i]) for i in canary_idx) - start
    greedy = greedy_generate(model, prefix, longest)[0].tolist()
    return {"canaries": out, "exact": exact, "scored": len(secrets), "space_size": space.size,
            "secret_start": start,
            "max_exposure": float(np.log2(space.size)), "greedy_continuation": tokenizer.decode(greedy),
            "prompt": tokenizer.decode(ids[canary_idx[0]][:start])}


def kept_exposure(scores: np.ndarray, ids: list[list[int]], start: int, target: int, drop: list[bool],
                  exact: bool) -> dict[str, Any]:
    """What a canary whose loss dropped some secret tokens gives away of the others: the exposure of its
    tokens at the kept positions (evals.group_exposure: every secret of R grouped by its tokens there,
    probability summed over the dropped ones), out of log2(groups) bits. Only secrets that tokenize to as
    many tokens as the canary are aligned with it and grouped. None where no token was dropped (exposure
    says it all), every token was, or R was sampled."""
    keep = [start + p for p, d in enumerate(drop) if not d]
    if not exact or not any(drop) or not keep:
        return {"kept_exposure": None, "kept_groups": None}
    aligned = [j for j, x in enumerate(ids) if len(x) == len(ids[target])]
    keys = [tuple(ids[j][p] for p in keep) for j in aligned]
    bits, _, groups = group_exposure(scores[aligned], keys, aligned.index(target))
    return {"kept_exposure": bits, "kept_groups": groups}

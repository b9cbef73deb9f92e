"""The one-run privacy audit of a training run (Steinke, Nasr & Jagielski, NeurIPS 2023): its canaries,
which of them trained, and the empirical epsilon lower bound after training.

`eval.audit: true` draws `eval.audit_canaries` (m) canaries: distinct sequences of random words
(data_pipelines.SecretSpace, seeded by the run's seed), each included in the training corpus
independently with probability 1/2 (evals.audit.draw_inclusion, seeded). The draw and the texts are
in run.json (`audit.canaries`), so the audit can be recomputed from the run's files. After training,
every canary is scored by minus its mean token loss under the trained model (higher = more likely a
member), and evals.audit turns the guesses on the highest- and lowest-scoring canaries into a lower
bound on epsilon at 95% confidence. On chat data each canary is the answer to a fixed user turn
(`prompt`): an included one trains as that conversation, and every canary is scored by minus the mean
loss of its answer tokens in that conversation (`start` on), the prompt being the same in all of them.
It is compared with the accountant's epsilon: a bound above it
means the run leaks more than its DP-SGD claims (a bug in the mechanism or its accounting); a bound
far below it says nothing about DP, only that this attack on these canaries did not reach it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from axonn.grid import ProcessGrid
from data_pipelines import ChatExample, Document, SecretSpace, canary_conversation, tokenize_documents
from data_pipelines.chat import answer_encoder
from evals.audit import audit, draw_inclusion
from evals.exposure import sequence_log_perplexity
from evals.mia import score_sequences
from memorize_core import fail

SCORE = "neg_loss"  # minus the canary's mean token loss: the score the guesses are made on
WORDS = 12  # words per canary: ~16-20 tokens, long enough to be memorized, short beside a document


@dataclass
class AuditSet:
    """The run's audit canaries: their texts, which ones trained (`included`), and their token ids."""

    texts: list[str]
    included: np.ndarray
    seed: int
    ids: list[list[int]] | None = None
    prompt: str | None = None  # chat data: the user turn every canary answers
    start: int = 0  # chat data: where each canary's answer starts in `ids` (the scored tokens)

    def documents(self) -> list[Document]:
        """The included canaries as training documents (ids `audit-<index>`)."""
        return [Document(f"audit-{i}", t, "audit") for i, t in enumerate(self.texts) if self.included[i]]

    def conversations(self) -> list[ChatExample]:
        """Chat data: the included canaries as training conversations [user: prompt, assistant: canary]."""
        return [ChatExample(f"audit-{i}", canary_conversation(t, self.prompt), "audit")
                for i, t in enumerate(self.texts) if self.included[i]]

    def record(self) -> dict[str, Any]:
        """What run.json keeps of the draw: every canary, included or not, the seed (and the chat prompt)."""
        out = {"seed": self.seed, "canaries": [{"index": i, "text": t, "included": bool(self.included[i])}
                                               for i, t in enumerate(self.texts)]}
        return out if self.prompt is None else {**out, "prompt": self.prompt}


def audit_set(m: int, seed: int) -> AuditSet:
    """m distinct random-word canaries and the seeded coin flip that includes each with probability 1/2."""
    space = SecretSpace(kind="words", length=WORDS, vocab_size=1000, word_seed=seed)
    return AuditSet(space.sample(m, seed=seed), draw_inclusion(m, seed), seed)


def tokenize_audit(audit_canaries: AuditSet, tokenizer: Any, max_tokens: int | None = None) -> AuditSet:
    """The canaries' token ids under the run's tokenizer, cut as its rows are (`max_tokens`): exactly what
    the model trained on for the included ones, and the same for the others."""
    tokens = tokenize_documents(audit_canaries.texts, tokenizer, max_tokens=max_tokens, min_tokens=1)
    if len(tokens.kept) != len(audit_canaries.texts):
        raise ValueError("an audit canary tokenized to nothing")  # random words never do
    audit_canaries.ids = [list(t) for t in tokens]
    return audit_canaries


def tokenize_chat_audit(audit_canaries: AuditSet, tokenizer: Any, prompt: str, max_tokens: int) -> AuditSet:
    """Chat data: each canary's ids as the answer to `prompt` in the chat template (answer_encoder, checked
    against the whole rendering), cut at `max_tokens` as the conversation rows are."""
    texts = audit_canaries.texts
    encode = answer_encoder(tokenizer, prompt, check=texts)
    ids, start = encode(texts), len(encode([""])[0])
    if start >= max_tokens:
        raise fail("data.block_len", max_tokens, f"leaves no answer token of the audit canaries after their "
                   f"{start}-token prompt; raise it (the canaries are ~{max(map(len, ids)) - start} tokens)")
    audit_canaries.ids = [x[:max_tokens] for x in ids]
    audit_canaries.prompt, audit_canaries.start = prompt, start
    return audit_canaries


def audit_scores(model: torch.nn.Module, canaries: AuditSet, *, batch_size: int = 16,
                 grid: ProcessGrid | None = None) -> np.ndarray:
    """Each canary's membership score (higher = member): minus its mean token loss; on chat data, over its
    answer tokens only."""
    if canaries.ids is None:
        raise ValueError("tokenize_audit first")  # a programming error, not a user's input
    if canaries.prompt is None:
        return score_sequences(model, canaries.ids, batch_size=batch_size, grid=grid)["loss"]
    spans = [(canaries.start, len(x)) for x in canaries.ids]
    bits = sequence_log_perplexity(model, canaries.ids, spans=spans, batch_size=batch_size, grid=grid)
    return -bits * np.log(2.0) / np.array([end - start for start, end in spans])


def run_audit(model: torch.nn.Module, canaries: AuditSet, *, epsilon: float | None, delta: float = 0.0,
              batch_size: int = 16, grid: ProcessGrid | None = None) -> dict[str, Any]:
    """Score every canary with the trained model (every rank, on its grid) and bound epsilon from below.

    `epsilon`/`delta`: the accountant's (None: a run without DP-SGD, where the bound shows the audit's
    power). The result is JSON-ready: evals.audit's fields plus `nominal_epsilon` and `above_nominal`."""
    scores = audit_scores(model, canaries, batch_size=batch_size, grid=grid)
    result = audit(scores, canaries.included, delta=delta, score_name=SCORE).as_dict()
    if canaries.prompt is not None:
        result["prompt"] = canaries.prompt  # chat data: each canary is the answer to this user turn
    result["nominal_epsilon"] = epsilon
    result["above_nominal"] = bool(epsilon is not None and result["eps_lower_bound"] > epsilon)
    return result


__all__ = ["AuditSet", "SCORE", "audit_scores", "audit_set", "run_audit", "tokenize_audit",
           "tokenize_chat_audit"]

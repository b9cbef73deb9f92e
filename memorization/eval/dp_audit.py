"""The one-run privacy audit of a training run (Steinke, Nasr & Jagielski, NeurIPS 2023): its canaries,
which of them trained, and the empirical epsilon lower bound after training.

`eval.audit: true` draws `eval.audit_canaries` (m) canaries: distinct sequences of random words
(data_pipelines.SecretSpace, seeded by the run's seed), each included in the training corpus
independently with probability 1/2 (evals.audit.draw_inclusion, seeded). The draw and the texts are
in run.json (`audit.canaries`), so the audit can be recomputed from the run's files. After training,
every canary is scored by minus its mean token loss under the trained model (higher = more likely a
member), and evals.audit turns the guesses on the highest- and lowest-scoring canaries into a lower
bound on epsilon at 95% confidence. It is compared with the accountant's epsilon: a bound above it
means the run leaks more than its DP-SGD claims (a bug in the mechanism or its accounting); a bound
far below it says nothing about DP, only that this attack on these canaries did not reach it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from axonn.grid import ProcessGrid
from data_pipelines import Document, SecretSpace, tokenize_documents
from evals.audit import audit, draw_inclusion
from evals.mia import score_sequences

SCORE = "neg_loss"  # minus the canary's mean token loss: the score the guesses are made on
WORDS = 12  # words per canary: ~16-20 tokens, long enough to be memorized, short beside a document


@dataclass
class AuditSet:
    """The run's audit canaries: their texts, which ones trained (`included`), and their token ids."""

    texts: list[str]
    included: np.ndarray
    seed: int
    ids: list[list[int]] | None = None

    def documents(self) -> list[Document]:
        """The included canaries as training documents (ids `audit-<index>`)."""
        return [Document(f"audit-{i}", t, "audit") for i, t in enumerate(self.texts) if self.included[i]]

    def record(self) -> dict[str, Any]:
        """What run.json keeps of the draw: every canary, included or not, and the seed."""
        return {"seed": self.seed, "canaries": [{"index": i, "text": t, "included": bool(self.included[i])}
                                                for i, t in enumerate(self.texts)]}


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


def run_audit(model: torch.nn.Module, canaries: AuditSet, *, epsilon: float | None, delta: float = 0.0,
              batch_size: int = 16, grid: ProcessGrid | None = None) -> dict[str, Any]:
    """Score every canary with the trained model (every rank, on its grid) and bound epsilon from below.

    `epsilon`/`delta`: the accountant's (None: a run without DP-SGD, where the bound shows the audit's
    power). The result is JSON-ready: evals.audit's fields plus `nominal_epsilon` and `above_nominal`."""
    if canaries.ids is None:
        raise ValueError("tokenize_audit first")  # a programming error, not a user's input
    scores = score_sequences(model, canaries.ids, batch_size=batch_size, grid=grid)["loss"]
    result = audit(scores, canaries.included, delta=delta, score_name=SCORE).as_dict()
    result["nominal_epsilon"] = epsilon
    result["above_nominal"] = bool(epsilon is not None and result["eps_lower_bound"] > epsilon)
    return result


__all__ = ["AuditSet", "SCORE", "audit_set", "run_audit", "tokenize_audit"]

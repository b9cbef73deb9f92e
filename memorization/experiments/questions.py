"""Membership inference and utility of one model, as experiments ask them of every run and pass.

`PrivacyUtility` holds what does not change between the models it scores: the member and
non-member token lists, the other-domain documents, and the reference model's NLL of every
member and non-member (the reference is scored once, not once per model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import axonn
from axonn.grid import ProcessGrid
from data_pipelines import load_corpus, tokenize_documents
from evals.mia import bootstrap_ci, roc_metrics, score_sequences
from evals.perplexity import corpus_loss
from memorization.config import RunConfig
from memorization.eval.utility import check_fewshot, check_tasks, headline, score_tasks
from memorization.experiments.reporting import Shown
from memorization.experiments.spec import choice_list
from memorization.models import build_model, load_sharded, model_config, resolve_model_dir
from memorization.train.parallel import run_dims
from memorize_core import fail

MIA_METHODS = ("loss", "zlib", "min_k", "min_k_plus_plus", "ref_ratio")


@dataclass
class MiaSettings:
    """Which MIA scores to compute and how (shared experiment keys)."""

    mia_methods: list[str] = field(default_factory=lambda: ["loss", "zlib", "min_k_plus_plus", "ref_ratio"])
    mia_k: float = 0.2  # fraction of lowest-scoring tokens for min-k / min-k++
    bootstrap: int = 1000  # resamples for the 95% confidence intervals (0 = none)
    other_held_out: str = "lee-news"  # a second domain for utility ("" = none)
    other_held_out_limit: int = 50
    # Downstream utility (lm-eval): tasks, the first N documents of each (0 = all), shots (None: the
    # task's own). [] = none; the experiment configs name the bundled offline analogies.
    downstream: list[str] = field(default_factory=list)
    downstream_limit: int = 20
    downstream_fewshot: int | None = None

    def check(self) -> None:
        """Range checks with house-style errors."""
        choice_list("mia_methods", self.mia_methods, MIA_METHODS)
        if not 0 < self.mia_k <= 1:
            raise fail("mia_k", self.mia_k, "must be a fraction in (0, 1], e.g. 0.2")
        if self.bootstrap < 0:
            raise fail("bootstrap", self.bootstrap, "must be >= 0 (0 = no confidence intervals)")
        if self.other_held_out_limit < 0:
            raise fail("other_held_out_limit", self.other_held_out_limit, "must be >= 0 (0 = all)")
        if self.downstream:
            self.downstream = check_tasks(self.downstream, "downstream")
        if isinstance(self.downstream_limit, bool) or not isinstance(self.downstream_limit, int) \
                or self.downstream_limit < 0:
            raise fail("downstream_limit", self.downstream_limit, "must be >= 0 (0 = every document)")
        check_fewshot(self.downstream_fewshot, "downstream_fewshot")


def other_domain(settings: MiaSettings, tokenizer: Any, block_len: int) -> list[list[int]]:
    """Token lists of the other-domain corpus, cut to block_len ([] when none is set)."""
    if not settings.other_held_out:
        return []
    docs = load_corpus(settings.other_held_out, limit=settings.other_held_out_limit or None)
    return list(tokenize_documents(docs, tokenizer, max_tokens=block_len, min_tokens=2))


def reference_model(base: RunConfig, grid_spec: str | None) -> torch.nn.Module:
    """The un-fine-tuned base model, the ref_ratio reference: on a launch of several processes it is
    streamed into the shards of the grid the runs train on (no rank holds it whole), else built whole."""
    name = base.model.name
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1) \
            or resolve_model_dir(name) is None:
        return build_model(name, overrides=base.model.overrides).eval()
    dims, _ = run_dims(base, model_config(name, overrides=base.model.overrides), spec=grid_spec)
    return load_sharded(resolve_model_dir(name), axonn.init(*dims), base.parallel_mode)


class PrivacyUtility:
    """MIA (members vs non-members) and held-out losses of any model sharing one tokenizer."""

    def __init__(self, settings: MiaSettings, tokenizer: Any, members: list[list[int]],
                 nonmembers: list[list[int]], other: list[list[int]], reference: torch.nn.Module | None,
                 seed: int = 0, starts: tuple[list[int], list[int]] | None = None):
        """`starts`: (members', non-members') first scored token of each sequence (chat data: the response
        after its prompt, evals.mia.score_sequences); None = every token but the first."""
        if len(members) < 2 or len(nonmembers) < 2:
            raise fail("members/nonmembers", f"{len(members)}/{len(nonmembers)}",
                       "membership inference needs at least 2 members and 2 non-members; use more documents")
        self.s, self.tok, self.seed = settings, tokenizer, seed
        self.sets = {"members": members, "nonmembers": nonmembers}
        self.starts = dict(zip(self.sets, starts)) if starts else {name: None for name in self.sets}
        self.other = other
        self._ref_nll: dict[str, Any] = {}
        if "ref_ratio" in settings.mia_methods:
            if reference is None:
                raise fail("mia_methods", settings.mia_methods, "ref_ratio needs a reference model")
            for name, seqs in self.sets.items():
                self._ref_nll[name] = -score_sequences(reference, seqs, tokenizer=tokenizer, k=settings.mia_k,
                                                       batch_size=16, starts=self.starts[name])["loss"]

    def downstream(self, model: torch.nn.Module, grid: ProcessGrid | None = None) -> dict[str, Any] | None:
        """The downstream tasks' results (memorization.eval.utility.score_tasks) plus `headline`, or None
        when the experiment names no task."""
        if not self.s.downstream:
            return None
        res = score_tasks(model, self.tok, self.s.downstream, num_fewshot=self.s.downstream_fewshot,
                          limit=self.s.downstream_limit or None, batch_size=32, grid=grid)
        return {**res, "headline": headline(res)}

    def __call__(self, model: torch.nn.Module, grid: ProcessGrid | None = None,
                 downstream: bool = False, per_document: bool = False) -> dict[str, Any]:
        """{"mia": {method: {auc, tpr_at_1fpr, auc_ci, tpr_at_1fpr_ci}}, "val_loss", "other_val_loss"}
        (+ "downstream" when asked and the experiment names tasks; + "per_document" when asked: {"members":
        {method: score per member}, "nonmembers": {...}, "nonmember_nll": mean token NLL per non-member},
        what memorization.paired compares between two models of one run).

        One forward pass over members and non-members gives every MIA score and, from the
        non-members' per-sequence NLL, the held-out loss (token-weighted: sequence i scores len-1
        tokens, or len - start of its scored span), so no second pass is needed for utility.
        """
        scores = {name: score_sequences(model, seqs, tokenizer=self.tok, k=self.s.mia_k, batch_size=16,
                                        grid=grid, starts=self.starts[name])
                  for name, seqs in self.sets.items()}
        first = self.starts["nonmembers"] or [1] * len(self.sets["nonmembers"])
        scored = np.array([len(x) - f for x, f in zip(self.sets["nonmembers"], first)], dtype=np.float64)
        val_loss = float((-scores["nonmembers"]["loss"] * scored).sum() / scored.sum())
        for name, nll in self._ref_nll.items():  # reference NLL minus target NLL, as evals.mia defines it
            scores[name]["ref_ratio"] = nll + scores[name]["loss"]
        mia = {}
        for method in self.s.mia_methods:
            m, n = scores["members"][method], scores["nonmembers"][method]
            roc = roc_metrics(m, n)
            rec = {"auc": roc["auc"], "tpr_at_1fpr": roc["tpr_at_1pct_fpr"]}
            if self.s.bootstrap:
                ci = bootstrap_ci(m, n, resamples=self.s.bootstrap, seed=self.seed)
                rec.update(auc_ci=ci["auc_ci"], tpr_at_1fpr_ci=ci["tpr_at_1pct_fpr_ci"])
            mia[method] = rec
        other = corpus_loss(model, self.other, batch_size=16, grid=grid)["loss"] if self.other else None
        out = {"mia": mia, "val_loss": val_loss, "other_val_loss": other}
        if downstream and (tasks := self.downstream(model, grid)) is not None:
            out["downstream"] = tasks
        if per_document:
            out["per_document"] = {
                **{side: {m: [float(v) for v in scores[side][m]] for m in self.s.mia_methods}
                   for side in self.sets},
                "nonmember_nll": [float(-v) for v in scores["nonmembers"]["loss"]]}
        return out


def task_label(settings: MiaSettings) -> str:
    """Column title of the downstream accuracy: the task's name when there is one."""
    return f"{settings.downstream[0]} acc" if len(settings.downstream) == 1 else "downstream acc"


def limit_words(settings: MiaSettings) -> str:
    """How much of each downstream task is scored, in words, for report notes."""
    shots = "zero-shot" if settings.downstream_fewshot in (None, 0) else f"{settings.downstream_fewshot}-shot"
    n = (f"the first {settings.downstream_limit} documents of each task" if settings.downstream_limit
         else "every document")
    return f"{n}, {shots} unless the task fixes its shots"


def format_acc(rec: dict[str, Any] | None) -> Shown | None:
    """'0.72 ± 0.05' (downstream accuracy ± lm-eval's standard error) for report tables."""
    head = (rec or {}).get("headline") or {}
    if head.get("acc") is None:
        return None
    se = head.get("acc_stderr")
    return Shown(f"{head['acc']:.2f}" + (f" ± {se:.2f}" if se is not None else ""), head["acc"])


def format_auc(rec: dict[str, Any] | None) -> Shown | None:
    """'0.73 [0.62, 0.84]' (or '0.73' without a CI) for report tables."""
    if not rec:
        return None
    ci = rec.get("auc_ci")
    return Shown(f"{rec['auc']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{rec['auc']:.2f}", rec["auc"])

"""Unlearning: make a trained model forget chosen training rows and keep the rest (a post-hoc mitigation).

Each method is an objective over batches that hold rows to forget and rows to retain, carried out as
the trainer's gradient hook (axonn/hooks.py GradientHook: it draws each step's rows and weighs them by
what they are). Per forget row i, s_i is the sum of its tokens' cross-entropy (= -log p_theta(row i)):
  ga     gradient ascent: minimise -sum_f s_i / N_f (Jang et al. 2023, "Knowledge unlearning")
  gdiff  gradient difference: ga + retain_weight * sum_r s_i / N_r (Liu et al. 2022; TOFU's GradDiff)
  npo    negative preference optimisation (Zhang et al. 2024): (2/beta) mean_f softplus(beta * (-s_i -
         log p_ref(row i))) + retain_weight * sum_r s_i / N_r, p_ref the model before unlearning; its
         gradient is ga's weighted by 2 sigmoid(beta * log(p/p_ref)), which fades as a row's likelihood
         falls below the reference's (no collapse of the whole model, unlike ga)
N_f, N_r: the supervised tokens of the step's forget and retain rows (the whole global batch's).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from axonn.config import to_dict
from axonn.engine import all_reduce_sum
from axonn.grid import ProcessGrid
from axonn.hooks import GradientHook
from data_pipelines.packing import Blocks
from memorize_core import IGNORE_INDEX, fail

METHODS = ("ga", "gdiff", "npo")


@dataclass
class UnlearnSettings:
    """How one unlearning method runs: its objective, learning rate, passes and batch."""

    method: str = "npo"
    lr: float = 5.0e-5  # constant; far below a fine-tune's: ascent has no floor
    passes: int = 4  # passes over the forget rows
    forget_batch: int = 8  # forget rows per step
    retain_batch: int = 8  # retain rows per step (ga draws none: its objective ignores them)
    beta: float = 0.1  # npo's inverse temperature
    retain_weight: float = 1.0  # gdiff's and npo's weight of the retain CE

    def validate(self, prefix: str = "unlearn") -> None:
        """Every field in range; names the field with `prefix`."""
        prefix = f"{prefix}." if prefix else ""
        if self.method not in METHODS:
            raise fail(f"{prefix}method", self.method, f"choose one of {', '.join(METHODS)}")
        if not self.lr > 0:
            raise fail(f"{prefix}lr", self.lr, "must be > 0, e.g. 5.0e-5")
        for name, least in (("passes", 1), ("forget_batch", 1), ("retain_batch", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise fail(f"{prefix}{name}", value, f"must be an integer >= {least}")
        if not self.beta > 0:
            raise fail(f"{prefix}beta", self.beta, "must be > 0, e.g. 0.1")
        if not self.retain_weight >= 0:
            raise fail(f"{prefix}retain_weight", self.retain_weight, "must be >= 0")

    def check_method(self, prefix: str = "unlearn") -> None:
        """What the method itself needs beyond valid fields (a shared block of settings, validated on its
        own, serves methods that read different ones): retain rows for gdiff and npo."""
        self.validate(prefix)
        if self.method != "ga" and self.retain_batch == 0:
            raise fail(f"{prefix}.retain_batch" if prefix else "retain_batch", 0, f"{self.method} trains on "
                       "retain rows: give >= 1, or use method ga")

    def identity(self) -> dict[str, Any]:
        """The settings as the method reads them, those it ignores at their defaults: what keys a run, so a
        change to a field the method never reads (a shared block's beta under ga) trains nothing again."""
        unread = {"ga": ("retain_batch", "retain_weight", "beta"), "gdiff": ("beta",)}.get(self.method, ())
        return to_dict(replace(self, **{f.name: f.default for f in fields(self) if f.name in unread}))

    @property
    def uses_retain(self) -> bool:
        """Whether the objective reads retain rows (ga does not: it draws none)."""
        return self.method != "ga"

    def steps_per_pass(self, n_forget: int) -> int:
        """Optimizer steps per pass over `n_forget` forget rows."""
        return -(-n_forget // self.forget_batch)

    def rows_per_step(self) -> int:
        """The global batch of one step: forget rows plus the retain rows the objective reads."""
        return self.forget_batch + (self.retain_batch if self.uses_retain else 0)


def forget_first(rows: Blocks, forget: list[int]) -> tuple[Blocks, int]:
    """(the rows reordered: the `forget` row indices first, then every other row; how many forget rows):
    the dataset an UnlearnObjective draws from."""
    chosen = set(forget)
    if len(chosen) != len(forget) or not forget or not chosen <= set(range(len(rows))):
        raise fail("forget", forget[:5], f"give distinct row indices in [0, {len(rows)})")
    order = list(forget) + [i for i in range(len(rows)) if i not in chosen]
    return select_rows(rows, order), len(forget)


def select_rows(rows: Blocks, order: list[int]) -> Blocks:
    """The rows `order` of `rows` (document indices kept, so a row still names its document)."""
    idx = torch.as_tensor(order, dtype=torch.long)
    return Blocks(rows.input_ids[idx], rows.doc_ids[idx], rows.labels[idx], num_docs=rows.num_docs,
                  eos_id=rows.eos_id, positions=None if rows.positions is None else rows.positions[idx])


def supervised_tokens(rows: Blocks) -> torch.Tensor:
    """Per row, the tokens the trainer's loss scores (labels 1.. that are not ignored)."""
    return (rows.labels[:, 1:] != IGNORE_INDEX).sum(1)


class UnlearnObjective(GradientHook):
    """The trainer's gradient hook for one method over a forget-first dataset (`forget_first`).

    Each step draws the next `forget_batch` forget rows of a seeded per-pass order and, when the method
    reads them, `retain_batch` retain rows drawn at random (seeded by the step); npo needs the
    reference log-likelihood of every forget row (`set_reference`) before the first step.
    """

    token_losses = True

    def __init__(self, settings: UnlearnSettings, rows: Blocks, n_forget: int, *, seed: int = 0):
        settings.check_method()
        n_retain = len(rows) - n_forget
        if settings.uses_retain and n_retain < 1:
            raise fail("forget", n_forget, f"leaves no row to retain for {settings.method}; "
                       "forget fewer rows")
        self.s, self.n_forget, self.n_retain, self.seed = settings, n_forget, n_retain, seed
        self.tokens = supervised_tokens(rows)
        self.ref: torch.Tensor | None = None
        self.per_pass = settings.steps_per_pass(n_forget)
        self._ids: torch.Tensor | None = None
        self._counts = (1, 1, 1)
        self._sums = torch.zeros(4, dtype=torch.float64)  # forget CE, forget tokens, retain CE, retain tokens
        self._grid: ProcessGrid | None = None

    def set_reference(self, logp: torch.Tensor) -> None:
        """log p_ref of each forget row (the sum over its supervised tokens), in dataset order."""
        if logp.shape != (self.n_forget,):
            raise fail("reference", tuple(logp.shape),
                       f"give one log-likelihood per forget row ({self.n_forget})")
        self.ref = logp.detach().double().cpu()

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grid: ProcessGrid) -> None:
        """Keep the grid: the step's metrics are summed over its batch shards."""
        self._grid = grid

    def draw_rows(self, step: int, n: int) -> torch.Tensor:
        """The step's forget rows (the pass's order, in turn) then its retain rows (a seeded draw)."""
        s = self.s
        gen = torch.Generator().manual_seed(self.seed * 100_003 + step // self.per_pass)
        order = torch.randperm(self.n_forget, generator=gen)
        at = (step % self.per_pass) * s.forget_batch
        forget = order[at:at + s.forget_batch]
        retain = torch.empty(0, dtype=torch.long)
        if s.uses_retain:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + 7919 * (step + 1))
            retain = self.n_forget + torch.randperm(self.n_retain, generator=gen)[:s.retain_batch]
        self._counts = (max(1, int(self.tokens[forget].sum())), max(1, len(forget)),
                        max(1, int(self.tokens[retain].sum())))
        return torch.cat([forget, retain])

    def micro_batch_rows(self, ids: torch.Tensor | None) -> None:
        """Which rows the coming micro-batch holds on this rank (the objective tells forget from retain)."""
        if ids is None:
            raise fail("rows", None, "an unlearning objective needs the rows of each batch: train with fit()")
        self._ids = ids.cpu()

    def objective(self, loss_sum: torch.Tensor, denom: int, token_losses: torch.Tensor | None,
                  targets: torch.Tensor) -> torch.Tensor:
        """The method's loss on this rank's rows of the micro-batch, normalised over the global batch."""
        s, ids = self.s, self._ids
        n_rows = targets.shape[0]
        ce = token_losses.reshape(n_rows, -1).sum(1)  # -log p(row), 0 for an unsupervised padding row
        real = (targets != IGNORE_INDEX).any(1).cpu()
        forget = (ids < self.n_forget) & real
        retain = (ids >= self.n_forget) & real
        n_f, b_f, n_r = self._counts
        f_idx, r_idx = forget.nonzero().squeeze(1).to(ce.device), retain.nonzero().squeeze(1).to(ce.device)
        if s.method == "npo":
            if self.ref is None:
                raise fail("reference", None, "npo needs the forget rows' reference log-likelihoods: "
                           "call set_reference before training")
            ratio = -ce[f_idx] - self.ref[ids[forget]].to(ce.device, ce.dtype)
            loss = (2.0 / s.beta) * F.softplus(s.beta * ratio).sum() / b_f
        else:
            loss = -ce[f_idx].sum() / n_f
        if s.uses_retain and s.retain_weight:
            loss = loss + s.retain_weight * ce[r_idx].sum() / n_r
        tok = self.tokens[ids]
        self._sums += torch.tensor([ce[f_idx].sum().item(), float(tok[forget].sum()),
                                    ce[r_idx].sum().item(), float(tok[retain].sum())], dtype=torch.float64)
        return loss

    def reduce(self, step: int) -> bool:
        """Sum the step's forget/retain CE over the batch shards (the trainer syncs the gradients)."""
        if self._grid is not None:
            self._sums = all_reduce_sum(self._sums, self._grid, group="batch")
        return False

    def metrics(self, steps: int) -> dict[str, Any]:
        """The step's mean token CE on its forget rows and on its retain rows."""
        f, nf, r, nr = self._sums.tolist()
        self._sums = torch.zeros(4, dtype=torch.float64)
        out = {"forget_loss": f / nf if nf else None}
        if self.s.uses_retain:
            out["retain_loss"] = r / nr if nr else None
        return out


def reference_logp(model: torch.nn.Module, rows: Blocks, n_forget: int,
                   grid: ProcessGrid | None = None, batch_size: int = 16) -> torch.Tensor:
    """log p(row) of each of the first `n_forget` rows under `model`: the sum of the token log-probs
    the trainer's loss scores (labels 1.. not ignored, a masked prompt included as context), on the
    model's grid through the evaluation layer: npo's reference. The evaluation layer scores in fp32:
    where the trainer computes in bf16 (CUDA), npo's log-ratio at the first step is that rounding, not
    exactly 0."""
    from evals.perplexity import sequence_logprobs  # deferred: evals costs seconds to import; npo only
    ids, labels = rows.input_ids[:n_forget], rows.labels[:n_forget]
    scored = labels[:, 1:] != IGNORE_INDEX
    if not torch.equal(labels[:, 1:][scored], ids[:, 1:][scored]):
        raise fail("forget", "labels", "npo's reference scores each row's own tokens: give rows whose "
                   "supervised labels are their input ids")
    out = []
    for b in range(0, n_forget, batch_size):  # as the trainer's forward: no attention mask, right padding
        lp = sequence_logprobs(model, ids[b:b + batch_size], grid=grid).double()
        out.append((lp * scored[b:b + batch_size]).sum(1))
    return torch.cat(out)


__all__ = ["METHODS", "UnlearnObjective", "UnlearnSettings", "forget_first", "reference_logp",
           "select_rows", "supervised_tokens"]

"""Unlearning objectives: each step's gradient equals its definition, on micro-batches and on a grid."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model

from axonn.config import TrainerConfig
from axonn.spawn import run_distributed
from axonn.trainer import Trainer
from data_pipelines.packing import Blocks
from memorization.mitigations.unlearning import (
    UnlearnObjective,
    UnlearnSettings,
    forget_first,
    reference_logp,
    supervised_tokens,
)
from memorize_core import IGNORE_INDEX, ConfigError

FORGET = [3, 7, 1, 9, 0]


def blocks(n=12, t=16, vocab=64):
    """n seeded rows of t ids, every third one padded for its last 4 tokens (ignored labels)."""
    ids = torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[::3, -4:] = IGNORE_INDEX
    ids[::3, -4:] = 0
    return Blocks(ids, torch.arange(n).unsqueeze(1).expand(n, t).clone(), labels)


class Captured(UnlearnObjective):
    """The objective, keeping each step's summed gradient (before clipping and AdamW)."""

    def attach(self, model, optimizer, grid):
        super().attach(model, optimizer, grid)
        self.model, self.grads = model, []

    def reduce(self, step):
        out = super().reduce(step)
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()})
        return out


def settings(method):
    return UnlearnSettings(method=method, lr=1e-3, forget_batch=4, retain_batch=3, beta=0.5,
                           retain_weight=0.7)


def trainer(method, data, n_forget, grad_accum=2, steps=1, model=None, grid=None):
    hook = Captured(settings(method), data, n_forget, seed=1)
    cfg = TrainerConfig(lr=1e-3, warmup_steps=0, batch_size=8, grad_accum=grad_accum, max_steps=steps,
                        grad_clip=0.0, progress=False, device="cpu", compile=False, loss_chunk="off")
    model = model if model is not None else tiny_model()
    if method == "npo":
        hook.set_reference(reference_logp(model, data, n_forget, grid=grid))
    return Trainer(model, cfg, data, gradient_hook=hook, grid=grid), hook


def by_definition(method, data, n_forget, rows):
    """The step's gradient from the method's formula over the whole global batch, one forward."""
    s = settings(method)
    model = tiny_model()
    batch = data[rows]
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    tgt = batch["labels"][:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="none").reshape(tgt.shape).sum(1)  # -log p(row)
    forget = rows < n_forget
    tokens = supervised_tokens(data)[rows]
    if method == "npo":  # at the reference (the same model): log-ratio 0, softplus(0) = ln 2
        ref = -ce[forget].detach()
        loss = (2 / s.beta) * F.softplus(s.beta * (-ce[forget] - ref)).sum() / forget.sum()
        assert loss.item() == pytest.approx(2 * math.log(2) / s.beta, rel=1e-6)
    else:
        loss = -ce[forget].sum() / tokens[forget].sum()
    if method != "ga":
        loss = loss + s.retain_weight * ce[~forget].sum() / tokens[~forget].sum()
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("method", ["ga", "gdiff", "npo"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_step_follows_the_methods_definition(method, grad_accum):
    """The trainer's summed gradient over micro-batches equals the method's formula over the step's
    rows: forget rows ascend (npo at the reference: each weighted 1/B_f), retain rows descend."""
    data, n_forget = forget_first(blocks(), FORGET)
    t, hook = trainer(method, data, n_forget, grad_accum=grad_accum)
    rows = UnlearnObjective(settings(method), data, n_forget, seed=1).draw_rows(0, len(data))
    assert (rows[:4] < n_forget).all() and (rows[4:] >= n_forget).all() if method != "ga" else len(rows) == 4
    t.fit()
    want = by_definition(method, data, n_forget, rows)
    for name, g in hook.grads[0].items():
        torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-6)


def test_reference_is_the_trainers_likelihood_of_each_row():
    """npo's reference log p(row) (scored by the evaluation layer) equals minus the trainer's CE sum over
    the labels it scores, a masked prompt included (context, not scored); labels that are not the row's
    own tokens are refused."""
    data = blocks()
    data.labels[3, :3] = IGNORE_INDEX  # a masked prompt on the first forget row (FORGET[0])
    data, n_forget = forget_first(data, FORGET)
    model = tiny_model()
    ref = reference_logp(model, data, n_forget, batch_size=2)
    batch = data[torch.arange(n_forget)]
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    tgt = batch["labels"][:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="none").reshape(tgt.shape).sum(1)
    torch.testing.assert_close(ref.float(), -ce.detach(), rtol=1e-5, atol=1e-4)
    data.labels[1, 5] = (data.labels[1, 5] + 1) % 64
    with pytest.raises(ConfigError, match=r"^forget='labels': npo's reference scores each row's own tokens"):
        reference_logp(model, data, n_forget)


def test_passes_cover_every_forget_row_once():
    data, n_forget = forget_first(blocks(), FORGET)
    hook = UnlearnObjective(UnlearnSettings(method="ga", forget_batch=2), data, n_forget, seed=0)
    assert hook.per_pass == 3
    first = torch.cat([hook.draw_rows(s, len(data)) for s in range(3)])
    second = torch.cat([hook.draw_rows(s, len(data)) for s in range(3, 6)])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(n_forget))
    assert first.tolist() != second.tolist()  # a new order each pass


def test_a_runs_identity_holds_only_what_its_method_reads():
    """ga reads no retain rows, retain weight or beta; gdiff no beta; npo all; each reads lr and passes."""
    def same(method, **change):
        before, after = UnlearnSettings(method=method), UnlearnSettings(method=method, **change)
        return before.identity() == after.identity()

    for unread in ({"retain_batch": 2}, {"retain_weight": 0.5}, {"beta": 0.3}):
        assert same("ga", **unread)
    assert same("gdiff", beta=0.3)
    assert not same("gdiff", retain_batch=2) and not same("gdiff", retain_weight=0.5)
    assert not any(same("npo", **c) for c in ({"beta": 0.3}, {"retain_batch": 2}, {"retain_weight": 0.5}))
    assert not any(same(m, lr=1e-3) or same(m, passes=2) or same(m, forget_batch=2) for m in ("ga", "gdiff"))


def test_bad_settings_and_rows_are_refused():
    data, n_forget = forget_first(blocks(), FORGET)
    with pytest.raises(ConfigError, match=r"^unlearn\.method='dpo': choose one of ga, gdiff, npo"):
        UnlearnSettings(method="dpo").validate()
    with pytest.raises(ConfigError, match=r"^unlearn\.retain_batch=0: npo trains on retain rows"):
        UnlearnSettings(retain_batch=0).check_method()
    with pytest.raises(ConfigError, match=r"^forget="):
        forget_first(blocks(), [1, 1])
    with pytest.raises(ConfigError, match="leaves no row to retain"):
        UnlearnObjective(UnlearnSettings(), *forget_first(blocks(n=4), [0, 1, 2, 3]))
    t, _ = trainer("npo", data, n_forget)
    t.gradient_hook.ref = None
    with pytest.raises(ConfigError, match=r"^reference=None: npo needs"):
        t.fit()


def _grid_rank(rank, world, method):
    import axonn

    grid = axonn.ProcessGrid(1, 1, 2, 1)
    data, n_forget = forget_first(blocks(), FORGET)
    t, _ = trainer(method, data, n_forget, grad_accum=1, steps=3, model=axonn.parallelize(tiny_model(), grid),
                   grid=grid)
    return [{k: h[k] for k in ("loss", "forget_loss", "retain_loss")} for h in t.fit()]


@pytest.mark.distributed
def test_two_ranks_unlearn_as_one():
    """At 1,1,2,1 (weights and rows split over Z) three npo steps log the serial run's forget and retain
    losses: every rank weighs its own rows, and the reference is scored on the grid."""
    data, n_forget = forget_first(blocks(), FORGET)
    t, _ = trainer("npo", data, n_forget, grad_accum=1, steps=3)
    serial = t.fit()
    ranks = run_distributed(_grid_rank, 2, "npo")
    assert serial[-1]["forget_loss"] > serial[0]["forget_loss"]  # it unlearns
    for got in ranks:
        for a, b in zip(serial, got):
            for k in b:
                assert b[k] == pytest.approx(a[k], rel=1e-4), k

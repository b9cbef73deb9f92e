"""The serial trainer: loss normalisation, accumulation, determinism, schedule, metrics file."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import rows, tiny_model

from axonn.config import TrainerConfig
from axonn.hooks import GradientHook
from axonn.loop_state import lr_lambda
from axonn.sinks import JsonlSink
from axonn.trainer import IGNORE_INDEX, Trainer
from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform
from memorize_core import ConfigError


def cfg(**kw):
    base = dict(lr=1e-2, warmup_steps=2, batch_size=8, epochs=2, progress=False, seed=3)
    base.update(kw)
    return TrainerConfig(**base)


def test_loss_is_mean_over_supervised_tokens_of_the_global_batch():
    data = rows()
    model = tiny_model()
    ref = tiny_model()
    trainer = Trainer(model, cfg(epochs=1, lr=1e-9), data)
    batch = data[torch.arange(8)]
    stats = trainer.train_step(batch)
    logits = ref(input_ids=batch["input_ids"]).logits[:, :-1]
    expected = F.cross_entropy(logits.reshape(-1, 64), batch["labels"][:, 1:].reshape(-1),
                               ignore_index=IGNORE_INDEX)
    assert stats.supervised == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert stats.loss_sum / stats.supervised == pytest.approx(expected.item(), rel=1e-5)


def test_grad_accumulation_equals_one_big_batch():
    data = rows()
    h1 = Trainer(tiny_model(), cfg(grad_accum=1), data).fit()
    h2 = Trainer(tiny_model(), cfg(grad_accum=4), data).fit()
    for a, b in zip(h1, h2):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


class RecordingHook(GradientHook):
    """The default hook, recording its calls; with token_losses it gets each token's CE too."""

    def __init__(self, token_losses=False):
        self.token_losses, self.calls = token_losses, []

    def attach(self, model, optimizer, grid):
        self.calls.append("attach")

    def draw_rows(self, step, n):
        self.calls.append(f"draw_rows {step}")

    def objective(self, loss_sum, denom, token_losses, targets):
        self.calls.append("objective")
        assert (token_losses is not None) == self.token_losses
        if token_losses is not None:  # 0 where unsupervised; sums to the CE sum
            assert token_losses.shape == (targets.numel(),) and torch.allclose(token_losses.sum(), loss_sum)
        return super().objective(loss_sum, denom, token_losses, targets)

    def after_backward(self):
        self.calls.append("after_backward")

    def reduce(self, step):
        self.calls.append(f"reduce {step}")
        return False

    def metrics(self, steps):
        return {"hook_steps": steps}


@pytest.mark.parametrize("token_losses", [False, True])
def test_the_gradient_hook_is_called_in_step_order_and_the_default_changes_nothing(token_losses):
    data = rows()
    plain = Trainer(tiny_model(), cfg(grad_accum=2), data).fit()
    hook = RecordingHook(token_losses)
    hooked = Trainer(tiny_model(), cfg(grad_accum=2), data, gradient_hook=hook).fit()
    step = ["objective", "after_backward"] * 2
    assert hook.calls == ["attach", "draw_rows 0", *step, "reduce 0", "draw_rows 1", *step, "reduce 1",
                          "draw_rows 2", *step, "reduce 2", "draw_rows 3", *step, "reduce 3"]
    assert [m["hook_steps"] for m in hooked] == [1, 2, 3, 4]
    losses = [m["loss"] for m in plain], [m["loss"] for m in hooked]
    assert losses[0] == losses[1] if not token_losses else losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_same_seed_same_run_and_other_seed_other_order():
    data = rows()
    h1 = Trainer(tiny_model(), cfg(), data).fit()
    h2 = Trainer(tiny_model(), cfg(), data).fit()
    h3 = Trainer(tiny_model(), cfg(seed=4), data).fit()
    assert [m["loss"] for m in h1] == [m["loss"] for m in h2]
    assert [m["loss"] for m in h1] != [m["loss"] for m in h3]
    assert len(h1) == 4 and h1[-1]["step"] == 4 and h1[-1]["epoch"] == 2


def test_goldfish_transform_logs_dropped_loss_and_trains_less_tokens():
    data = rows(t=40)
    gf = GoldfishTransform(GoldfishConfig(enabled=True, k=2, h=3))
    h_gf = Trainer(tiny_model(), cfg(epochs=1), data, label_transform=gf).fit()
    h_std = Trainer(tiny_model(), cfg(epochs=1), data).fit()
    assert all("dropped_loss" in m and m["dropped_tokens"] > 0 for m in h_gf)
    assert all("dropped_loss" not in m for m in h_std)
    for g, s in zip(h_gf, h_std):
        assert g["supervised_tokens"] < s["supervised_tokens"]
        assert g["supervised_tokens"] + g["dropped_tokens"] == s["supervised_tokens"]


def test_warmup_then_cosine_to_min_ratio():
    assert lr_lambda(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_lambda(55, 10, 100, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_lambda(100, 10, 100, 0.1) == pytest.approx(0.1)


def test_metrics_jsonl_has_one_object_per_step(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    Trainer(tiny_model(), cfg(), rows(), sinks=[sink]).fit()
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert all({"step", "loss", "lr", "tokens"} <= set(m) for m in lines)
    assert lines[-1]["tokens"] > lines[0]["tokens"]


def test_evaluate_is_token_weighted_mean_ce():
    data = rows(n=5)
    model = tiny_model()
    trainer = Trainer(model, cfg(eval_batch_size=2), rows(), eval_data=data)
    with torch.no_grad():
        logits = model(input_ids=data.ids).logits[:, :-1]
        expected = F.cross_entropy(logits.reshape(-1, 64), data.labels[:, 1:].reshape(-1),
                                   ignore_index=IGNORE_INDEX)
    assert trainer.evaluate() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("kw,field", [
    ({"lr": 0.0}, "trainer.lr"), ({"grad_accum": 3}, "trainer.grad_accum"),
    ({"precision": "fp8"}, "trainer.precision"), ({"epochs": 0}, "trainer.epochs"),
])
def test_bad_trainer_config(kw, field):
    with pytest.raises(ConfigError, match=field):
        Trainer(tiny_model(), cfg(**kw), rows())


def test_adamw_is_torch_fused_kernel_and_steps_as_plain_pytorch():
    """The trainer's optimizer is torch's fused AdamW (what the single-GPU stacks use: one kernel
    per step, not ~10 per parameter) wherever it runs, and one step moves the weights as plain
    PyTorch's loop with fused AdamW and clipping does."""
    from axonn.trainer import adamw_kernel

    data = rows(n=8)
    t = Trainer(tiny_model(), cfg(warmup_steps=0, grad_clip=0.5, lr=1e-2), data)
    assert t.optimizer.defaults["fused"] is True
    assert adamw_kernel([torch.empty(2, device="meta")]) == {}  # a device without the kernel
    plain = tiny_model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    batch = data[torch.arange(8)]
    t.train_step(batch)
    logits = plain(input_ids=batch["input_ids"]).logits[:, :-1]
    tgt = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=IGNORE_INDEX)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    opt.step()
    for (name, a), b in zip(t.model.named_parameters(), plain.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name

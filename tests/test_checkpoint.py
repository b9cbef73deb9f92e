"""Checkpoints: exact serial resume, atomic layout, rotation, checksums, non-finite guard."""
from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import CHECKPOINT_STEPS, checkpoint_config, checkpoint_trainer, rows, tiny_model

from axonn import checkpoint
from axonn.trainer import NonFiniteError, Trainer
from memorize_core import ConfigError


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Killed(Exception):
    pass


class _KillAt:
    """on_step_end hook that stops the run like a kill would (after the step, before any later save)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, metrics):
        if metrics["step"] == self.step:
            raise _Killed


def test_resume_is_bit_identical_serial(tmp_path):
    straight = checkpoint_trainer()
    ref = [m["loss"] for m in straight.fit()]
    killed = checkpoint_trainer(tmp_path, checkpoint_every=3)
    killed.callbacks.append(_KillAt(4))
    with pytest.raises(_Killed):
        killed.fit()
    assert [m["loss"] for m in killed.state.history] == ref[:4]
    resumed = checkpoint_trainer()
    resumed.load_checkpoint(checkpoint.latest_complete(tmp_path))
    assert resumed.state.step == 3
    assert [m["loss"] for m in resumed.fit()] == ref[3:]
    got, want = _weights(resumed.model), _weights(straight.model)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_fit_checkpoints_rotate_and_are_sealed(tmp_path):
    t = checkpoint_trainer(tmp_path, checkpoint_every=2, keep_last=2)
    t.fit()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-00000004", "step-00000006"]
    for p in tmp_path.iterdir():
        assert (p / "COMPLETE").is_file() and not list(p.glob("*.part"))
        meta = json.loads((p / "meta.json").read_text())
        assert meta["grid"] == [1, 1, 1, 1] and meta["model_config"]["vocab_size"] == 64
    assert checkpoint.latest_complete(tmp_path).name == "step-00000006"


def test_unsealed_and_corrupt_checkpoints(tmp_path):
    t = checkpoint_trainer(tmp_path, checkpoint_every=3, keep_last=0)
    t.fit()
    last = checkpoint.latest_complete(tmp_path)
    (last / "COMPLETE").unlink()  # as if killed before the marker
    assert checkpoint.latest_complete(tmp_path).name == "step-00000003"
    with pytest.raises(ConfigError, match="incomplete checkpoint"):
        checkpoint.read_meta(last)
    good = tmp_path / "step-00000003"
    shard = good / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="rank-00000.safetensors fails its sha256 check"):
        checkpoint_trainer().load_checkpoint(good)
    shard.write_bytes(bytes(data[:100]))  # truncated
    with pytest.raises(ConfigError, match="sha256"):
        checkpoint_trainer().load_checkpoint(good)


def test_wrong_model_is_refused(tmp_path):
    checkpoint_trainer(tmp_path, checkpoint_every=6).fit()
    other = Trainer(tiny_model(vocab=96), checkpoint_config(), rows(n=12))
    with pytest.raises(ConfigError, match="does not fit this model"):
        other.load_checkpoint(checkpoint.latest_complete(tmp_path))


class _Poison:
    """Labels transform that makes the loss NaN on chosen steps by corrupting a weight."""

    def __init__(self, model, bad_calls):
        self.model, self.bad, self.calls = model, set(bad_calls), 0

    def __call__(self, batch):
        self.calls += 1
        w = self.model.model.norm.weight
        if self.calls in self.bad:
            if not hasattr(self, "_saved"):
                self._saved = w.detach().clone()
            w.data.fill_(float("nan"))
        elif hasattr(self, "_saved"):
            w.data.copy_(self._saved)
            del self._saved
        return batch["labels"]


def test_non_finite_steps_are_skipped_and_counted():
    model = tiny_model()
    t = Trainer(model, checkpoint_config(), rows(n=12), label_transform=_Poison(model, {2, 3}))
    hist = t.fit()
    assert [m.get("skipped_steps", 0) for m in hist] == [0, 1, 2, 2, 2, 2]
    assert math.isnan(hist[1]["loss"]) and math.isfinite(hist[-1]["loss"])
    assert t.scheduler.last_epoch == CHECKPOINT_STEPS - 2  # no schedule step for skipped steps
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_consecutive_non_finite_steps_abort_and_no_nan_checkpoint(tmp_path):
    model = tiny_model()
    t = Trainer(model, checkpoint_config(max_bad_steps=2), rows(n=12),
                label_transform=_Poison(model, {2, 3, 4}))
    with pytest.raises(NonFiniteError, match=r"trainer.max_bad_steps=2: 2 consecutive steps"):
        t.fit()
    model.model.norm.weight.data.fill_(float("nan"))
    with pytest.raises(checkpoint.NonFiniteCheckpointError, match="not written"):
        t.save_checkpoint(tmp_path)
    assert not any(tmp_path.iterdir())

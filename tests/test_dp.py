"""DP-SGD through Opacus (trainer.dp.clipping=per_sample) and the settings both clippings share: the plain
step without noise or clipping, per-row clipping checked by hand, Opacus' own accountant,
data-parallel == serial (ghost, the default), goldfish composes, bad input refused. Ghost clipping on
every grid: tests/test_dp_ghost.py."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from axonn.config import build
from axonn.spawn import run_distributed
from axonn.trainer import IGNORE_INDEX, Trainer
from memorization.config import DPConfig, RunTrainerConfig
from memorization.mitigations.dp_sgd import OpacusPrivacy, check_dp_grid
from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform
from memorize_core import ConfigError

V = 64
RUN = {"name": "dp", "seed": 0,
       "data": {"corpus": "wiki-leads", "limit": 16, "vocab_size": 300, "block_len": 32, "min_tokens": 32,
                "held_out": ""},
       "model": {"name": "tiny", "overrides": {"hidden_size": 32, "intermediate_size": 64,
                                               "num_hidden_layers": 2, "num_attention_heads": 4,
                                               "num_key_value_heads": 4}},
       "trainer": {"batch_size": 4, "max_steps": 3, "lr": 1e-2, "warmup_steps": 1, "progress": False,
                   "device": "cpu", "dp": {"enabled": True, "noise_multiplier": 1.0, "delta": 1e-3}},
       "eval": {"extraction": False}, "wandb": {"mode": "disabled"}}


class Rows:
    """A minimal RowDataset."""

    def __init__(self, ids, labels):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        return {"input_ids": self.ids[idx], "labels": self.labels[idx]}


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True))


def rows(n=16, t=16, pad=True):
    ids = torch.randint(0, V, (n, t), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    if pad:  # rows with different supervised counts, and one with none
        labels[1, -6:] = labels[2, -3:] = IGNORE_INDEX
        labels[3] = IGNORE_INDEX
    return Rows(ids, labels)


def tcfg(dp=None, **kw):
    base = {"lr": 1e-2, "warmup_steps": 0, "batch_size": 8, "max_steps": 2, "grad_clip": 0.0,
            "progress": False, "seed": 3}
    return RunTrainerConfig(**{**base, **kw}, dp=DPConfig(**dp) if dp is not None else DPConfig())


def dp_trainer(data, dp, transform=None, **kw):
    cfg = tcfg({"enabled": True, "delta": 1e-3, "poisson_sampling": False, **dp}, **kw)
    return Trainer(tiny_model(), cfg, data, label_transform=transform,
                   gradient_hook=OpacusPrivacy(cfg, len(data)))


def step_grads(trainer, batch):
    """The gradients the optimizer steps with (after DP's clipping and noise)."""
    seen = []
    hook = trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.extend(p.grad.clone() for p in trainer.model.parameters()))
    trainer.train_step(batch)
    hook.remove()
    return seen


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_dp_step_without_noise_or_clipping_equals_the_plain_step(grad_accum):
    data = rows(pad=False)  # every row equally supervised: per-row means weigh rows as the token mean does
    batch = data[torch.arange(8)]
    plain = step_grads(Trainer(tiny_model(), tcfg(grad_accum=grad_accum), data), batch)
    no_noise_no_clip = {"noise_multiplier": 0.0, "max_grad_norm": 1e9}
    dp = step_grads(dp_trainer(data, no_noise_no_clip, grad_accum=grad_accum), batch)
    assert len(plain) == len(dp)
    for a, b in zip(plain, dp):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def _row_grads(labels, batch):
    """Each row's gradient of its own mean CE over its supervised tokens, one plain backward per row."""
    out = []
    for i in range(len(labels)):
        model = tiny_model()
        logits = model(input_ids=batch["input_ids"][i:i + 1]).logits[:, :-1]
        target = labels[i:i + 1, 1:].reshape(-1)
        if (target != IGNORE_INDEX).any():
            F.cross_entropy(logits.reshape(-1, V), target, ignore_index=IGNORE_INDEX).backward()
        out.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("goldfish,grad_accum", [(False, 1), (True, 2)])
def test_per_row_gradients_are_clipped_to_max_grad_norm(goldfish, grad_accum):
    """Opacus' per-sample gradients equal per-row backward passes; the step is sum_i g_i min(1, C/|g_i|)/B."""
    data = rows()
    batch = data[torch.arange(8)]
    transform = GoldfishTransform(GoldfishConfig(enabled=True, k=2, h=3)) if goldfish else None
    labels = transform(batch) if goldfish else batch["labels"]
    ref = _row_grads(labels, batch)
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in r)) for r in ref])
    c = float(norms[norms > 0].median())  # some rows clipped, some not
    trainer = dp_trainer(data, {"noise_multiplier": 0.0, "max_grad_norm": c}, transform=transform,
                         grad_accum=grad_accum)
    opt, calls = trainer.gradient_hook._optimizer, []
    clip = opt.clip_and_accumulate

    def spy():  # once per micro-batch
        calls.append([g.clone() for g in opt.grad_samples])
        clip()

    opt.clip_and_accumulate = spy
    got = step_grads(trainer, batch)
    index = {id(p): j for j, p in enumerate(trainer.model.parameters())}
    assert len(calls) == grad_accum
    for j, p in enumerate(opt.params):  # Opacus' per-sample gradients, parameter by parameter
        got_rows = torch.cat([call[j] for call in calls])
        expected = torch.stack([r[index[id(p)]] for r in ref])
        torch.testing.assert_close(got_rows, expected, rtol=1e-4, atol=1e-6)
    factors = (c / (norms + 1e-6)).clamp(max=1.0)
    assert (factors * norms <= c * (1 + 1e-6)).all()  # every clipped row's norm is within C
    assert (factors < 1).any() and (factors[norms > 0] == 1).any()
    assert norms[3] == 0  # the unsupervised row adds nothing
    for j, g in enumerate(got):
        expected = sum(f * r[j] for f, r in zip(factors, ref)) / 8
        torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-7)
    total = torch.sqrt(sum((g ** 2).sum() for g in got))
    assert total <= c * (1 + 1e-5)  # a mean of vectors of norm <= C


def test_noise_is_seeded_per_step_and_an_empty_poisson_batch_is_pure_noise():
    data = rows()
    trainer = dp_trainer(data, {"noise_multiplier": 1.0, "max_grad_norm": 0.5, "poisson_sampling": True})
    pad_rows, empty = trainer._padded(torch.zeros(0, dtype=torch.long))
    assert pad_rows.tolist() == [0]  # the hook is told the padding row is row 0
    # an empty draw: one unsupervised row per batch shard (serial: one), not a whole micro-batch
    assert len(empty["labels"]) == trainer.grid.batch_shards == 1
    assert (empty["labels"] == IGNORE_INDEX).all()
    _, nine = trainer._padded(torch.arange(9))  # 9 rows at batch_size 8: 9 rows of compute, not 16
    assert len(nine["labels"]) == 9 and torch.equal(nine["input_ids"], data[torch.arange(9)]["input_ids"])
    a = step_grads(trainer, empty)
    b = step_grads(dp_trainer(data, {"noise_multiplier": 1.0, "max_grad_norm": 0.5}), empty)
    for x, y in zip(a, b):  # noise only: std sigma C / B per coordinate, identical for the same seed/step
        assert torch.equal(x, y)
    flat = torch.cat([x.reshape(-1) for x in a])
    assert flat.std().item() == pytest.approx(1.0 * 0.5 / 8, rel=0.1)
    # Poisson, q = 8/16
    drawn, again, other = (trainer.gradient_hook.draw_rows(step, 1000) for step in (0, 0, 1))
    assert torch.equal(drawn, again) and not torch.equal(drawn, other) and 400 < len(drawn) < 600


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_matches_opacus_privacy_engine_on_the_same_schedule(accountant):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    n, bs, sigma, steps, delta = 40, 8, 0.9, 7, 1e-3
    engine = PrivacyEngine(accountant=accountant)
    model = torch.nn.Linear(3, 1)
    loader = DataLoader(TensorDataset(torch.randn(n, 3), torch.randn(n, 1)), batch_size=bs)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = engine.make_private(module=model, optimizer=sgd, data_loader=loader,
                                             noise_multiplier=sigma, max_grad_norm=1.0)
    done = 0
    while done < steps:
        for x, y in loader:
            (model(x) - y).pow(2).sum().backward()  # sum: defined for an empty Poisson batch too
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                break
    dp = {"enabled": True, "noise_multiplier": sigma, "delta": delta, "accountant": accountant}
    ours = OpacusPrivacy(tcfg(dp, batch_size=bs, max_steps=steps), n)
    assert ours.sample_rate == pytest.approx(1 / len(loader))
    assert ours.epsilon(steps) == pytest.approx(engine.get_epsilon(delta), rel=1e-9)
    assert 0 == ours.epsilon(0) < ours.epsilon(1) < ours.epsilon(steps)


def test_target_epsilon_is_met_after_the_planned_steps():
    dp = {"enabled": True, "target_epsilon": 3.0, "delta": 1e-3}
    priv = OpacusPrivacy(tcfg(dp, batch_size=8, max_steps=0, epochs=2), 40)
    assert priv.planned_steps == 10 and priv.noise_multiplier > 0
    assert 3.0 - 0.011 <= priv.epsilon(10) <= 3.0


def test_resume_under_dp_is_exact(tmp_path):
    """Batches and noise are seeded by (seed, step), epsilon is a function of the step: nothing to save."""
    data = rows()
    cfg = tcfg({"enabled": True, "noise_multiplier": 1.0, "delta": 1e-3}, max_steps=4, batch_size=4,
               checkpoint_every=2, keep_last=0)
    whole = Trainer(tiny_model(), cfg, data, gradient_hook=OpacusPrivacy(cfg, len(data)),
                    checkpoint_dir=tmp_path)
    history = whole.fit()
    resumed = Trainer(tiny_model(seed=5), cfg, data, gradient_hook=OpacusPrivacy(cfg, len(data)))
    resumed.load_checkpoint(tmp_path / "step-00000002")
    resumed.fit()
    assert [m["loss"] for m in resumed.state.history] == [m["loss"] for m in history[2:]]
    assert [m["epsilon"] for m in resumed.state.history] == [m["epsilon"] for m in history[2:]]
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_non_dp_path_is_unchanged():
    data = rows()
    h1 = Trainer(tiny_model(), tcfg(max_steps=3), data).fit()
    h2 = Trainer(tiny_model(), tcfg({"enabled": False, "noise_multiplier": 1.0}, max_steps=3), data).fit()
    assert [m["loss"] for m in h1] == [m["loss"] for m in h2]
    assert all("epsilon" not in m for m in h1 + h2)
    with pytest.raises(ConfigError, match=r"^trainer\.dp\.enabled=True: DP-SGD needs a privacy plug-in"):
        Trainer(tiny_model(), tcfg({"enabled": True, "noise_multiplier": 1.0}), data)


def _run_cfg(**trainer_dp):
    from memorization.config import RunConfig

    cfg = copy.deepcopy(RUN)
    cfg["trainer"]["dp"].update(trainer_dp)
    return build(RunConfig, cfg)


def test_goldfish_and_dp_run_end_to_end_with_epsilon_in_metrics_and_summary(tmp_path):
    from memorization.train.pipeline import run_training

    cfg = _run_cfg()
    cfg.goldfish = build(GoldfishConfig, {"enabled": True, "k": 2, "h": 4})
    summary = run_training(cfg, tmp_path / "g", progress=False)
    lines = [json.loads(x) for x in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    eps = [m["epsilon"] for m in lines]
    assert len(lines) == 3 and eps == sorted(set(eps)) and eps[0] > 0
    assert all(m["delta"] == 1e-3 and m["dropped_tokens"] > 0 for m in lines)
    assert summary["epsilon"] == eps[-1] and summary["delta"] == 1e-3 and summary["loss"] == "goldfish"
    saved = json.loads((tmp_path / "g" / "run.json").read_text())["summary"]
    assert saved["epsilon"] == eps[-1] and saved["noise_multiplier"] == 1.0 and saved["sample_rate"] == 0.25


@pytest.mark.parametrize("override,field", [
    ({"target_epsilon": 0.0, "noise_multiplier": None}, r"trainer\.dp\.target_epsilon=0\.0"),
    ({"target_epsilon": -1.0, "noise_multiplier": None}, r"trainer\.dp\.target_epsilon=-1\.0"),
    ({"delta": 1.0}, r"trainer\.dp\.delta=1\.0"),
    ({"target_epsilon": 8.0}, r"trainer\.dp\.noise_multiplier=1\.0: both"),
    ({"noise_multiplier": None}, r"trainer\.dp\.noise_multiplier=None: neither"),
    ({"accountant": "moments"}, r"trainer\.dp\.accountant='moments'"),
    ({"max_grad_norm": 0.0}, r"trainer\.dp\.max_grad_norm=0\.0"),
    ({"max_grad_norm": float("inf")}, r"trainer\.dp\.max_grad_norm=inf"),
    ({"max_grad_norm": float("nan")}, r"trainer\.dp\.max_grad_norm=nan"),
    ({"clipping": "fast"}, r"trainer\.dp\.clipping='fast': choose one of ghost, per_sample"),
])
def test_bad_dp_settings_name_the_field(override, field):
    with pytest.raises(ConfigError, match="^" + field) as e:
        _run_cfg(**override)
    assert len(str(e.value).splitlines()) == 1


def test_delta_above_one_over_n_and_per_sample_tensor_grids_are_refused_before_anything_is_written(
        tmp_path, capsys):
    import yaml

    from memorization.cli import main
    from memorization.train.pipeline import run_training

    with pytest.raises(ConfigError, match=r"^trainer\.dp\.delta=0\.1: must be < 1/N = 0\.0625 for N=16"):
        run_training(_run_cfg(delta=0.1), tmp_path / "o", progress=False)
    for grid in ("2,1,1,1", "1,1,2,1"):  # Opacus' per-sample gradients need whole layers
        cfg = _run_cfg(clipping="per_sample")
        cfg.grid = grid
        refusal = (r"^trainer\.dp\.clipping='per_sample': Opacus' per-sample gradients run serial or "
                   r"data-parallel \(grid 1,1,1,D\).*trainer\.dp\.clipping=ghost.*1,1,1,2")
        with pytest.raises(ConfigError, match=refusal):
            run_training(cfg, tmp_path / "o", progress=False)
    check_dp_grid(DPConfig(enabled=True, clipping="per_sample"), (1, 1, 1, 4))  # data-parallel is fine
    check_dp_grid(DPConfig(enabled=True), (2, 2, 2, 1))  # ghost clipping: any grid
    with pytest.raises(ConfigError, match=r"^trainer\.dp\.secure_rng=True: ghost clipping on 2 ranks"):
        check_dp_grid(DPConfig(enabled=True, secure_rng=True), (1, 2, 1, 1))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(RUN))
    capsys.readouterr()
    assert main(["train", str(path), "--out", str(tmp_path / "o"), "trainer.dp.target_epsilon=-2",
                 "trainer.dp.noise_multiplier=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.dp.target_epsilon=-2.0" in err[0]
    assert not (tmp_path / "o").exists()


def test_dp_and_another_objective_are_refused_together_before_anything_is_written(tmp_path):
    """start_run takes one objective: DP-SGD's (the config's) or the caller's gradient hook, not both."""
    from axonn.hooks import GradientHook
    from memorization.train.pipeline import start_run
    from memorization.train.prepare import prepare_data

    cfg = _run_cfg()
    with pytest.raises(ConfigError, match=r"^trainer\.dp\.enabled=True: this run trains with its own"):
        start_run(cfg, tmp_path / "o", prepare_data(cfg), gradient_hook=GradientHook(), progress=False)
    assert not (tmp_path / "o").exists()


def _dp_rank(rank, world, out):
    import axonn
    from memorization.train.pipeline import run_training

    run_training(_run_cfg(), out, grid=axonn.ProcessGrid(1, 1, 1, 2), progress=False)


@pytest.mark.distributed
def test_data_parallel_dp_equals_serial_dp_with_noise(tmp_path):
    from safetensors.torch import load_file

    from memorization.train.pipeline import run_training

    run_training(_run_cfg(), tmp_path / "serial", progress=False)
    run_distributed(_dp_rank, 2, str(tmp_path / "dp"), timeout=240)
    runs = {k: [json.loads(x) for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
            for k in ("serial", "dp")}
    assert len(runs["dp"]) == 3
    for a, b in zip(runs["serial"], runs["dp"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["epsilon"] == a["epsilon"]
        assert b["tokens"] == a["tokens"]  # the same Poisson rows
    a, b = (load_file(str(tmp_path / k / "model" / "model.safetensors")) for k in ("serial", "dp"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    summary = json.loads((tmp_path / "dp" / "run.json").read_text())["summary"]
    assert summary["grid"] == "1,1,1,2" and summary["epsilon"] == runs["serial"][-1]["epsilon"]


def test_the_engine_never_names_privacy():
    """DP-SGD is the research layer's gradient hook: axonn/ never says privacy, dp or opacus."""
    import re
    from pathlib import Path

    pattern = re.compile(r"privacy|\bdp\b|dp_|opacus", re.IGNORECASE)
    root = Path(__file__).resolve().parents[1] / "axonn"
    hits = [f"{f.relative_to(root.parent)}:{i}" for f in sorted(root.rglob("*.py"))
            for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits

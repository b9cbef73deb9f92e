"""DP-SGD with ghost clipping (memorization/mitigations/ghost_clipping.py, axonn/layers/per_example.py):
per-row norms equal per-row backward passes and Opacus' per-sample clipping, the update equals Opacus' on
the same rows, every grid equals the serial run, noise lands once per coordinate, bad input is refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import Rows
from transformers import LlamaConfig, LlamaForCausalLM

from axonn.spawn import run_distributed
from axonn.trainer import IGNORE_INDEX, Trainer
from memorization.config import DPConfig, RunTrainerConfig
from memorization.mitigations.dp_sgd import OpacusPrivacy
from memorization.mitigations.ghost_clipping import GhostPrivacy
from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform

V = 64



def tiny_model(seed=0, vocab=V, hidden=32, tie=True):
    """A seeded 2-layer fp64 Llama with tied embeddings (the LM head shares the table)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tie)).double()


def rows(n=16, t=16):
    """Seeded rows; rows 1 and 2 end in ignored labels, row 3 has none supervised (a padded row)."""
    ids = torch.randint(0, V, (n, t), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, -6:] = labels[2, -3:] = IGNORE_INDEX
    labels[3] = IGNORE_INDEX
    return Rows(ids, labels)


def tcfg(**dp):
    base = {"enabled": True, "delta": 1e-3, "poisson_sampling": False, "noise_multiplier": 0.0}
    return RunTrainerConfig(lr=1e-2, warmup_steps=0, batch_size=8, max_steps=2, grad_clip=0.0, progress=False,
                            seed=3, dp=DPConfig(**{**base, **dp}))


def row_norms(labels, ids):
    """Each row's gradient norm of its own mean CE, one plain backward per row (fp64)."""
    out = []
    for i in range(len(labels)):
        model = tiny_model()
        logits = model(input_ids=ids[i:i + 1]).logits[:, :-1]
        target = labels[i:i + 1, 1:].reshape(-1)
        if not (target != IGNORE_INDEX).any():
            out.append(0.0)
            continue
        F.cross_entropy(logits.reshape(-1, V), target, ignore_index=IGNORE_INDEX).backward()
        out.append(float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))))
    return torch.tensor(out, dtype=torch.float64)


def stepped(hook_cls, cfg, data, batch, transform=None):
    """(gradients the optimizer steps with, the hook) after one train_step on `batch`."""
    trainer = Trainer(tiny_model(), cfg, data, label_transform=transform,
                      gradient_hook=hook_cls(cfg, len(data)))
    seen = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.extend(p.grad.clone() for p in trainer.model.parameters()))
    trainer.train_step(batch)
    return seen, trainer.gradient_hook


@pytest.mark.parametrize("goldfish,grad_accum", [(False, 1), (True, 2)])
def test_ghost_norms_and_update_equal_per_row_backward_and_opacus_per_sample(goldfish, grad_accum):
    """Ghost norms == per-row backward norms (1e-6, fp64; tied embeddings, a padded row, goldfish -100
    labels); the clipped update == Opacus' per-sample clipping on the same rows (1e-6)."""
    data = rows()
    batch = data[torch.arange(8)]
    transform = GoldfishTransform(GoldfishConfig(enabled=True, k=2, h=3)) if goldfish else None
    labels = transform(batch) if goldfish else batch["labels"]
    ref = row_norms(labels, batch["input_ids"])
    assert ref[3] == 0
    c = float(ref[ref > 0].median())  # clipping bites on half the rows
    cfg = tcfg(max_grad_norm=c)
    cfg.grad_accum = grad_accum
    ghost, hook = stepped(GhostPrivacy, cfg, data, batch, transform)
    per_sample, _ = stepped(OpacusPrivacy, cfg, data, batch, transform)
    micro = 8 // grad_accum
    torch.testing.assert_close(hook.last_norms, ref[-micro:], rtol=1e-6, atol=1e-9)
    assert len(ghost) == len(per_sample)
    scale = max(float(g.abs().max()) for g in per_sample)
    for a, b in zip(ghost, per_sample):  # within 1e-6 of the largest entry (Opacus clips in fp32)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("path", ["direct", "gram"])
def test_either_way_of_forming_a_linears_norm_gives_per_row_backward_norms(monkeypatch, path):
    """Every Linear's norm formed as G^T A, or every one from Gram matrices (the cached A A^T of q, k, v
    and gate, up included): both give the per-row backward norms, whichever the rule would pick."""
    import axonn.layers.per_example as per_example

    monkeypatch.setattr(per_example, "direct_norm", lambda *a, **k: path == "direct")
    data = rows()
    batch = data[torch.arange(8)]
    ref = row_norms(batch["labels"], batch["input_ids"])
    _, hook = stepped(GhostPrivacy, tcfg(max_grad_norm=float(ref[ref > 0].median())), data, batch)
    torch.testing.assert_close(hook.last_norms, ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("seq,out,inp,held,direct", [
    (16, 32, 32, False, False),  # the tiny test model's q: T^2 (2 + 1/32) x 32 < 17 x 1024 multiply-adds
    (2048, 2048, 2048, False, True),  # llama-1b's q at T = 2,048: T * in * out is half of T^2 * (in + out)
    (1024, 1024, 2048, True, False),  # beside a held A A^T: T^2 * out is half of T * in * out
    (512, 576, 576, False, True),  # SmolLM2's q at T = 512: block 1.3 T^2, 0.56x the multiply-adds
    (512, 1536, 576, False, False),  # its gate: a block of 3.4 T^2, more than the Gram pair: Grams
    (64, 16, 576, False, False),  # a LoRA A [16, 576] at T = 64: a block just over 2 T^2
    (64, 576, 576, False, False),  # SmolLM2's q at T = 64
    (512, 49152, 576, False, False),  # a head's block is 54x the Gram pair: Grams, whatever flops say
    (512, 16, 16, True, True),  # the Gram pair would be 2,048x the [16, 16] block: directly
])
def test_the_choice_of_path_by_flops_where_both_fit(seq, out, inp, held, direct):
    from axonn.plan.compute import direct_norm

    assert direct_norm(seq, out, inp, input_gram=held) is direct


def test_the_planner_prices_the_paths_the_kernel_takes(monkeypatch):
    """A GQA Llama at T = 24 where the cache decides (k and v: G^T A, as nothing is cached when the
    backward reaches them; q: Grams): the norm pass's own choices, in the order its hooks run, equal
    axonn.plan.compute.norm_paths for the same shape (a forward-order walk priced k and v as cached
    Grams)."""
    import axonn.layers.per_example as per_example
    from axonn.plan.compute import norm_paths
    from axonn.plan.shapes import shape_from_config
    from axonn.plan.volumes import Grid

    seen = []
    rule = per_example.direct_norm

    def recorded(seq, out, inp, input_gram):
        seen.append((out, inp, input_gram, rule(seq, out, inp, input_gram)))
        return seen[-1][-1]

    monkeypatch.setattr(per_example, "direct_norm", recorded)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96,
                                         num_hidden_layers=1, num_attention_heads=6,
                                         num_key_value_heads=2)).double()
    ids = torch.randint(0, V, (8, 24), generator=torch.Generator().manual_seed(0))
    cfg = tcfg(max_grad_norm=1.0)
    trainer = Trainer(model, cfg, Rows(ids), gradient_hook=GhostPrivacy(cfg, 8))
    trainer.train_step(Rows(ids)[torch.arange(8)])
    planned = norm_paths(shape_from_config(model.config.to_dict()), Grid(1, 1, 1, 1), 24)
    block = seen[1:1 + len(planned)]  # the LM head's first, then the block's, last Linear first
    assert [(o, i, c, d) for (_, o, i), c, d in planned] == block
    assert [d for *_, d in block] == [False, False, False, False, True, True, False]  # down..o, v, k, q


def _steps(model, cfg, data, grid=None, steps=2):
    """Train `steps` fixed batches of 8 rows; (per step: this rank's rows' norms), the trainer."""
    hook = GhostPrivacy(cfg, len(data), grid=grid)
    trainer = Trainer(model, cfg, data, grid=grid, gradient_hook=hook)
    norms = []
    for step in range(steps):
        trainer.train_step(data[torch.arange(8 * step, 8 * step + 8)])
        trainer.state.step += 1
        norms.append(hook.last_norms.clone())
    return norms, trainer


def _grid_rank(rank, world, dims, mode, c):
    import axonn

    grid = axonn.ProcessGrid(*dims)
    model = axonn.parallelize(tiny_model(), grid, mode=mode)
    norms, _ = _steps(model, tcfg(max_grad_norm=c), rows(), grid=grid)
    full = {k: v.tolist() for k, v in axonn.full_state_dict(model).items()}  # plain values: no shared fds
    return {"shard": grid.batch_shard_index, "norms": [n.tolist() for n in norms],
            "state": full if rank == 0 else None}


GRIDS = [((2, 1, 1, 1), "easy"), ((1, 2, 1, 1), "paired"), ((1, 1, 2, 1), "easy"), ((2, 2, 2, 1), "paired"),
         ((1, 2, 1, 2), "easy")]


@pytest.mark.distributed
@pytest.mark.parametrize("dims,mode", GRIDS, ids=[",".join(map(str, g)) for g, _ in GRIDS])
def test_ghost_dp_on_a_grid_equals_serial(dims, mode):
    """sigma = 0, a clip norm that bites: every rank's row norms equal the serial ones (1e-6) and the
    parameters after two steps equal the serial run's (1e-6), vocab-parallel head tied to the table,
    padded rows, column/row (paired) and easy layers, Z and data batch shards."""
    c = 0.5 * float(row_norms(rows().labels[:8], rows().ids[:8]).median())
    serial_norms, trainer = _steps(tiny_model(), tcfg(max_grad_norm=c), rows())
    want = trainer.model.state_dict()
    world = dims[0] * dims[1] * dims[2] * dims[3]
    per_rank = run_distributed(_grid_rank, world, dims, mode, c, timeout=300)
    shards = dims[2] * dims[3]
    for r in per_rank:
        for step, got in enumerate(r["norms"]):
            n = 8 // shards
            want_norms = serial_norms[step].view(shards, n)[r["shard"]]
            got = torch.tensor(got, dtype=torch.float64)
            torch.testing.assert_close(got, want_norms, rtol=1e-6, atol=1e-9)
    for key, value in per_rank[0]["state"].items():
        torch.testing.assert_close(torch.tensor(value, dtype=torch.float64), want[key], rtol=1e-6, atol=1e-9,
                                   msg=key)


def _noise_grads(grid=None, step=5):
    """The gradient DP-SGD steps with when every row's gradient is zero: noise / B, per parameter
    (full tensors: gathered from the shards on a grid), from a 1.3M-parameter model."""
    import axonn

    model = tiny_model(vocab=8192, hidden=128)
    if grid is not None and grid.distributed:
        model = axonn.parallelize(model, grid, mode="paired")
    cfg = tcfg(noise_multiplier=2.0, max_grad_norm=0.5)
    hook = GhostPrivacy(cfg, 64, grid=grid)
    Trainer(model, cfg, rows(64), grid=grid, gradient_hook=hook)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    hook.reduce(step)
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    return (axonn.full_grad_dict(model) if grid is not None and grid.distributed else local), local, hook


def _noise_std_ok(grads, want):
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    assert flat.numel() >= 1_000_000
    assert abs(float(flat.std()) / want - 1) < 0.02 and abs(float(flat.mean())) < 0.01 * want


def test_noise_is_seeded_and_lands_once_per_coordinate_serially():
    """sigma C / B per coordinate (2% on 1.3M coordinates), the same draw for the same (seed, step)."""
    grads, _, hook = _noise_grads()
    _noise_std_ok(grads, 2.0 * 0.5 / 8)
    again, _, _ = _noise_grads()
    other, _, _ = _noise_grads(step=6)
    for key in grads:
        assert torch.equal(grads[key], again[key]) and not torch.equal(grads[key], other[key])


def _noise_rank(rank, world, dims):
    import axonn

    grid = axonn.ProcessGrid(*dims)
    full, local, hook = _noise_grads(grid)
    twice, _, _ = _noise_grads(grid)
    flat = torch.cat([g.reshape(-1) for g in full.values()])
    norm = {k: v.tolist() for k, v in local.items() if "norm" in k}  # replicated on every rank
    return {"std": float(flat.std()), "mean": float(flat.mean()), "n": flat.numel(), "norm": norm,
            "same": all(torch.equal(full[k], twice[k]) for k in full), "epsilon": hook.epsilon(40)}


@pytest.mark.distributed
@pytest.mark.parametrize("dims", [(1, 2, 1, 1), (1, 1, 2, 1)], ids=["1,2,1,1", "1,1,2,1"])
def test_noise_on_a_grid_lands_once_per_coordinate_and_epsilon_equals_serial(dims):
    """On a tensor split every coordinate of the assembled gradient gets one draw of std sigma C / B
    (2%, 1.3M coordinates; a replicated parameter holds the same draw on every rank, the rows padding
    a Z split none), reproducibly; epsilon is the serial run's."""
    _, _, serial = _noise_grads()
    per_rank = run_distributed(_noise_rank, 2, dims, timeout=300)
    want = 2.0 * 0.5 / 8
    for r in per_rank:
        assert r["n"] >= 1_000_000 and abs(r["std"] / want - 1) < 0.02 and abs(r["mean"]) < 0.01 * want
        assert r["same"] and r["epsilon"] == serial.epsilon(40)
        assert r["norm"] == per_rank[0]["norm"]


def test_activation_checkpointing_gives_the_same_norms_and_update():
    """Recomputed blocks (non-reentrant checkpointing) feed the norms the same inputs: same norms, same
    update as without (1e-9 relative, fp64)."""
    data = rows()
    batch = data[torch.arange(8)]
    out = []
    for ck in (False, True):
        cfg = tcfg(max_grad_norm=0.05)
        cfg.activation_checkpointing = ck
        out.append(stepped(GhostPrivacy, cfg, data, batch))
    (plain, hook), (ck, hook_ck) = out
    torch.testing.assert_close(hook_ck.last_norms, hook.last_norms, rtol=1e-9, atol=0)
    for a, b in zip(plain, ck):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)


def test_a_parameter_ghost_clipping_cannot_split_is_refused_in_one_line(monkeypatch):
    """Two linear layers sharing one weight (no embedding to pair with): refused by the run's check,
    naming the field, the value, the parameter and the fix."""
    from torch import nn

    from memorization.mitigations import dp_sgd as privacy
    from memorize_core import ConfigError

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

    monkeypatch.setattr(privacy, "meta_model", lambda config: Shared())
    refusal = (r"^trainer\.dp\.clipping='ghost': ghost clipping cannot split the gradient of a parameter "
               r"a\.weight is shared by Linear, Linear; use trainer\.dp\.clipping=per_sample")
    with pytest.raises(ConfigError, match=refusal) as e:
        privacy.check_dp(tcfg(), None, (1, 2, 1, 1), model_config=object())
    assert len(str(e.value).splitlines()) == 1
    privacy.check_dp(tcfg(clipping="per_sample"), None, (1, 1, 1, 1), model_config=object())  # Opacus' job


def test_the_dry_run_takes_dp_on_a_tensor_split_and_counts_the_norm_buffers(tmp_path):
    """`--dry-run --grid 1,2,1,1` with DP-SGD exits 0 (it used to refuse every tensor split) and
    rank 0's total includes the per-example norm buffers the planner's memory model prices."""
    import contextlib
    import io
    import json

    from helpers import TINY

    from memorization.cli import main

    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    argv = ["train", str(path), "--dry-run", "--world", "2", "--grid", "1,2,1,1", "--json",
            "trainer.dp.enabled=true", "trainer.dp.noise_multiplier=1.0", "trainer.dp.delta=1e-3"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    r0 = json.loads(out.getvalue())["rank0"]
    assert r0["example_norm_bytes"] > 0 and r0["fits"]
    with contextlib.redirect_stdout(io.StringIO()) as plain:
        assert main(argv[:-3]) == 0
    without = json.loads(plain.getvalue())["rank0"]
    assert abs(r0["total_bytes"] - without["total_bytes"] - r0["example_norm_bytes"]) <= 1  # int() of each


class _Squared(torch.nn.Module):
    """Output weight * x + weight^2: not weight * h(x) + bias, so its norms must come from torch.func."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x + self.weight ** 2


class _Stack(torch.nn.Module):
    """Embedding -> LayerNorm (weight and bias) -> _Squared -> RMSNorm -> linear head (q/k/v-like: two
    linears read the same input), fp64."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.Embedding(V, 16).double()
        self.ln = torch.nn.LayerNorm(16).double()
        self.sq = _Squared(16)
        self.rms = torch.nn.RMSNorm(16, eps=1e-6).double()
        self.a, self.b = torch.nn.Linear(16, 16).double(), torch.nn.Linear(16, 16).double()
        self.head = torch.nn.Linear(16, V, bias=False).double()
        with torch.no_grad():
            for m in (self.ln, self.rms):
                m.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.rms(self.sq(self.ln(self.emb(ids))))
        return self.head(torch.tanh(self.a(h)) * self.b(h))


def test_norm_layers_of_every_kind_give_per_row_backward_norms():
    """LayerNorm with a bias and RMSNorm (weight * h(x) + bias: the direct path), a module that is not
    of that form (torch.func) and two linears reading one input (their shared input Gram) each give
    the norms of per-row backward passes (fp64, 1e-10)."""
    from axonn.grid import ProcessGrid
    from axonn.layers.per_example import ExampleNorms

    ids = torch.randint(0, V, (6, 12), generator=torch.Generator().manual_seed(2))

    def losses(model):
        logits = model(ids[:, :-1])
        token = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none")
        return token.view(6, -1).mean(1)

    model = _Stack()
    norms = ExampleNorms(model, ProcessGrid.serial(), {})
    got = norms.norms(losses(model))
    assert norms._affine == {id(model.ln): True, id(model.sq): False, id(model.rms): True}
    want = []
    for i in range(6):
        model.zero_grad()
        losses(model)[i].backward()
        want.append(sum(float((p.grad ** 2).sum()) for p in model.parameters()))
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=0)

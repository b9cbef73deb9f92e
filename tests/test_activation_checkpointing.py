"""`trainer.activation_checkpointing`: per decoder block, and the losses are bit-identical to off.

Every grid of 1, 2, 4 and 8 gloo ranks (35 grids; easy and paired, tied and untied embeddings
alternating) trains 2 AdamW steps with checkpointing off and on: per-step losses
must be equal to the last bit, and with checkpointing on every decoder block's forward runs
twice per micro-batch (once more inside backward); the parameters after the last step are
bit-identical too. World 8 runs 3 grids by default and all 20
under MEMORIZE_SLOW=1 (the full sweep takes a few minutes on 2 cores).
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from axonn.spawn import run_distributed

STEPS = 2


def grids_of(world: int) -> list[tuple[int, int, int, int]]:
    """Every (x, y, z, data) of powers of two with product `world`."""
    powers = [2**i for i in range(world.bit_length())]
    return [g for g in itertools.product(powers, repeat=4) if g[0] * g[1] * g[2] * g[3] == world]


class Rows:
    """A RowDataset over fixed tensors."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, idx):
        return {"input_ids": self.ids[idx], "labels": self.ids[idx]}


def _model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32,
                      tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


def _run(grid, mode: str, tied: bool, ckpt: bool, micro_batch: int) -> dict:
    """Losses, grad norms and block-forward counts of STEPS steps."""
    import axonn
    from axonn.config import TrainerConfig
    from axonn.trainer import Trainer

    model = _model(tied)
    if grid.distributed:
        model = axonn.parallelize(model, grid, mode=mode)
    calls = [0]
    # a module inside the block: the block's own hooks stay outside the checkpoint (transformers)
    inner = model.model.layers[0].post_attention_layernorm
    inner.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))
    cfg = TrainerConfig(lr=1e-2, batch_size=16, max_steps=STEPS, warmup_steps=0, progress=False,
                        device="cpu", micro_batch=micro_batch, activation_checkpointing=ckpt)
    trainer = Trainer(model, cfg, Rows(ids), grid=grid)
    history = trainer.fit()
    return {"loss": [h["loss"] for h in history], "calls": calls[0], "accum": trainer.grad_accum,
            "params": [p.detach().clone() for p in model.parameters()]}


def _compare(rank: int, world: int, cases: list) -> list:
    import axonn

    out = []
    for i, (dims, micro_batch) in enumerate(cases):
        grid = axonn.ProcessGrid(*dims) if world > 1 else axonn.ProcessGrid.serial()
        mode, tied = ("easy", "paired")[i % 2], bool(i // 2 % 2)
        off = _run(grid, mode, tied, False, micro_batch)
        on = _run(grid, mode, tied, True, micro_batch)
        # compared here: tensors do not travel back through the result queue
        same = all(torch.equal(a, b) for a, b in zip(on.pop("params"), off.pop("params")))
        out.append((dims, mode, tied, off, on, same))
    return out


def _cases(world: int) -> list:
    grids = grids_of(world)
    if world == 8 and os.environ.get("MEMORIZE_SLOW") != "1":
        grids = [(8, 1, 1, 1), (1, 2, 2, 2), (2, 2, 2, 1)]
    # every third grid also accumulates two micro-batches (micro_batch = half a shard's rows)
    return [(g, (16 // (g[2] * g[3])) // 2 if i % 3 == 2 and 16 // (g[2] * g[3]) > 1 else 0)
            for i, g in enumerate(grids)]


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.distributed),
                                   pytest.param(4, marks=pytest.mark.distributed),
                                   pytest.param(8, marks=pytest.mark.distributed)])
def test_losses_bit_identical_with_checkpointing(world):
    cases = _cases(world)
    if world == 1:
        results = [_compare(0, 1, cases)]
    else:
        results = run_distributed(_compare, world, cases, timeout=300)
    for rank, (dims, mode, tied, off, on, same_params) in ((r, c) for r, res in enumerate(results)
                                                            for c in res):
        where = f"grid {dims} {mode} tied={tied} rank {rank}"
        assert on["loss"] == off["loss"], where
        assert same_params, where
        assert all(torch.isfinite(torch.tensor(off["loss"]))), where
        # checkpointing re-runs each block's forward once inside backward
        assert off["calls"] == STEPS * off["accum"], where
        assert on["calls"] == 2 * STEPS * on["accum"], where
    assert len(results[0]) == len(cases)


def test_unsupported_model_is_one_line_error():
    from axonn.config import TrainerConfig
    from axonn.trainer import Trainer
    from memorize_core import ConfigError

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="trainer.activation_checkpointing"):
        Trainer(model, TrainerConfig(activation_checkpointing=True, progress=False),
                Rows(torch.zeros(8, 4, dtype=torch.long)))


@pytest.mark.parametrize("kw,field", [({"micro_batch": -1}, "trainer.micro_batch"),
                                      ({"micro_batch": 2, "grad_accum": 2}, "trainer.micro_batch")])
def test_micro_batch_validation(kw, field):
    from axonn.config import TrainerConfig
    from memorize_core import ConfigError

    with pytest.raises(ConfigError, match=field):
        TrainerConfig(**kw).validate()


def test_micro_batch_is_rows_per_rank():
    from axonn.config import TrainerConfig
    from memorize_core import ConfigError

    cfg = TrainerConfig(batch_size=48, micro_batch=2)
    assert cfg.accumulation(1) == (24, 2) and cfg.accumulation(8) == (3, 2)
    assert TrainerConfig(batch_size=48, grad_accum=3).accumulation(4) == (3, 4)
    with pytest.raises(ConfigError, match="micro_batch"):
        cfg.accumulation(5)

"""The Trainer on the 4D grid: 20 optimizer steps at each acceptance grid equal the serial run.

Per-step losses (standard and goldfish) must match serial within 1e-4 relative in fp32; the model is
a tiny Llama with tied embeddings, AdamW + warmup/cosine + clipping, so this covers batch sharding,
the vocab-parallel loss, gradient sync, global-norm clipping and the goldfish transform together.
"""
from __future__ import annotations

import pytest
import torch

from axonn.grid import ProcessGrid
from axonn.spawn import run_distributed

STEPS, REL = 20, 1e-4
GRIDS = {
    1: [(1, 1, 1, 1)],
    2: [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)],
    8: [(2, 2, 2, 1), (2, 2, 1, 2), (1, 1, 8, 1)],
}


class Rows:
    """A RowDataset over fixed tensors."""

    def __init__(self, ids, labels, docs):
        self.ids, self.labels, self.docs = ids, labels, docs

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        return {"input_ids": self.ids[idx], "labels": self.labels[idx], "doc_ids": self.docs[idx]}


def _data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (32, 24), generator=g)
    labels = ids.clone()
    labels[::4, -6:] = -100  # padded tails
    docs = torch.zeros_like(ids)
    docs[:, 12:] = 1  # two documents per row: goldfish resets at the boundary
    return Rows(ids, labels, docs)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _losses(grid, goldfish: bool, mode: str = "easy", options=None, grad_accum: int = 1) -> list[float]:
    import axonn
    from axonn.config import TrainerConfig
    from axonn.trainer import Trainer
    from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform

    model = _model()
    if grid.distributed:
        model = axonn.parallelize(model, grid, mode=mode, options=options)
    cfg = TrainerConfig(lr=3e-3, warmup_steps=3, batch_size=8, max_steps=STEPS, grad_clip=0.5, seed=1,
                        progress=False, device="cpu", grad_accum=grad_accum)
    transform = GoldfishTransform(GoldfishConfig(enabled=True, k=3, h=2)) if goldfish else None
    history = Trainer(model, cfg, _data(), label_transform=transform, grid=grid).fit()
    return [m["loss"] for m in history]


def _run_grids(rank: int, world: int, mode: str) -> dict:
    import axonn

    out = {}
    for dims in GRIDS[world]:
        grid = axonn.ProcessGrid(*dims)
        out[dims] = {"standard": _losses(grid, False, mode), "goldfish": _losses(grid, True, mode)}
    return out


@pytest.fixture(scope="module")
def serial():
    torch.set_num_threads(1)
    return {"standard": _losses(ProcessGrid.serial(), False), "goldfish": _losses(ProcessGrid.serial(), True)}


def _check(serial, per_grid):
    for dims, runs in per_grid.items():
        for loss in ("standard", "goldfish"):
            got, ref = torch.tensor(runs[loss]), torch.tensor(serial[loss])
            rel = ((got - ref).abs() / ref.abs()).max().item()
            assert rel <= REL, f"grid {dims} {loss}: max relative loss difference {rel:.2e}"
    assert serial["standard"] != serial["goldfish"]
    assert serial["standard"][-1] < serial["standard"][0]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 8])
def test_trainer_steps_equal_serial_at_every_grid(serial, world):
    results = run_distributed(_run_grids, world, "easy", timeout=400)
    _check(serial, results[0])


@pytest.mark.distributed
def test_trainer_paired_mode_at_2221(serial):
    results = run_distributed(_run_grids_paired, 8, timeout=300)
    _check(serial, results[0])


def _run_grids_paired(rank: int, world: int) -> dict:
    import axonn

    grid = axonn.ProcessGrid(2, 2, 2, 1)
    return {(2, 2, 2, 1): {"standard": _losses(grid, False, "paired"),
                           "goldfish": _losses(grid, True, "paired")}}


def _run_bucketed(rank: int, world: int) -> dict:
    import axonn
    from axonn.schedule import EngineOptions

    grid = axonn.ProcessGrid(1, 1, 1, 2)
    opts = EngineOptions(bucket_grads=True, bucket_mb=0.01)  # several buckets, launched in backward
    return {(1, 1, 1, 2): {name: _losses(grid, name == "goldfish", options=opts, grad_accum=2)
                           for name in ("standard", "goldfish")}}


@pytest.mark.distributed
def test_trainer_accumulates_micro_batches_with_bucketed_gradient_all_reduce(serial):
    """Only the last micro-batch launches the backward-time all-reduces (the others run in no_sync)."""
    results = run_distributed(_run_bucketed, 2, timeout=300)
    _check(serial, results[0])

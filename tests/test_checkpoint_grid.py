"""Checkpoints on the grid: exact resume at 2,1,1,1 and resharding to 1,2,1,1 and to serial."""
from __future__ import annotations

import pytest
import torch
from helpers import CHECKPOINT_HALF, grid_trainer

from axonn.grid import ProcessGrid
from axonn.spawn import run_distributed


def _full(trainer):
    import axonn
    from axonn.state import full_state_dict

    if not axonn.is_parallel(trainer.model):
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return full_state_dict(trainer.model)


def _straight_and_resumed(rank, world, dims, root):
    """Straight 6 steps (checkpointing at 3) vs resumed from step 3: losses and weights."""
    import axonn

    grid = axonn.ProcessGrid(*dims)
    straight = grid_trainer(grid, root)
    ref = [m["loss"] for m in straight.fit()]
    resumed = grid_trainer(grid)
    resumed.load_checkpoint(f"{root}/step-{CHECKPOINT_HALF:08d}")
    later = [m["loss"] for m in resumed.fit()]
    a, b = _full(straight), _full(resumed)
    # numpy, not tensors: torch's queue would share tensor storage by fd, gone when the rank exits
    return ref, later, all(torch.equal(a[k], b[k]) for k in a), {k: v.numpy() for k, v in b.items()}


def _resume_at(rank, world, dims, path):
    import axonn

    grid = axonn.ProcessGrid(*dims)
    t = grid_trainer(grid)
    t.load_checkpoint(path)
    return [m["loss"] for m in t.fit()], {k: v.numpy() for k, v in _full(t).items()}


@pytest.mark.distributed
def test_resume_equal_and_reshard(tmp_path):
    root = str(tmp_path / "ck")
    ref, later, same, weights = run_distributed(_straight_and_resumed, 2, (2, 1, 1, 1), root, timeout=180)[0]
    assert later == ref[CHECKPOINT_HALF:] and same  # bit-identical at the same grid
    for dims in [(1, 2, 1, 1)]:
        losses, w = run_distributed(_resume_at, 2, dims, f"{root}/step-{CHECKPOINT_HALF:08d}", timeout=180)[0]
        _close(losses, ref[CHECKPOINT_HALF:])
        assert all(torch.allclose(torch.from_numpy(w[k]), torch.from_numpy(weights[k]), rtol=1e-4, atol=1e-5)
                   for k in weights)
    t = grid_trainer(ProcessGrid.serial())  # serial, in this process
    t.load_checkpoint(f"{root}/step-{CHECKPOINT_HALF:08d}")
    _close([m["loss"] for m in t.fit()], ref[CHECKPOINT_HALF:])


def _close(got, want, rel=1e-5):
    g, w = torch.tensor(got), torch.tensor(want)
    assert ((g - w).abs() / w.abs()).max().item() <= rel, (got, want)

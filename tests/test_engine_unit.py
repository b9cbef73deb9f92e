"""Single-process checks of the engine's pieces: layouts, safetensors slices, CE, stats, launch env."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import axonn
from axonn.layers.layout import ParamSpec
from axonn.state import SafetensorsSlices


def _fake_grid(x: int, y: int, z: int, coords: tuple[int, int, int]) -> SimpleNamespace:
    sizes = {"x": x, "y": y, "z": z, "data": 1}
    pos = dict(zip(("x", "y", "z"), coords), data=0)
    return SimpleNamespace(z=z, z_rank=pos["z"], size=sizes.__getitem__, coord=pos.__getitem__)


@pytest.mark.parametrize("rows,cols,x,y,z,style", [(12, 8, 2, 2, 2, "easy"), (10, 8, 2, 1, 4, "easy"),
                                                   (6, 4, 1, 3, 4, "easy"), (8, 12, 2, 4, 3, "row")])
def test_pieces_tile_the_full_tensor_exactly_once(rows, cols, x, y, z, style) -> None:
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 1
    seen = torch.zeros_like(full)
    for coords in itertools.product(range(x), range(y), range(z)):
        grid = _fake_grid(x, y, z, coords)
        row_dim, col_dim = ("x", "y") if style == "row" else ("y", "x")
        spec = ParamSpec(grid, rows, cols, row_dim, col_dim, z_split=True)
        piece = spec.local_from_full(full)
        assert tuple(piece.shape) == spec.local_shape
        (r0, r1), (c0, c1) = spec.row_range(), spec.col_range()
        assert torch.equal(piece[: r1 - r0], full[r0:r1, c0:c1])
        assert not piece[r1 - r0:].any()  # padding rows are zeros
        seen[r0:r1, c0:c1] += 1
        # the transposed (GPT-2 Conv1D) view gives the same piece
        tspec = ParamSpec(grid, rows, cols, row_dim, col_dim, z_split=True, transposed=True)
        assert torch.equal(tspec.local_from_full(full.t().contiguous()), piece)
    assert torch.equal(seen, torch.ones_like(full))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_safetensors_slices_match_the_library(tmp_path, dtype, monkeypatch) -> None:
    from safetensors.torch import load_file, save_file

    import axonn.state as state

    g = torch.Generator().manual_seed(0)
    tensors = {"a": (torch.randn(37, 23, generator=g) * 100).to(dtype), "b": torch.arange(11).to(dtype),
               "c": (torch.randn(5, 6, 4, generator=g) * 10).to(dtype)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    ref = load_file(str(tmp_path / "m.safetensors"))
    monkeypatch.setattr(state, "_CHUNK_BYTES", 64)  # force several staging chunks
    files = SafetensorsSlices(tmp_path)
    assert torch.equal(files.read("a", 0, 37), ref["a"])
    assert torch.equal(files.read("a", 3, 30, 5, 17), ref["a"][3:30, 5:17])
    assert torch.equal(files.read("a", 36, 37, 22, 23), ref["a"][36:37, 22:23])
    assert torch.equal(files.read("b", 2, 9), ref["b"][2:9])
    assert torch.equal(files.read("c", 1, 4, 2, 5), ref["c"][1:4, 2:5])


def test_serial_cross_entropy_sums_and_counts_non_ignored() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    targets[0, :3] = -100
    loss, count = axonn.cross_entropy(logits, targets)
    assert count.item() == 7
    want = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), reduction="sum")
    assert torch.allclose(loss, want)
    with pytest.raises(ValueError, match="disagree"):
        axonn.cross_entropy(logits, targets[:, 1:])


def test_vocab_sharded_logits_keep_the_marker_and_refuse_full_vocab_ops() -> None:
    logits = torch.randn(2, 5, 8, requires_grad=True)
    sharded = (logits * 1).as_subclass(axonn.VocabShardedLogits)
    part = sharded[:, :-1].float().reshape(-1, 8)
    assert isinstance(part, axonn.VocabShardedLogits)
    for op in (lambda t: t.softmax(-1), lambda t: F.cross_entropy(t, torch.zeros(8, dtype=torch.long)),
               lambda t: t.argmax(-1), lambda t: torch.log_softmax(t, -1)):
        with pytest.raises(RuntimeError, match="vocab-sharded"):
            op(part)
    with pytest.raises(ValueError, match="pass the grid"):
        axonn.cross_entropy(sharded, torch.zeros(2, 5, dtype=torch.long))


def test_comm_stats_count_and_reset() -> None:
    stats = axonn.CommStats()
    stats.record("x", "all_reduce", 100)
    stats.record("x", "all_reduce", 20)
    stats.record("z", "all_gather", 64)
    assert stats.snapshot() == {"x": {"all_reduce": {"calls": 2, "bytes": 120}},
                                "z": {"all_gather": {"calls": 1, "bytes": 64}}}
    assert stats.total_bytes() == 184 and stats.total_bytes("z") == 64
    stats.reset()
    assert stats.snapshot() == {}


def test_launch_env_reads_torchrun_slurm_and_mpi(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                "SLURM_JOB_NODELIST", "SLURM_NODELIST", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "PMI_RANK", "PMI_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert axonn.launch_env().source == "single"
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    with pytest.raises(axonn.ConfigError, match="^MASTER_ADDR=None: slurm"):
        axonn.launch_env()
    monkeypatch.setenv("MASTER_ADDR", "nid001")
    monkeypatch.setenv("MASTER_PORT", "29600")
    env = axonn.launch_env()
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (
        5, 8, 1, "nid001", 29600, "slurm")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(axonn.ConfigError, match="^LOCAL_RANK='x'"):
        axonn.launch_env()  # torchrun variables win over Slurm's
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert axonn.launch_env().source == "torchrun"
    with pytest.raises(axonn.ConfigError, match=r"^grid='2,2,1,2'.*world size is 4"):
        axonn.grid.resolve_dims(2, 2, 1, 2, 4)
    assert axonn.grid.resolve_dims(2, 1, 1, None, 8) == (2, 1, 1, 4)
    serial = axonn.ProcessGrid.serial()
    assert axonn.batch_shard(serial) == (1, 0)
    x = torch.arange(6)
    assert torch.equal(axonn.shard_batch(x, serial), x)

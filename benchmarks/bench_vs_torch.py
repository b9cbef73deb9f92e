"""Benchmark the engine against PyTorch's own parallelism on gloo CPU ranks (same model, same batch).

Prints `name: ratio` (engine step time / torch step time, < 1 means the engine is faster), each pair
measured in one spawned world with alternating repetitions (median of the per-round ratios):
  x2_vs_dtensor_tp        grid 2,1,1,1 (paired)  vs DTensor ColwiseParallel/RowwiseParallel, 2 ranks
  y2_paired_vs_dtensor_tp grid 1,2,1,1 (paired: heads over Y, Megatron's split) vs the same
  z2_vs_fsdp2             grid 1,1,2,1           vs FSDP2 `fully_shard` per decoder layer + root
  data2_vs_ddp            grid 1,1,1,2           vs DistributedDataParallel
and, at 8 ranks, communication bytes per rank per step of the engine's best 3D grid vs the best
torch TP x FSDP2 mesh (`bytes_best3d_vs_tp_fsdp2`).  Torch's bytes are counted, not estimated: a
TorchDispatchMode sees every c10d / functional-collective op FSDP2 and DTensor issue and adds the
size of the full buffer, with the engine's definition (all-reduce: the tensor; all-gather: the
gathered output; reduce-scatter: the unscattered input).  Writes JSON (benchmarks/results/vs_torch.json).

    python benchmarks/bench_vs_torch.py [--reps 8] [--seq 128] [--batch 8] [--skip-bytes]
"""
from __future__ import annotations

import argparse
from typing import Any

import common
import torch
from bench_engine import engine_step, torch_step
from common import alternate, ratio, report
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import axonn
from axonn.plan.search import factorizations
from axonn.spawn import run_distributed

PAIRS = {"x2_vs_dtensor_tp": ((2, 1, 1, 1), "paired", "tp"),
         "y2_paired_vs_dtensor_tp": ((1, 2, 1, 1), "paired", "tp"),
         "z2_vs_fsdp2": ((1, 1, 2, 1), "easy", "fsdp"),
         "data2_vs_ddp": ((1, 1, 1, 2), "easy", "ddp")}


def tp_plan(model: torch.nn.Module) -> dict[str, Any]:
    """Megatron-style plan: q/k/v/gate/up column-parallel, o/down row-parallel."""
    plan: dict[str, Any] = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{n}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        for n in ("gate_proj", "up_proj"):
            plan[f"{p}.mlp.{n}"] = ColwiseParallel()
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
    return plan


def torch_parallel(kind: str, tp: int = 1, dp: int = 1) -> torch.nn.Module:
    """The SMALL model under torch's TP (DTensor), FSDP2, TP x FSDP2 or DDP."""
    model = common.llama()
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if kind == "tp":
        parallelize_module(model, init_device_mesh("cpu", (tp,)), tp_plan(model))
        return model
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (dp,))
    else:  # "tp_fsdp": 2-D mesh, TP inside, FSDP2 across
        mesh2 = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh2["tp"], tp_plan(model))
        mesh = mesh2["dp"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@torch.no_grad()
def dtensor_clip(model: torch.nn.Module, max_norm: float = 1.0) -> None:
    """Global-norm clipping over a mix of DTensor (any mesh) and plain gradients."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            n = p.grad.double().pow(2).sum()
            sq += n.full_tensor() if isinstance(n, DTensor) else n
    coef = max_norm / (float(sq.sqrt()) + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)


def _local_rows(ids: torch.Tensor, shards: int, index: int) -> torch.Tensor:
    n = ids.shape[0] // shards
    return ids[index * n:(index + 1) * n]


def _pair_rank(rank: int, world: int, dims: tuple, mode: str, kind: str, rows: int, seq: int,
               reps: int) -> dict:
    torch.set_num_threads(1)
    grid = axonn.ProcessGrid(*dims)
    ids = common.batch(rows, seq, common.SMALL["vocab_size"])
    # the engine's defaults: every overlap switch on (bucketed gradient all-reduces included)
    ours = axonn.parallelize(common.llama(), grid, mode=mode)
    o_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    theirs = torch_parallel(kind, tp=world, dp=world)
    t_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    t_ids = ids if kind == "tp" else _local_rows(ids, world, rank)
    clip = None if kind == "ddp" else dtensor_clip
    res = alternate({"engine": lambda: engine_step(ours, o_opt, ids, ids, grid),
                     "torch": lambda: torch_step(theirs, t_opt, t_ids, t_ids, clip)}, reps)
    return {"times": res, "ratio": ratio(res, "engine", "torch"),
            "ratio_of_medians": res["engine"]["median_s"] / res["torch"]["median_s"]}


class ByteCounter:
    """Counts bytes of every c10d / functional collective dispatched while active (engine definition)."""

    def __init__(self) -> None:
        counter = self
        self.bytes: dict[str, int] = {}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                counter._count(str(func), args)
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()

    @staticmethod
    def _size(t: Any) -> int:
        if isinstance(t, (list, tuple)):
            return sum(ByteCounter._size(x) for x in t)
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    def _count(self, name: str, args: tuple) -> None:
        op = name.split(".")[1] if "." in name else name
        if "c10d" not in name or op in ("wait_tensor", "_wrap_tensor_autograd", "barrier"):
            return
        if op in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            n = self._size(args[0])                   # the gathered outputs
        elif op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
            n = self._size(args[0]) * int(args[1])    # functional: input x group size
        elif op in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
            n = self._size(args[1])                   # the unscattered inputs
        else:                                          # all_reduce(_), reduce_scatter_tensor, ...
            n = self._size(args[0])
        self.bytes[op] = self.bytes.get(op, 0) + n


def _bytes_rank(rank: int, world: int, rows: int, seq: int) -> dict:
    torch.set_num_threads(1)
    ids = common.batch(rows, seq, common.SMALL["vocab_size"])
    ours = {}
    for g in factorizations(world):
        dims = (g.x, g.y, g.z, g.data)
        if common.SMALL["num_attention_heads"] % g.y or rows % (g.z * g.data):
            continue
        grid = axonn.ProcessGrid(*dims)
        model = axonn.parallelize(common.llama(), grid, mode="paired")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine_step(model, opt, ids, ids, grid)  # learn the prefetch chain
        grid.stats.reset()
        engine_step(model, opt, ids, ids, grid)
        ours[str(dims)] = grid.stats.total_bytes()
    theirs = {}
    for tp in (1, 2, 4):
        dp = world // tp
        model = torch_parallel("fsdp" if tp == 1 else "tp_fsdp", tp=tp, dp=dp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        local = _local_rows(ids, dp, rank // tp)
        torch_step(model, opt, local, local, dtensor_clip)
        counter = ByteCounter()
        with counter.mode:
            torch_step(model, opt, local, local, dtensor_clip)
        theirs[f"tp{tp}_fsdp{dp}"] = {"total": sum(counter.bytes.values()), "by_op": counter.bytes}
    return {"engine": ours, "torch": theirs}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--skip-bytes", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated pair names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    pairs = {}
    for name, (dims, mode, kind) in PAIRS.items():
        if args.only and name not in args.only.split(","):
            continue
        per_rank = run_distributed(_pair_rank, 2, dims, mode, kind, args.batch, args.seq, args.reps,
                                   timeout=900)
        pairs[name] = {"grid": dims, "mode": mode, "torch": kind, **per_rank[0]}
        report(name, per_rank[0]["ratio"])
    out: dict[str, Any] = {"args": vars(args), "model": common.SMALL, "pairs": pairs}
    if not args.skip_bytes:
        per_rank = run_distributed(_bytes_rank, 8, args.batch, args.seq, timeout=900)
        ours, theirs = per_rank[0]["engine"], per_rank[0]["torch"]
        best_ours = min(ours, key=ours.get)
        best_theirs = min(theirs, key=lambda k: theirs[k]["total"])
        ratio = ours[best_ours] / theirs[best_theirs]["total"]
        out["bytes_8_ranks"] = {"engine": ours, "torch": theirs, "best_engine": best_ours,
                                "best_torch": best_theirs, "ratio": ratio}
        report("bytes_best3d_vs_tp_fsdp2", ratio)
        print(f"  engine best {best_ours}: {ours[best_ours]} B/rank/step; torch best {best_theirs}: "
              f"{theirs[best_theirs]['total']} B/rank/step", flush=True)
    common.write(args.out, "vs_torch.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark the engine's whole training step against what a user would run instead.

Prints, each measured in one run with alternating repetitions:
  engine_1111_vs_torch        engine at grid 1,1,1,1 / a plain PyTorch step on the same model
  gemm_tuned_vs_plain_1111    engine with GEMM tuning on / off (1,1,1,1)
  goldfish_vs_standard        Trainer.train_step with the goldfish transform / without (standard)
  overlap_on_vs_off_<grid>    step with every overlap switch on / all off, on gloo ranks
(a ratio < 1 means the first is faster; the median of the per-round ratios, `common.ratio`) and
writes JSON (default benchmarks/results/engine.json).

    python benchmarks/bench_engine.py [--reps 10] [--seq 128] [--batch 8] [--skip-overlap]
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any

import common
import torch
import torch.nn.functional as F
from common import alternate, ratio, report

import axonn
from axonn.config import TrainerConfig
from axonn.grid import ProcessGrid
from axonn.lm_head import LossHead, token_cross_entropy_of
from axonn.schedule import EngineOptions
from axonn.spawn import run_distributed
from axonn.trainer import Trainer
from data_pipelines import per_document
from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform


def _amp(autocast: str | None) -> Any:
    return torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()


def torch_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor,
               labels: torch.Tensor, clip: Any = None, autocast: str | None = None) -> torch.Tensor:
    """A plain PyTorch step: forward (under bf16 autocast on `autocast`'s device type, if given),
    token-sum CE / count, backward, clip (`clip(model)`, default torch's clip_grad_norm_ without
    foreach), AdamW. Returns the mean token loss it stepped on (a tensor: no host sync)."""
    with _amp(autocast):
        logits = model(input_ids=ids).logits[:, :-1]
    tgt = labels[:, 1:]
    # in fp32, as the engine's loss (bf16 logits from autocast would give a bf16-rounded loss)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    loss = F.cross_entropy(flat, tgt.reshape(-1), reduction="sum") / (tgt != -100).sum().clamp(min=1)
    loss.backward()
    if clip is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
    else:
        clip(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def engine_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor,
                labels: torch.Tensor, grid: ProcessGrid, autocast: str | None = None,
                head: LossHead | None = None) -> torch.Tensor:
    """The same step through the engine's contract (shard, vocab-aware CE, sync, global clip);
    `autocast`: a device type whose forward runs under bf16 autocast (None: no autocast); `head`:
    the Trainer's loss forward (axonn.lm_head: the chunked LM head when it chunks) instead of the
    full logits. Returns this rank's token-loss sum over the global token count (the mean loss on a
    1-shard grid)."""
    # every rank holds the global batch (as in the Trainer): the token count needs no collective
    count = max(int((labels[:, 1:] != -100).sum()), 1)
    ids, labels = axonn.shard_batch(ids, grid), axonn.shard_batch(labels, grid)
    with _amp(autocast):
        # a training forward builds no KV cache (the trainer's LossHead.forward says so too)
        if head is not None:
            logits = head.forward(ids)
        else:
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    if head is not None:
        loss = token_cross_entropy_of(logits, labels[:, 1:], grid).sum()
    else:
        loss, _ = axonn.cross_entropy(logits, labels[:, 1:], grid)
    loss = loss / count
    loss.backward()
    axonn.sync_gradients(model, grid)
    axonn.clip_grad_norm_(model, 1.0, grid)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def single_rank(args: argparse.Namespace) -> dict:
    """Engine 1,1,1,1 vs torch, GEMM tuning on vs off, goldfish vs standard (one process)."""
    torch.set_num_threads(args.threads)
    grid = common.single_process_grid()
    ids = common.batch(args.batch, args.seq, common.SMALL["vocab_size"])
    plain = common.llama()
    eng = axonn.parallelize(common.llama(), grid, options=EngineOptions(gemm_tuning=False))
    tuned = axonn.parallelize(common.llama(), grid, options=EngineOptions(gemm_tuning=True))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in
            (("torch", plain), ("engine", eng), ("tuned", tuned))}
    # goldfish vs standard: the Trainer's whole step as `memorize train` runs it (label transform,
    # forward, loss, dropped-token metric, backward, clip, AdamW) on per-document rows
    rows = per_document(ids.tolist(), args.seq, 0)
    batch = rows[list(range(len(rows)))]
    cfg = TrainerConfig(batch_size=args.batch, lr=1e-4, warmup_steps=0, progress=False, device="cpu")
    trainers = {name: Trainer(common.llama(), cfg, rows, label_transform=tf) for name, tf in
                (("standard", None),
                 ("goldfish", GoldfishTransform(GoldfishConfig(enabled=True, k=4, h=13))))}

    res = alternate({
        "torch": lambda: torch_step(plain, opts["torch"], ids, ids),
        "engine": lambda: engine_step(eng, opts["engine"], ids, ids, grid),
        "tuned": lambda: engine_step(tuned, opts["tuned"], ids, ids, grid),
        "standard": lambda: trainers["standard"].train_step(batch),
        "goldfish": lambda: trainers["goldfish"].train_step(batch),
    }, args.reps)
    ratios = {
        "engine_1111_vs_torch": ratio(res, "engine", "torch"),
        "gemm_tuned_vs_plain_1111": ratio(res, "tuned", "engine"),
        "goldfish_vs_standard": ratio(res, "goldfish", "standard"),
    }
    # process CPU time too: on a shared machine other jobs inflate wall time unevenly
    for name, (a, b) in {"engine_1111_vs_torch": ("engine", "torch"),
                         "goldfish_vs_standard": ("goldfish", "standard")}.items():
        ratios[name + "_cpu"] = res[a]["cpu_median_s"] / res[b]["cpu_median_s"]
    winners = dict(axonn.engine_of(tuned).scheduler.gemm._memory)
    return {"ratios": ratios, "times": res, "gemm_winners": winners}


def _overlap_rank(rank: int, world: int, dims: tuple, mode: str, rows: int, seq: int,
                  reps: int) -> dict:
    grid = axonn.ProcessGrid(*dims)
    ids = common.batch(rows, seq, common.SMALL["vocab_size"])
    models = {"on": EngineOptions(bucket_grads=True), "off": EngineOptions.no_overlap()}
    built = {}
    for k, o in models.items():
        m = axonn.parallelize(common.llama(), grid, mode=mode, options=o)
        built[k] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4))
    res = alternate({k: (lambda m=m, o=o: engine_step(m, o, ids, ids, grid)) for k, (m, o) in built.items()},
                    reps)
    sched = axonn.engine_of(built["on"][0]).scheduler
    return {"times": res, "hits": sched.prefetch_hits, "misses": sched.prefetch_misses}


def overlap(args: argparse.Namespace) -> dict:
    """Overlap on vs off at a few grids (gloo ranks, one thread each)."""
    out = {}
    for dims, mode in (((1, 1, 2, 1), "easy"), ((1, 1, 2, 2), "easy"), ((2, 1, 2, 1), "paired")):
        world = dims[0] * dims[1] * dims[2] * dims[3]
        per_rank = run_distributed(_overlap_rank, world, dims, mode, args.batch, args.seq,
                                   max(3, args.reps // 2), timeout=900)
        t = per_rank[0]["times"]
        name = "overlap_on_vs_off_" + "".join(map(str, dims))
        out[name] = {"ratio": ratio(t, "on", "off"), "mode": mode, "rank0": per_rank[0]}
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-overlap", action="store_true")
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    single = {"ratios": {}} if args.skip_single else single_rank(args)
    for name, value in single["ratios"].items():
        report(name, value)
    ov = {} if args.skip_overlap else overlap(args)
    for name, r in ov.items():
        report(name, r["ratio"])
    common.write(args.out, "engine.json", {"args": vars(args), "model": common.SMALL, "single": single,
                                           "overlap": ov})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

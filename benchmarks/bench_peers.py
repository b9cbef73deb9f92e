"""The engine's one-GPU training step beside the usual single-GPU stacks, one arm per process.

Arms (a random-init Llama of a zoo shape, seq 2048, bf16 autocast over fp32 weights, fused AdamW,
clip 1.0; every arm builds the same seeded model):
  engine            the engine at 1,1,1,1 as `memorize train` runs it without the new switches: one
                    `axonn.Trainer.train_step` per step (its loss forward, CE, clip, AdamW, schedule
                    and metric syncs; GEMM tuning on; full logits)
  engine+chunked    + the chunked LM head / cross-entropy (trainer.loss_chunk=auto)
  engine+compile    + torch.compile per decoder block (trainer.compile=true)
  engine+both       both
  hf                plain Hugging Face: `model(ids, labels=ids, use_cache=False).loss`, torch's clip
  hf+compile        + `layer.compile()` on each decoder layer
  hf+liger          + Liger kernels (RMSNorm, SwiGLU, RoPE, fused linear CE), when installed
  hf+liger+compile  both
Each arm runs in its own process (Liger patches transformers' classes; 1B models with AdamW states
take ~20 GB each) over the batches given, in one model: per batch `--warmup` steps (compile counted
there), then `--steps` timed steps (median), peak memory since the warm-up. MFU by the planner's
convention (`axonn.plan.model.model_flops`) over --peak-tflops. `--table DIR` prints the arms'
JSONs as one table with each arm's step time over the best HF arm's at the same batch. `--profile`
(CUDA) adds one profiled step at the last batch: kernel time by family (GEMM, attention, Inductor's
fused kernels, optimizer, ...), GPU idle time and the top kernels (bench_gpu.profile_step), so two
arms' steps can be compared part by part.

    python benchmarks/bench_peers.py --arm engine+both [--model llama-1b] [--batches 4,8] --out DIR
    python benchmarks/bench_peers.py --table DIR
CPU dry run (no timings worth reading; checks the code paths end to end):
    python benchmarks/bench_peers.py --arm engine+both --device cpu --model tiny --seq 64 \
        --batches 2 --backend aot_eager --loss-chunk 32 --out DIR
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import common
import torch
from bench_gpu import build, profile_step

import axonn
from axonn.compile import compile_blocks
from axonn.config import TrainerConfig
from axonn.plan.calibrate import get_hardware
from axonn.plan.memory import auto_chunk
from axonn.plan.model import model_flops, predict
from axonn.plan.shapes import load_shape
from axonn.plan.volumes import Grid
from axonn.schedule import EngineOptions
from axonn.trainer import Trainer

ARMS = ("engine", "engine+chunked", "engine+compile", "engine+both", "hf", "hf+compile", "hf+liger",
        "hf+liger+compile")


def _liger() -> Any:
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # deferred: optional extra
    except ImportError:
        return None
    return apply_liger_kernel_to_llama


class _Rows:
    """The trainer's one-row dataset (it steps on the benchmark's own batches)."""

    def __init__(self, seq: int) -> None:
        self.ids = torch.zeros(1, seq, dtype=torch.long)

    def __len__(self) -> int:
        return 1

    def __getitem__(self, idx: Any) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[idx]}


def make_arm(arm: str, shape: Any, seq: int, device: str, backend: str,
             loss_chunk: int | str = "auto", batch: int = 8) -> tuple[Any, Any] | str:
    """(model, step(ids) -> loss tensor) of one arm, or why it cannot run here; `batch`: the largest
    batch the arm steps on."""
    if "liger" in arm:
        patch = _liger()
        if patch is None:
            return "liger-kernel is not installed"
        patch()  # before building: it swaps transformers' Llama modules and loss (this process only)
    model = build(shape, seq, device, checkpoint=False)
    compiled = arm.endswith("compile") or arm.endswith("both")
    fused = device == "cuda"
    amp = device if device == "cuda" else None  # bf16 autocast on the GPU; CPU dry runs in fp32
    if arm.startswith("engine"):
        grid = common.single_process_grid()
        model = axonn.parallelize(model, grid, options=EngineOptions(gemm_tuning=device == "cuda"))
        # every engine arm is the trainer's own step (axonn.Trainer.train_step): its loss forward (no KV
        # cache, so a compiled block is one graph for every layer), CE, clip, AdamW and syncs; full
        # logits unless chunked. Compiled here with --backend (the trainer's compile is inductor's).
        chunked = "chunked" in arm or "both" in arm
        cfg = TrainerConfig(lr=1e-5, warmup_steps=0, grad_clip=1.0, batch_size=batch, max_steps=10**6,
                            progress=False, device=device, precision="bf16" if amp else "fp32",
                            loss_chunk=loss_chunk if chunked else "off", compile=False)
        trainer = Trainer(model, cfg, _Rows(seq), grid=grid)
        if chunked and trainer.loss_head.head is None:
            return f"the chunked head does not apply: {trainer.loss_head.reason}"
        if compiled:
            compile_blocks(model, True, torch.device(device), backend=backend)

        def step(ids: torch.Tensor) -> torch.Tensor:
            stats = trainer.train_step({"input_ids": ids})
            return torch.tensor(stats.loss_sum / max(stats.supervised, 1))
        return model, step
    if compiled:
        compile_blocks(model, True, torch.device(device), backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)

    def hf_step(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp is not None):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return model, hf_step


def _predicted(args: argparse.Namespace, shape: Any, batch: int) -> float:
    """The planner's step time for an engine arm at `batch` (with the chunked head's terms when it chunks)."""
    chunk = 0
    if "chunked" in args.arm or "both" in args.arm:
        tokens = batch * (args.seq - 1)
        chunk = auto_chunk(shape.vocab) if args.loss_chunk == "auto" else int(args.loss_chunk)
        chunk = chunk if tokens > chunk or args.loss_chunk != "auto" else 0
    return predict(shape, Grid(1, 1, 1, 1), args.seq, batch, get_hardware(args.hardware), gpus_per_node=1,
                   mode="paired", loss_chunk=chunk).time_s


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    """Time one arm at every batch of --batches; one JSON row per batch."""
    shape = load_shape(args.model)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.perf_counter()
    made = make_arm(args.arm, shape, args.seq, args.device, args.backend, args.loss_chunk, max(args.batches))
    if isinstance(made, str):
        print(f"{args.arm}: skipped ({made})")
        return {"arm": args.arm, "skipped": made, "rows": []}
    model, step = made
    rows = []
    for b in args.batches:
        ids = torch.randint(0, shape.vocab, (b, args.seq), device=args.device,
                            generator=torch.Generator(args.device).manual_seed(b))
        row: dict[str, Any] = {"batch": b}
        try:
            sync()
            w0 = time.perf_counter()
            first = float(step(ids))
            for _ in range(args.warmup - 1):
                step(ids)
            sync()
            row["warmup_s"] = time.perf_counter() - w0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.steps):
                s0 = time.perf_counter()
                step(ids)
                sync()
                times.append(time.perf_counter() - s0)
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            if cuda:
                torch.cuda.empty_cache()
            rows.append(row)
            print(f"{args.arm} batch {b}: out of memory")
            continue
        med = statistics.median(times)
        flops = model_flops(shape, args.seq, b)
        row.update(step_s=med, times=times, first_loss=first, tokens_per_s=b * args.seq / med,
                   mfu=flops / med / 1e12 / args.peak_tflops,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"))
        if args.arm.startswith("engine"):
            row["predicted_step_s"] = _predicted(args, shape, b)
        rows.append(row)
        print(f"{args.arm:<17} batch {b}: step {med:.4f} s, {row['tokens_per_s']:,.0f} tok/s, "
              f"MFU {100 * row['mfu']:.1f}%, peak {row['peak_gib']:.1f} GiB, "
              f"warm-up {row['warmup_s']:.1f} s, first loss {first:.4f}"
              + (f", planner {row['predicted_step_s']:.4f} s" if "predicted_step_s" in row else ""),
              flush=True)
        common.report(f"peer_{args.arm.replace('+', '_')}_b{b}_mfu", row["mfu"])
    if args.profile and cuda and rows and "step_s" in rows[-1]:
        print(f"{args.arm} batch {rows[-1]['batch']}, one profiled step:")
        rows[-1]["profile"] = profile_step(functools.partial(step, ids))
    del model, step
    return {"arm": args.arm, "model": args.model, "seq": args.seq, "device": common.machine()["device"],
            "backend": args.backend, "build_and_run_s": time.perf_counter() - t0, "rows": rows}


def table(folder: Path) -> int:
    """Print every arm's rows (peers_*.json in `folder`) as one markdown table, ratios vs the best HF arm."""
    found = sorted(folder.glob("peers_*.json"))
    data = [json.loads(p.read_text()) for p in found]
    if not data:
        print(f"bench_peers: no peers_*.json in {folder}")
        return 1
    order = {a: i for i, a in enumerate(ARMS)}
    data.sort(key=lambda d: order.get(d["arm"], 99))
    batches = sorted({r["batch"] for d in data for r in d["rows"]})
    best = {}
    for b in batches:
        hf = [r["step_s"] for d in data if d["arm"].startswith("hf") for r in d["rows"]
              if r["batch"] == b and "step_s" in r]
        best[b] = min(hf) if hf else None
    head = "| arm | " + " | ".join(f"batch {b}: MFU, peak GiB, step / best HF" for b in batches) + " |"
    print(head)
    print("|---|" + "---|" * len(batches))
    for d in data:
        cells = []
        for b in batches:
            r = next((r for r in d["rows"] if r["batch"] == b), None)
            if d.get("skipped"):
                cells.append(f"skipped: {d['skipped']}")
            elif r is None or "step_s" not in r:
                cells.append(r.get("error", "not run") if r else "not run")
            else:
                rel = f"{r['step_s'] / best[b]:.3f}" if best[b] else "-"
                pred = r.get("predicted_step_s")
                pred = f", planner {pred / r['step_s']:.2f}x" if pred else ""
                cells.append(f"{100 * r['mfu']:.1f}%, {r['peak_gib']:.1f}, {rel}{pred}")
        print(f"| {d['arm']} | " + " | ".join(cells) + " |")
    dev = {d.get("device") for d in data if d.get("device")}
    print(f"(device: {', '.join(sorted(dev))}; step / best HF < 1: faster than the best HF arm; "
          "planner: predicted / measured step)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one arm (--arm) or print the table of a folder of arm results (--table)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--table", type=Path, metavar="DIR")
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hardware", default="h100", help="planner preset for the predicted step")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the compile arms")
    ap.add_argument("--loss-chunk", type=lambda s: s if s in ("auto", "off") else int(s), default="auto",
                    help="the chunked arms' trainer.loss_chunk (dry runs: a small number, to chunk at all)")
    ap.add_argument("--profile", action="store_true", help="one profiled step at the last batch (CUDA)")
    ap.add_argument("--out", type=Path, default=common.RESULTS)
    args = ap.parse_args(argv)
    if args.table:
        return table(args.table)
    if not args.arm:
        ap.error("give --arm or --table")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_peers: error: no CUDA device (use --device cpu for a dry run)")
        return 2
    res = run_arm(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"peers_{args.arm.replace('+', '_')}.json"
    path.write_text(json.dumps({**res, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

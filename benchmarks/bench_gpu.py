"""Single-GPU training throughput of the engine: MFU, tokens/s, peak memory vs the planner's estimate.

Checks the device, builds a random-init model of a zoo shape (default `llama-1b`) directly on the
GPU, parallelizes it at grid 1,1,1,1 (GEMM tuning on), and times full AdamW steps under bf16
autocast (fp32 master weights).  MFU uses the planner's model-flops convention
(6·N·tokens + 12·L·H·seq·tokens; recompute not counted) over 989 TF/s (H100 dense bf16) unless
--peak-tflops says otherwise.  Prints one table (and `name: value` lines) and writes JSON
(benchmarks/results/gpu.json), with date and device.

    python benchmarks/bench_gpu.py [--model llama-1b] [--seq 2048] [--batch 4] [--steps 10]
                                   [--checkpoint] [--peak-tflops 989] [--device cuda]
Targets (the issue): MFU >= 55% on one H100; predicted peak memory within 10% of measured.
"""
from __future__ import annotations

import argparse
import statistics
import time

import common
import torch
from bench_engine import engine_step
from common import report
from transformers import LlamaConfig, LlamaForCausalLM

import axonn
from axonn.plan.calibrate import get_hardware
from axonn.plan.model import model_flops, predict
from axonn.plan.shapes import load_shape
from axonn.plan.volumes import Grid
from axonn.schedule import EngineOptions


def build(shape, seq: int, device: str, checkpoint: bool) -> torch.nn.Module:
    """A random-init Llama of the planner's shape, built on `device`."""
    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=seq,
                      tie_word_embeddings=shape.tied, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def main(argv: list[str] | None = None) -> int:
    """Check, measure, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--hardware", default="h100", help="planner preset for the memory estimate")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench_gpu: error: no CUDA device (run on a GPU machine, or --device cpu for a smoke test)")
            return 2
        if not torch.cuda.is_bf16_supported():
            print("bench_gpu: error: this GPU has no bf16 support")
            return 2
        torch.backends.cuda.matmul.allow_tf32 = True
    shape = load_shape(args.model)
    grid = common.single_process_grid()
    model = axonn.parallelize(build(shape, args.seq, args.device, args.checkpoint), grid,
                              options=EngineOptions(gemm_tuning=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device == "cuda")
    ids = torch.randint(0, shape.vocab, (args.batch, args.seq), device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def step() -> None:
        engine_step(model, opt, ids, ids, grid, autocast=args.device)

    for _ in range(args.warmup):
        step()
    sync()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    step_s = statistics.median(times)
    tokens = args.batch * args.seq
    flops = model_flops(shape, args.seq, args.batch)
    tflops = flops / step_s / 1e12
    mfu = tflops / args.peak_tflops
    pred = predict(shape, Grid(1, 1, 1, 1), args.seq, args.batch, get_hardware(args.hardware),
                   gpus_per_node=1, checkpoint=args.checkpoint, mode="paired")
    rows = [("device", common.machine()["device"]), ("model", f"{args.model} ({shape.name})"),
            ("seq x batch", f"{args.seq} x {args.batch}"), ("checkpointing", args.checkpoint),
            ("step (median)", f"{step_s:.4f} s"), ("tokens/s", f"{tokens / step_s:,.0f}"),
            ("model TF/s", f"{tflops:.1f}"), ("MFU", f"{100 * mfu:.1f}% of {args.peak_tflops:g} TF/s"),
            ("peak memory", f"{peak:.2f} GiB"), ("predicted memory", f"{pred.memory_gb:.2f} GiB"),
            ("predicted step", f"{pred.time_s:.4f} s")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    report("gpu_mfu", mfu)
    report("gpu_tokens_per_s", tokens / step_s)
    report("gpu_peak_memory_gib", peak)
    report("gpu_memory_predicted_over_measured", pred.memory_gb / peak if peak == peak else float("nan"))
    common.write(args.out, "gpu.json", {
        "args": vars(args), "step_s": times, "median_step_s": step_s, "tokens_per_s": tokens / step_s,
        "model_tflops": tflops, "mfu": mfu, "peak_memory_gib": peak,
        "predicted_memory_gib": pred.memory_gb, "predicted_step_s": pred.time_s,
        "predicted_memory_by_kind": pred.memory_by_kind})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

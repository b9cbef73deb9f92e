"""Single-GPU training throughput of the engine: MFU, tokens/s, peak memory vs the planner's estimate.

Checks the device, builds a random-init model of a zoo shape (default `llama-1b`) directly on the
GPU, parallelizes it at grid 1,1,1,1 (GEMM tuning on), and times full AdamW steps under bf16
autocast (fp32 master weights).  MFU uses the planner's model-flops convention
(6·N·tokens + 12·L·H·seq·tokens; recompute not counted) over 989 TF/s (H100 dense bf16) unless
--peak-tflops says otherwise.  Prints one table (and `name: value` lines) and writes JSON
(benchmarks/results/gpu.json), with date and device.

    python benchmarks/bench_gpu.py [--model llama-1b] [--seq 2048] [--batch 4] [--steps 10]
                                   [--checkpoint] [--peak-tflops 989] [--device cuda] [--profile]
    python benchmarks/bench_gpu.py --vs-torch [--model llama-1b] [--batch 4] [--reps 10]
    python benchmarks/bench_gpu.py --bf16-check [--steps 20]
    python benchmarks/bench_gpu.py --peers [--model llama-1b] [--out DIR]

Targets (the issue): MFU >= 55% on one H100; predicted peak memory within 10% of measured;
engine / plain PyTorch <= 1.03.

  --profile     after the timed steps, one profiled step: CUDA time by kernel family (GEMM,
                attention, optimizer, elementwise, ...) and the top kernels (profile.json)
  --vs-torch    the engine step at 1,1,1,1 against the same model as a plain PyTorch step (bf16
                autocast, fused AdamW, torch's own clip_grad_norm_), the two stepped alternately in
                one process: `gpu_engine_1111_vs_torch` (engine / torch, the median of the per-round
                ratios; < 1 means the engine is faster); gpu_vs_torch.json
  --peers       the engine (as is, + chunked head, + compile, both) beside HF eager / + compile /
                + Liger (+ compile) at batch 4 and 8: each arm of benchmarks/bench_peers.py in its own
                process, then their table (peers_*.json in --out, default benchmarks/results)
  --bf16-check  `--steps` (20) steps of the engine and of plain PyTorch from the same init on the same
                batches of the SMALL Llama under bf16 autocast, and plain PyTorch in fp32 for scale:
                both loss curves and the largest differences (gpu_bf16.json)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import torch
from bench_engine import engine_step, torch_step
from common import alternate, ratio, report
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

import axonn
from axonn.plan.calibrate import get_hardware
from axonn.plan.model import model_flops, predict
from axonn.plan.shapes import load_shape
from axonn.plan.volumes import Grid
from axonn.schedule import EngineOptions


def build(shape, seq: int, device: str, checkpoint: bool, seed: int = 0) -> torch.nn.Module:
    """A random-init Llama of the planner's shape, built on `device`."""
    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=seq,
                      tie_word_embeddings=shape.tied, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor,
               autocast: str | None) -> torch.Tensor:
    """What a user writes without the engine: bench_engine's plain step with torch's own (foreach)
    clip_grad_norm_, the fast path on a GPU."""
    def clip(m: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)

    return torch_step(model, opt, ids, ids, clip=clip, autocast=autocast)


def _check_cuda(device: str) -> str | None:
    if device != "cuda":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device (run on a GPU machine, or --device cpu for a smoke test)"
    if not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support"
    torch.backends.cuda.matmul.allow_tf32 = True
    return None


def _synced(fn: Callable[[], Any], device: str) -> Callable[[], None]:
    def run() -> None:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    return run


def _table(rows: list[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", flush=True)


_FAMILIES = (("compiled (triton)", ("triton_",)),  # Inductor's fused kernels: norms, rotary, CE chunks
             ("gemm", ("gemm", "sm90_xmma", "cutlass", "cublas", "nvjet", "matmul")),
             ("attention", ("flash", "fmha", "attention", "sdpa")),
             ("optimizer", ("adam", "multi_tensor")),
             ("cross-entropy", ("softmax", "nll_loss", "cross_entropy")),
             ("copy/cast", ("copy", "cast", "convert", "fill", "memcpy", "memset", "catarray")),
             ("reduction", ("reduce", "norm")),
             ("elementwise", ("elementwise", "vectorized", "unrolled", "index", "gather")))


def _family(name: str) -> str:
    low = name.lower()
    for fam, keys in _FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def kernel_times(trace: dict[str, Any]) -> tuple[list[dict], float]:
    """The GPU kernels of a Chrome trace (torch profiler), in time order, and their span in us.

    Read from the exported trace: `prof.events()` links only the kernels it can tie to an operator
    and missed ~40% of them here (1,627 of 2,616 on llama-1b, 2026-11-25)."""
    ev = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    span = (ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]) if ev else 1.0
    return ev, float(span)


def profile_step(step: Callable[[], None], top: int = 15, trace: str | None = None) -> dict[str, Any]:
    """One step under the torch profiler: kernel time by family, GPU idle time, the top kernels and
    operators (and, with `trace`, the Chrome trace kept there)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = trace or f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            kernels, span_us = kernel_times(json.load(f))
    total_us = sum(e["dur"] for e in kernels) or 1.0
    fam: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        fam[_family(e["name"])] = fam.get(_family(e["name"]), 0.0) + e["dur"]
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
    ops = [a for a in prof.key_averages() if a.self_device_time_total > 0 and a.key.startswith("aten::")]
    ops = sorted(ops, key=lambda a: -a.self_device_time_total)[:top]
    print(f"profile: {len(kernels)} kernels, {total_us / 1e3:.1f} ms of kernel time in a "
          f"{span_us / 1e3:.1f} ms span (GPU busy {100 * total_us / span_us:.0f}%)")
    for k, v in sorted(fam.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<14} {v / 1e3:8.2f} ms  {100 * v / span_us:5.1f}% of the span")
    print("  top kernels:")
    tops = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    for name, v in tops:
        print(f"    {v / 1e3:8.2f} ms  {100 * v / span_us:5.1f}%  {name[:100]}")
    print("  top operators (self CUDA time):")
    for a in ops:
        print(f"    {a.self_device_time_total / 1e3:8.2f} ms  x{a.count:<5} {a.key[:90]}")
    return {"kernels": len(kernels), "kernel_ms": total_us / 1e3, "span_ms": span_us / 1e3,
            "families_ms": {k: v / 1e3 for k, v in fam.items()},
            "top_kernels_ms": [(n, v / 1e3) for n, v in tops],
            "top_ops_ms": [(a.key, a.self_device_time_total / 1e3) for a in ops]}


def throughput(args: argparse.Namespace) -> int:
    """The engine's step: time, tokens/s, MFU, peak memory vs the planner (gpu.json)."""
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
    _table([("device", common.machine()["device"]), ("model", f"{args.model} ({shape.name})"),
            ("seq x batch", f"{args.seq} x {args.batch}"), ("checkpointing", args.checkpoint),
            ("step (median)", f"{step_s:.4f} s"), ("tokens/s", f"{tokens / step_s:,.0f}"),
            ("model TF/s", f"{tflops:.1f}"), ("MFU", f"{100 * mfu:.1f}% of {args.peak_tflops:g} TF/s"),
            ("peak memory", f"{peak:.2f} GiB"), ("predicted memory", f"{pred.memory_gb:.2f} GiB"),
            ("predicted step", f"{pred.time_s:.4f} s")])
    report("gpu_mfu", mfu)
    report("gpu_tokens_per_s", tokens / step_s)
    report("gpu_peak_memory_gib", peak)
    report("gpu_memory_predicted_over_measured", pred.memory_gb / peak if peak == peak else float("nan"))
    trace = f"{args.trace}/trace_engine.json" if args.trace else None
    prof = profile_step(step, trace=trace) if args.profile and args.device == "cuda" else None
    common.write(args.out, "gpu.json", {
        "args": vars(args), "step_s": times, "median_step_s": step_s, "tokens_per_s": tokens / step_s,
        "model_tflops": tflops, "mfu": mfu, "peak_memory_gib": peak,
        "predicted_memory_gib": pred.memory_gb, "predicted_step_s": pred.time_s,
        "predicted_memory_by_kind": pred.memory_by_kind, "profile": prof})
    return 0


def vs_torch(args: argparse.Namespace) -> int:
    """Engine 1,1,1,1 vs plain PyTorch on the same shape, stepped alternately (gpu_vs_torch.json)."""
    shape = load_shape(args.model)
    grid = common.single_process_grid()
    plain = build(shape, args.seq, args.device, args.checkpoint)
    eng = axonn.parallelize(build(shape, args.seq, args.device, args.checkpoint), grid,
                            options=EngineOptions(gemm_tuning=True))
    fused = args.device == "cuda"
    opts = {"torch": torch.optim.AdamW(plain.parameters(), lr=1e-5, fused=fused),
            "engine": torch.optim.AdamW(eng.parameters(), lr=1e-5, fused=fused)}
    ids = torch.randint(0, shape.vocab, (args.batch, args.seq), device=args.device)
    res = alternate({
        "torch": _synced(lambda: plain_step(plain, opts["torch"], ids, args.device), args.device),
        "engine": _synced(lambda: engine_step(eng, opts["engine"], ids, ids, grid, autocast=args.device),
                          args.device),
    }, args.reps, warmup=args.warmup)
    r = ratio(res, "engine", "torch")
    tokens = args.batch * args.seq
    # how long the host takes to enqueue one step (no sync inside it): near the step time means the
    # step is bound by Python and launches, not by the GPU
    host = {}
    steps = {"torch": lambda: plain_step(plain, opts["torch"], ids, args.device),
             "engine": lambda: engine_step(eng, opts["engine"], ids, ids, grid, autocast=args.device)}
    for name, fn in steps.items():
        spans = []
        for _ in range(3):
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            spans.append(time.perf_counter() - t0)
        host[name] = statistics.median(spans)
    t_torch, t_eng = res["torch"]["median_s"], res["engine"]["median_s"]
    _table([("device", common.machine()["device"]), ("model", f"{args.model}, seq {args.seq} x batch "
            f"{args.batch}, checkpointing {args.checkpoint}"),
            ("plain PyTorch step", f"{t_torch:.4f} s ({tokens / t_torch:,.0f} tok/s)"),
            ("engine 1,1,1,1 step", f"{t_eng:.4f} s ({tokens / t_eng:,.0f} tok/s)"),
            ("engine / torch", f"{r:.4f} (median of {args.reps} per-round ratios)"),
            ("host enqueue per step", f"torch {host['torch']:.4f} s, engine {host['engine']:.4f} s")])
    report("gpu_engine_1111_vs_torch", r)
    prof = None
    if args.profile and args.device == "cuda":
        print("plain PyTorch step:")
        traces = {k: f"{args.trace}/trace_{k}.json" if args.trace else None for k in ("torch", "engine")}
        prof = {"torch": profile_step(lambda: plain_step(plain, opts["torch"], ids, args.device),
                                      trace=traces["torch"])}
        print("engine step:")
        prof["engine"] = profile_step(lambda: engine_step(eng, opts["engine"], ids, ids, grid,
                                                          autocast=args.device), trace=traces["engine"])
    common.write(args.out, "gpu_vs_torch.json", {"args": vars(args), "ratio": r, "times": res,
                                                 "host_s": host,
                                                 "profile": prof})
    return 0


def bf16_losses(steps: int = 20, device: str = "cuda", lr: float = 1e-3, rows: int = 8,
                seq: int = 128) -> dict[str, list[float]]:
    """Loss curves of `steps` AdamW steps from one init on the same batches: the engine at 1,1,1,1
    under bf16 autocast, plain PyTorch under bf16 autocast, plain PyTorch in fp32."""
    grid = common.single_process_grid()
    vocab = common.SMALL["vocab_size"]
    # two batches taken in turn: learnable (memorised), so the curves fall and a step not taken shows
    pair = [common.batch(rows, seq, vocab, seed=s).to(device) for s in range(2)]
    batches = [pair[i % 2] for i in range(steps)]
    fused = device == "cuda"
    curves: dict[str, list[float]] = {}
    for name in ("engine_bf16", "torch_bf16", "torch_fp32"):
        model = common.llama().to(device)
        if name == "engine_bf16":
            model = axonn.parallelize(model, grid, options=EngineOptions(gemm_tuning=True))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
        out = []
        for ids in batches:
            if name == "engine_bf16":
                out.append(float(engine_step(model, opt, ids, ids, grid, autocast=device)))
            else:
                out.append(float(plain_step(model, opt, ids, device if name == "torch_bf16" else None)))
        curves[name] = out
    return curves


def bf16_check(args: argparse.Namespace) -> int:
    """Print the three loss curves and their differences (gpu_bf16.json)."""
    c = bf16_losses(args.steps, args.device)
    eng, tb, tf = c["engine_bf16"], c["torch_bf16"], c["torch_fp32"]
    d_eng = max(abs(a - b) for a, b in zip(eng, tb))
    d_amp = max(abs(a - b) for a, b in zip(tb, tf))
    print("step  engine_bf16  torch_bf16  torch_fp32")
    for i, (a, b, f) in enumerate(zip(eng, tb, tf)):
        print(f"{i:>4}  {a:11.5f}  {b:10.5f}  {f:10.5f}")
    _table([("max |engine_bf16 - torch_bf16|", f"{d_eng:.5f}"),
            ("max |torch_bf16 - torch_fp32|", f"{d_amp:.5f} (what bf16 autocast itself moves)")])
    report("gpu_bf16_engine_vs_torch_max_abs", d_eng)
    report("gpu_bf16_vs_fp32_max_abs", d_amp)
    common.write(args.out, "gpu_bf16.json", {"args": vars(args), "curves": c,
                                             "max_abs_engine_vs_torch": d_eng, "max_abs_bf16_vs_fp32": d_amp})
    return 0


def peers(args: argparse.Namespace) -> int:
    """bench_peers.py's arms one process each (Liger patches transformers; 1B + AdamW is ~20 GB), then
    their table."""
    import bench_peers  # deferred: bench_peers imports `build` from this module (a cycle at import time)

    here = Path(__file__).resolve().parent
    out = Path(args.out or common.RESULTS)
    for arm in bench_peers.ARMS:
        cmd = [sys.executable, str(here / "bench_peers.py"), "--arm", arm, "--model", args.model,
               "--seq", str(args.seq), "--batches", "4,8", "--device", args.device, "--out", str(out)]
        subprocess.run(cmd, check=False)
    return bench_peers.table(out)


def main(argv: list[str] | None = None) -> int:
    """Check the device, run the chosen mode, print its table, write its JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (10); --bf16-check: steps (20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10, help="--vs-torch: alternating rounds")
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--hardware", default="h100", help="planner preset for the memory estimate")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--trace", default=None, metavar="DIR", help="with --profile: Chrome traces into DIR")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--vs-torch", action="store_true")
    mode.add_argument("--bf16-check", action="store_true")
    mode.add_argument("--peers", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    err = _check_cuda(args.device)
    if err:
        print(f"bench_gpu: error: {err}")
        return 2
    if args.peers:
        return peers(args)
    if args.bf16_check:
        args.steps = args.steps or 20
        return bf16_check(args)
    args.steps = args.steps or 10
    if args.vs_torch:
        return vs_torch(args)
    return throughput(args)


if __name__ == "__main__":
    raise SystemExit(main())

"""Extraction-style decoding on one GPU: our decoders beside HF `generate`, tokens compared row by row.

A Llama of a zoo shape (default llama-1b; `--shape hidden=1024,layers=8` overrides fields) in bf16,
batch 256, 32-token prefixes, 32 new tokens, greedy, no EOS. Random-init by default; `--train N`
first trains it (fp32 weights, bf16 autocast, AdamW) for N steps to memorize the batch's own
sequences, so its logits are peaked as a trained model's are (on flat random-init logits any two
kernels may order near-ties differently). Arms, in one process on the same prefixes:
  hf_generate         model.generate(do_sample=False)
  hf_static           model.generate(..., cache_implementation="static") (transformers compiles its step)
  greedy_generate     evals.decoding.greedy_generate (preallocated dynamic cache, eager)
  static_compiled     evals.static_decode.static_greedy_generate (static cache, compiled decode step:
                      CUDA graphs on a GPU)
  static_verified     what extraction runs on a GPU (evals.static_decode.static_local): the compiled
                      decode, every row checked by a teacher-forced forward, failures decoded again
  static_gated        the same, checking only rows whose smallest top-2 logit gap in the compiled
                      decode is below --gate (a candidate default, decided by the gap_shift_max the
                      static_verified arm logs: how far compiled and eager gaps move apart)
Each arm runs once untimed (its compile, reported as first_s), then --reps timed calls (median):
sequences/s, and in how many rows its tokens equal greedy_generate's and HF generate's; the
static_verified arm also prints the rows its check sent back with their top-2 logit gap.

    python benchmarks/bench_decode.py [--model llama-1b] [--shape F=V,...] [--train N] [--batch 256]
                                      [--reps 3] [--out DIR]
CPU dry run: python benchmarks/bench_decode.py --device cpu --model tiny --batch 4 --new 6 --reps 1 \
                 --backend eager --train 30
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import common
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from axonn.plan.shapes import load_shape
from evals._model import evaluating
from evals.decoding import greedy_generate
from evals.scoring import Scorer
from evals.static_decode import DecodeLog, static_greedy_generate, static_local


def build(shape, length: int, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    """A seeded random-init Llama of `shape` with no EOS (generate never stops early)."""
    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=max(length, 64),
                      tie_word_embeddings=shape.tied, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def with_fields(shape, text: str):
    """`shape` with the fields of "hidden=1024,layers=8" replaced (integers)."""
    if not text:
        return shape
    fields = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        fields[key.strip()] = int(value)
    return dataclasses.replace(shape, **fields)


def memorize(model: LlamaForCausalLM, seqs: torch.Tensor, steps: int, lr: float) -> float:
    """Train `model` (fp32) on `seqs` for `steps` full-batch AdamW steps, bf16 autocast on CUDA; the
    last loss."""
    cuda = seqs.device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=cuda)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=seqs, labels=seqs, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"train step {step:4d} loss {loss.item():.4f}", flush=True)
    model.eval()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    """Time every arm, print the table and `decode_*` lines, write decode.json."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--shape", default="", help="shape fields to override, e.g. hidden=1024,layers=8")
    ap.add_argument("--train", type=int, default=0, metavar="N",
                    help="first train N steps to memorize the batch's sequences (0: random init)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--gate", type=float, default=1.0, help="static_gated: check rows with a gap below it")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of static_compiled")
    ap.add_argument("--arms", default="hf_generate,hf_static,greedy_generate,static_compiled,static_verified,"
                                      "static_gated")
    ap.add_argument("--out", type=Path, default=common.RESULTS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_decode: error: no CUDA device (use --device cpu for a dry run)")
        return 2
    cuda = args.device == "cuda"
    shape = with_fields(load_shape(args.model), args.shape)
    n = args.new
    seqs = torch.randint(0, shape.vocab, (args.batch, args.prefix + n), device=args.device,
                         generator=torch.Generator(args.device).manual_seed(1))
    ids, truth = seqs[:, :args.prefix], seqs[:, args.prefix:]
    loss = None
    if args.train:
        model = build(shape, args.prefix + n, args.device, torch.float32)
        t0 = time.perf_counter()
        loss = memorize(model, seqs, args.train, args.lr)
        took = time.perf_counter() - t0
        print(f"trained {args.train} steps in {took:.0f} s, last loss {loss:.4f}", flush=True)
        model = model.to(torch.bfloat16 if cuda else torch.float32)
    else:
        model = build(shape, args.prefix + n, args.device, torch.bfloat16 if cuda else torch.float32)
    logs = {"static_verified": DecodeLog(), "static_gated": DecodeLog()}

    def verified(name: str, gate: float | None) -> torch.Tensor:
        sc = Scorer(model)
        with evaluating(model):
            return static_local(sc, ids, n, batch=args.batch, targets=truth if args.train else None,
                                log=logs[name], backend=args.backend, check_below=gate)

    gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=0,
               attention_mask=torch.ones_like(ids))
    arms = {
        "hf_generate": lambda: model.generate(ids, **gen)[:, args.prefix:],
        "hf_static": lambda: model.generate(ids, cache_implementation="static", **gen)[:, args.prefix:],
        "greedy_generate": lambda: greedy_generate(model, ids, n),
        "static_compiled": lambda: static_greedy_generate(model, ids, n, backend=args.backend),
        "static_verified": lambda: verified("static_verified", None),
        "static_gated": lambda: verified("static_gated", args.gate),
    }
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ref = greedy_generate(model, ids, n)
    hf_ref = None
    rows = {}
    for name in args.arms.split(","):
        sync()
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                out = arms[name]()
        except Exception as e:  # an arm that cannot run here is reported, the others still run
            print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            continue
        sync()
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.reps):
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = arms[name]()
            sync()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        if name == "hf_generate":
            hf_ref = out
        same = int((out == ref).all(dim=1).sum())
        same_hf = int((out == hf_ref).all(dim=1).sum()) if hf_ref is not None else None
        rows[name] = {"first_s": first, "median_s": med, "seq_per_s": args.batch / med,
                      "rows_identical": same, "rows_identical_hf_generate": same_hf, "rows": args.batch,
                      "rows_equal_truth": int((out == truth).all(dim=1).sum())}
        vs_hf = f", HF generate's in {same_hf}/{args.batch}" if same_hf is not None else ""
        print(f"{name:<16} {args.batch / med:9,.0f} seq/s  (median {med:.3f} s, first call {first:.1f} s)  "
              f"tokens identical to greedy_generate's in {same}/{args.batch} rows{vs_hf}", flush=True)
        if name in logs:
            calls, log = 1 + args.reps, logs[name]
            rows[name]["decode_log"] = log.to_dict()
            print(f"{name}: per call {log.rows // calls} rows, {log.checked // calls} checked, "
                  f"{log.redecoded // calls} decoded again (first: {log.disagreements[:5]}); "
                  f"largest |compiled - eager| smallest top-2 gap of a passing row: {log.gap_shift_max:.4f}",
                  flush=True)
        common.report(f"decode_{name}_seq_per_s", args.batch / med)
    base = rows.get("hf_static", {}).get("median_s")
    eager = rows.get("hf_generate", {}).get("median_s")
    for name in ("greedy_generate", "static_compiled", "static_verified", "static_gated"):
        if "median_s" in rows.get(name, {}):
            if base:
                common.report(f"decode_{name}_vs_hf_static", base / rows[name]["median_s"])
            if eager:
                common.report(f"decode_{name}_vs_hf_generate", eager / rows[name]["median_s"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "machine": common.machine(), "arms": rows,
         "shape": dataclasses.asdict(shape), "train_loss": loss},
        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Extraction-style decoding on one GPU: our decoders beside HF `generate`, tokens compared row by row.

A random-init Llama of a zoo shape (default llama-1b) in bf16, batch 256, 32-token prefixes, 32 new
tokens, greedy, no EOS. Arms, in one process on the same prefixes:
  hf_generate         model.generate(do_sample=False)
  hf_static           model.generate(..., cache_implementation="static") (transformers compiles its step)
  greedy_generate     evals.decoding.greedy_generate (preallocated dynamic cache, eager)
  static_compiled     evals.static_decode.static_greedy_generate (static cache, compiled decode step:
                      CUDA graphs on a GPU)
Each arm runs once untimed (its compile, reported as first_s), then --reps timed calls (median):
sequences/s, and whether its tokens equal greedy_generate's in every row.

    python benchmarks/bench_decode.py [--model llama-1b] [--batch 256] [--reps 3] [--out DIR]
CPU dry run: python benchmarks/bench_decode.py --device cpu --model tiny --batch 4 --new 6 --reps 1 \
                 --backend eager
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import common
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from axonn.plan.shapes import load_shape
from evals.decoding import greedy_generate
from evals.static_decode import static_greedy_generate


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


def main(argv: list[str] | None = None) -> int:
    """Time every arm, print the table and `decode_*` lines, write decode.json."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of static_compiled")
    ap.add_argument("--arms", default="hf_generate,hf_static,greedy_generate,static_compiled")
    ap.add_argument("--out", type=Path, default=common.RESULTS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_decode: error: no CUDA device (use --device cpu for a dry run)")
        return 2
    cuda = args.device == "cuda"
    shape = load_shape(args.model)
    model = build(shape, args.prefix + args.new, args.device, torch.bfloat16 if cuda else torch.float32)
    ids = torch.randint(0, shape.vocab, (args.batch, args.prefix), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(1))
    n = args.new
    gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=0,
               attention_mask=torch.ones_like(ids))
    arms = {
        "hf_generate": lambda: model.generate(ids, **gen)[:, args.prefix:],
        "hf_static": lambda: model.generate(ids, cache_implementation="static", **gen)[:, args.prefix:],
        "greedy_generate": lambda: greedy_generate(model, ids, n),
        "static_compiled": lambda: static_greedy_generate(model, ids, n, backend=args.backend),
    }
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ref = greedy_generate(model, ids, n)
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
        same = int((out == ref).all(dim=1).sum())
        rows[name] = {"first_s": first, "median_s": med, "seq_per_s": args.batch / med,
                      "rows_identical": same, "rows": args.batch}
        print(f"{name:<16} {args.batch / med:9,.0f} seq/s  (median {med:.3f} s, first call {first:.1f} s)  "
              f"tokens identical to greedy_generate in {same}/{args.batch} rows", flush=True)
        common.report(f"decode_{name}_seq_per_s", args.batch / med)
    base = rows.get("hf_static", {}).get("median_s")
    eager = rows.get("hf_generate", {}).get("median_s")
    for name in ("greedy_generate", "static_compiled"):
        if "median_s" in rows.get(name, {}):
            if base:
                common.report(f"decode_{name}_vs_hf_static", base / rows[name]["median_s"])
            if eager:
                common.report(f"decode_{name}_vs_hf_generate", eager / rows[name]["median_s"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "machine": common.machine(), "arms": rows},
        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

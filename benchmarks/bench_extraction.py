"""Benchmark: our extraction decoders vs HF `model.generate` at equal batch, identical tokens.

Prints `extraction_vs_hf_generate: <speed ratio>` (HF seconds / our seconds, > 1 means ours is
faster) for the plain KV-cache greedy decoder on a random model, `extraction_verified_random_vs_hf_generate`
for the target-verified decoder that `evals.extract` uses (its worst case: nothing memorized), and,
with `--model DIR` (a trained model, e.g. runs/demo/standard/model), `extraction_trained_vs_hf_generate`
on that model's real training documents. Writes the measurements as JSON to --out.

    python benchmarks/bench_extraction.py [--device cpu|cuda] [--reps 5] [--model DIR --corpus wiki-leads]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from data_pipelines import load_corpus  # noqa: E402
from evals.decoding import greedy_generate, verified_greedy  # noqa: E402


def build_model(device: str, seed: int) -> LlamaForCausalLM:
    """A random-init 4-layer Llama (hidden 256, vocab 4096) with no EOS, so generate never stops."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).to(device).eval()


def timed(fn, device: str) -> tuple[float, float, torch.Tensor]:
    """Wall and process-CPU seconds of one call (synchronizing CUDA) and its result.

    CPU time is reported too because on a shared machine other processes inflate wall time.
    """
    if device == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0, out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (ignored on CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a trained HF model dir to benchmark on real documents")
    ap.add_argument("--corpus", default="wiki-leads", help="documents for --model (its training corpus)")
    ap.add_argument("--out", default="benchmarks/results/extraction.json")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    model = build_model(args.device, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prefixes = torch.randint(0, 4096, (args.batch, args.prefix_len), generator=gen).to(args.device)
    mask = torch.ones_like(prefixes)
    new = args.new_tokens

    def ours() -> torch.Tensor:
        return greedy_generate(model, prefixes, new)

    def hf() -> torch.Tensor:
        with torch.inference_mode():
            out = model.generate(prefixes, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=0)
        return out[:, prefixes.shape[1]:]

    ours(), hf()  # warm-up: first calls pay for lazy init and kernel selection
    t_ours, t_hf, c_ours, c_hf = [], [], [], []
    identical = True
    for _ in range(args.reps):  # interleaved so drift in machine load hits both alike
        dt, ct, a = timed(ours, args.device)
        t_ours.append(dt)
        c_ours.append(ct)
        dt, ct, b = timed(hf, args.device)
        t_hf.append(dt)
        c_hf.append(ct)
        identical &= bool(torch.equal(a, b))
    med_ours, med_hf = statistics.median(t_ours), statistics.median(t_hf)
    ratio = med_hf / med_ours
    cpu_ratio = statistics.median(c_hf) / statistics.median(c_ours)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    result = {
        "benchmark": "extraction_vs_hf_generate",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"device": args.device, "name": device_name, "platform": platform.platform(),
                    "threads": torch.get_num_threads() if args.device == "cpu" else None},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "shape": {"batch": args.batch, "prefix_len": args.prefix_len, "new_tokens": new,
                  "hidden": 256, "layers": 4, "vocab": 4096},
        "reps": args.reps,
        "seconds_ours": t_ours,
        "seconds_hf_generate": t_hf,
        "median_seconds_ours": med_ours,
        "median_seconds_hf_generate": med_hf,
        "tokens_per_second_ours": args.batch * new / med_ours,
        "tokens_per_second_hf_generate": args.batch * new / med_hf,
        "speed_ratio": ratio,
        "cpu_seconds_ours": c_ours,
        "cpu_seconds_hf_generate": c_hf,
        "cpu_time_speed_ratio": cpu_ratio,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "tokens_identical": identical,
    }
    targets = torch.randint(0, 4096, (args.batch, new), generator=gen).to(args.device)
    result["verified_random"] = _compare(model, prefixes, targets, args)
    if args.model:
        result["trained"] = _trained(args)
    print(f"ours: {med_ours * 1e3:.1f} ms  hf_generate: {med_hf * 1e3:.1f} ms  "
          f"(median of {args.reps}, batch {args.batch}, {new} new tokens, {args.device})")
    print(f"tokens_identical: {identical}")
    print(f"extraction_vs_hf_generate: {ratio:.2f}")
    print(f"extraction_vs_hf_generate_cpu_time: {cpu_ratio:.2f}")
    for key in ("verified_random", "trained"):
        if key in result:
            r = result[key]
            identical &= r["tokens_identical"]
            print(f"extraction_{key}_vs_hf_generate: {r['speed_ratio']:.2f}  (tokens identical: "
                  f"{r['tokens_identical']}, verbatim rows: {r['verbatim_rows']}/{r['rows']})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if identical else 1


def _hf_generate(model, prefixes: torch.Tensor, new: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model.generate(prefixes, attention_mask=torch.ones_like(prefixes), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None)
    return out[:, prefixes.shape[1]:]


def _compare(model, prefixes: torch.Tensor, targets: torch.Tensor, args) -> dict:
    """Median seconds of verified_greedy vs HF generate, interleaved, and whether tokens agree."""
    new = targets.shape[1]
    ours = lambda: verified_greedy(model, prefixes, targets)  # noqa: E731
    hf = lambda: _hf_generate(model, prefixes, new)  # noqa: E731
    ours(), hf()
    t_ours, t_hf, identical, out = [], [], True, None
    for _ in range(args.reps):
        dt, _, out = timed(ours, args.device)
        t_ours.append(dt)
        dt, _, ref = timed(hf, args.device)
        t_hf.append(dt)
        identical &= bool(torch.equal(out, ref))
    verbatim = int((out == targets).all(dim=1).sum())
    return {"rows": int(prefixes.shape[0]), "verbatim_rows": verbatim, "seconds_ours": t_ours,
            "seconds_hf_generate": t_hf, "tokens_identical": identical,
            "speed_ratio": statistics.median(t_hf) / statistics.median(t_ours)}


def _trained(args) -> dict:
    """The trained model on the first documents of its corpus (prefix = first P tokens)."""
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval()
    need = args.prefix_len + args.new_tokens
    docs = [tok(d.text)["input_ids"] for d in load_corpus(args.corpus)]
    rows = torch.tensor([d[:need] for d in docs if len(d) >= need][:args.batch]).to(args.device)
    out = _compare(model, rows[:, :args.prefix_len], rows[:, args.prefix_len:], args)
    out["model"] = str(args.model)
    return out


if __name__ == "__main__":
    sys.exit(main())

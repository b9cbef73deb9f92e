"""Benchmark: `memorize scan` (greedy only, and with 3 sampling schemes) vs a bare teacher-forced forward
loop and vs HF `generate`.

Per round, on the same model and the same windows, batch for batch:
  scan       `memorization.scan.scanner.run_scan` with `--sampling ''` (the command's own path: the source
             read and cut into windows, one forward per batch through the scoring layer, every metric,
             Parquet parts and the state file written); its loop time (`scan_seconds`: model loading and
             the report excluded)
  sampled    the same scan with the 3 default --sampling schemes (evals.sampling.DEFAULT_SCHEMES): each
             row's log p_z per scheme from the same forward
  forward    the bare loop: `model(ids[:, :-1], logits_to_keep=S).logits.argmax(-1) == suffix`
  generate   HF `model.generate` greedy, S new tokens (KV cache), then `== suffix`
Prints `scan_vs_forward` (sequences/s of the scan / of the bare loop: the target is >= 0.9, i.e.
reading, selecting and writing cost <= 10%), `sampled_vs_scan` (sequences/s of the scan with 3 schemes /
greedy only: the target is >= 0.9) and `scan_vs_generate`, medians over rounds of the per-round ratios
(benchmarks/common.py), and each arm's sequences/s.

    python benchmarks/bench_scan.py --model tiny --rows 4096 --batch 64
    python benchmarks/bench_scan.py --model smollm2 --rows 256 --batch 32   # the cached SmolLM2-135M
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import SMALL, report, write  # common puts the checkout on sys.path
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from data_pipelines.scan_windows import Selection, windows  # noqa: E402
from data_pipelines.token_sources import open_source  # noqa: E402
from evals.sampling import DEFAULT_SCHEMES  # noqa: E402
from memorization.models import folder_tokenizer, smollm2_dir  # noqa: E402
from memorization.scan.scanner import ScanOptions, run_scan  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import write_indexed  # noqa: E402 - the tests' writer of an indexed corpus


def model_folder(name: str, root: Path) -> Path:
    """The model's HF folder: SmolLM2-135M's cached conversion, or the SMALL random Llama saved here."""
    if name == "smollm2":
        return smollm2_dir()
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SMALL, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None})
    LlamaForCausalLM(cfg).save_pretrained(root / "model")
    return root / "model"


def data_spec(name: str, root: Path, rows: int, width: int, vocab: int) -> tuple[str, str]:
    """(--data, --offsets): Wikipedia leads through the model's tokenizer for SmolLM2, else an indexed
    file of random documents (one window each)."""
    if name == "smollm2":
        return "wiki-leads", "stride:32"
    docs = np.random.default_rng(0).integers(0, vocab, size=(rows, width)).tolist()
    write_indexed(root / "corpus", docs, np.uint16)
    return str(root / "corpus.bin"), "start"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=32)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-scan-"))
    try:
        folder = model_folder(args.model, root)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        p, s, width = args.prefix, args.suffix, args.prefix + args.suffix
        spec, offsets = data_spec(args.model, root, args.rows, width, model.config.vocab_size)
        source = open_source(spec, tokenizer=folder_tokenizer(str(folder)))
        sel = Selection(p, s, offsets=offsets, limit=args.rows)
        ids = torch.from_numpy(np.stack([w.tokens for w in windows(source, sel)]))
        batches = list(ids.split(args.batch))

        def scan(i: int, sampling: str = "") -> float:
            out = root / f"scan-{i}"
            r = run_scan(ScanOptions(model=str(folder), data=spec, out=str(out), prefix=p, suffix=s,
                                     offsets=offsets, limit=args.rows, batch_size=args.batch, progress=False,
                                     sampling=sampling))
            shutil.rmtree(out)
            return r["scan_seconds"]

        @torch.inference_mode()
        def forward() -> float:
            t = time.perf_counter()
            for b in batches:
                (model(input_ids=b[:, :-1], logits_to_keep=s).logits.argmax(-1) == b[:, p:]).all(1).tolist()
            return time.perf_counter() - t

        @torch.inference_mode()
        def generate() -> float:
            t = time.perf_counter()
            for b in batches:
                x = b[:, :p]
                g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=s,
                                   min_new_tokens=s, pad_token_id=0)
                (g[:, p:] == b[:, p:]).all(1).tolist()
            return time.perf_counter() - t

        fns = {"scan": scan, "sampled": lambda i: scan(i, DEFAULT_SCHEMES), "forward": lambda _: forward()}
        if not args.skip_generate:
            fns["generate"] = lambda _: generate()
        fns["forward"](0)  # warm-up
        times: dict[str, list[float]] = {k: [] for k in fns}
        for rep in range(args.reps):
            for k, fn in (list(fns.items()) if rep % 2 == 0 else list(fns.items())[::-1]):
                times[k].append(fn(rep))
        n = len(ids)
        def per_round(arm: str, other: str) -> float:  # arm's sequences/s over other's, round by round
            return statistics.median(o / c for c, o in zip(times[arm], times[other]))

        ratios = {f"scan_vs_{k}": per_round("scan", k) for k in times if k not in ("scan", "sampled")}
        ratios["sampled_vs_scan"] = per_round("sampled", "scan")
        rates = {f"{k}_sequences_per_s": n / statistics.median(v) for k, v in times.items()}
        for k, v in {**ratios, **rates}.items():
            report(k, v)
        write(args.out, f"bench_scan_{args.model}.json",
              {"args": vars(args), "windows": n, "times_s": times, **ratios, **rates,
               "threads": torch.get_num_threads()})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

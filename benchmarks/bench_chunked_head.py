"""The LM head + cross-entropy's forward + backward, three ways, alternated in one process:

  full       logits = h @ W^T, F.cross_entropy(sum), backward (what plain PyTorch runs)
  per-token  axonn's chunked head, per-token CE summed (its backward recomputes each chunk's logits:
             four head GEMMs)
  sum        axonn's chunked head for a summed loss (the trainer's default: each chunk's gradient
             formed in forward, three head GEMMs, no recompute)

Reports the median step of each and the ratios sum / per-token and sum / full, with the loss and
gradients of `sum` checked against `full` first. The default shape is SmolLM2-135M's head (hidden
576, vocab 49,152) over 8 x 256 tokens in fp32; --device cuda (bf16 autocast) on a GPU.

    python benchmarks/bench_chunked_head.py [--tokens 2048] [--hidden 576] [--vocab 49152] \
        [--chunk 512] [--reps 10] [--threads 1] [--device cpu] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib

import common
import torch
import torch.nn.functional as F

from axonn.grid import ProcessGrid
from axonn.layers.chunked_ce import chunked_cross_entropy, chunked_cross_entropy_sum


def main(argv: list[str] | None = None) -> int:
    """Time the three heads; print and write the medians and ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49_152)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, generator=g).to(dev).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(dev).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(dev)
    grid = ProcessGrid.serial(device=args.device)
    cuda = dev.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def full() -> torch.Tensor:
        with amp():
            loss = F.cross_entropy((h @ w.t()).float(), t, reduction="sum")
        loss.backward()
        return loss

    def per_token() -> torch.Tensor:
        with amp():
            loss = chunked_cross_entropy(h, w, t, grid, args.chunk).sum()
        loss.backward()
        return loss

    def summed() -> torch.Tensor:
        with amp():
            loss = chunked_cross_entropy_sum(h, w, t, grid, args.chunk)[0]
        loss.backward()
        return loss

    grads = {}
    for name, fn in (("full", full), ("sum", summed)):
        h.grad = w.grad = None
        loss = fn()
        grads[name] = (loss.item(), h.grad.clone(), w.grad.clone())
    rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads["sum"][1:], grads["full"][1:]))
    print(f"loss full {grads['full'][0]:.6f}, sum {grads['sum'][0]:.6f}; gradients rel diff {rel:.2e}")

    def timed(fn):
        def run() -> None:
            h.grad = w.grad = None
            fn()
            sync()
        return run
    res = common.alternate({"full": timed(full), "per-token": timed(per_token), "sum": timed(summed)},
                           args.reps, warmup=1)
    for k, v in res.items():
        print(f"{k:<10} {v['median_s'] * 1e3:8.1f} ms (CPU {v['cpu_median_s'] * 1e3:.1f} ms)")
    out = {"sum_vs_per_token": common.ratio(res, "sum", "per-token"),
           "sum_vs_full": common.ratio(res, "sum", "full")}
    for k, v in out.items():
        common.report(k, v)
    common.write(args.out, "chunked_head.json", {"args": vars(args), "grad_rel_diff": rel, "ratios": out,
                                                 "results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

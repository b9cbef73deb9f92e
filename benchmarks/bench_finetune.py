"""Benchmark the SmolLM2-135M fine-tuning step: our Trainer against a plain HF + torch AdamW loop.

Both paths start from the same pretrained weights (fp32, CPU) and train on the same batch of real
wiki-leads rows tokenized by the model's own tokenizer (B x T, default 8 x 64 like
configs/train/smollm2-wiki.yaml):

  ours      `Trainer.train_step` as `memorize train --grid 1,1,1,1` runs it (serial: no engine)
  plain     `model(input_ids, labels=labels).loss.backward()`, `clip_grad_norm_`, `AdamW.step()`,
            `zero_grad()` with the same lr, betas, weight decay and clip (no lr schedule, so the two
            runs agree on step 1's loss only; the work per step is the same)
  goldfish  `Trainer.train_step` with the goldfish transform (k=4, h=13), unless --no-goldfish

It first checks that the first step's loss (and gradient norm) of ours and plain agree, then times
the variants alternated round by round (`common.alternate`) and prints tokens/s and the ratios
ours/plain and goldfish/ours (median of per-round ratios; ratio of medians in the JSON). Peak RSS:
each path's training run in its own subprocess (`--child ours|plain`: model, data, optimizer,
`--rss-steps` steps; VmHWM), and with --with-cli of the whole `memorize train CONFIG --steps N`
(training, export, evals). One torch thread by default (--threads): on a shared 2-core host two
threads wait on each other. Writes benchmarks/results/bench_finetune.json.

    python benchmarks/bench_finetune.py [--reps 6] [--batch 8] [--seq 64] [--rss-steps 2] [--with-cli]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import common
import torch
import yaml
from common import ROOT, alternate, peak_rss, ratio, report

from axonn.config import to_dict
from axonn.loop_state import epoch_order
from axonn.trainer import Trainer
from memorization.config import load_run_config
from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform
from memorization.models import build_model
from memorization.train.pipeline import effective_trainer
from memorization.train.prepare import prepare_data

CONFIG = ROOT / "configs" / "train" / "smollm2-wiki.yaml"


def run_config(args: argparse.Namespace):
    """The fine-tuning RunConfig: the project's smollm2-wiki.yaml when present, else its equivalent."""
    over = [f"trainer.batch_size={args.batch}", f"data.block_len={args.seq}", "trainer.progress=false",
            "trainer.device=cpu"]
    if args.config and Path(args.config).is_file():
        return load_run_config(args.config, over), str(args.config)
    # the training-relevant part of configs/train/smollm2-wiki.yaml
    base = ["name=smollm2-wiki-bench", "model.name=smollm2-135m", "data.tokenizer=auto", "data.min_tokens=64",
            "data.held_out_limit=50", "trainer.lr=3e-4", "trainer.warmup_steps=5", "trainer.epochs=5",
            "eval.prefix=32", "eval.suffix=32", "eval.batch_size=16", "wandb.mode=disabled"]
    return load_run_config(None, base + over), None


def rows(cfg):
    """The training rows exactly as `memorize train` builds them (no held-out corpus needed here)."""
    cfg = replace(cfg, data=replace(cfg.data, held_out="", held_out_fraction=0.0))
    return prepare_data(cfg, check_lengths=False)


def load_model(cfg, vocab: int) -> torch.nn.Module:
    """The pretrained model as the pipeline loads it (fp32)."""
    return build_model(cfg.model.name, vocab_size=vocab, seed=cfg.seed, overrides=cfg.model.overrides)


def plain_optimizer(model: torch.nn.Module, t) -> torch.optim.Optimizer:
    """What a user writes: AdamW over all parameters with the trainer's lr, betas, weight decay."""
    return torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                             weight_decay=t.weight_decay)


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict,
               clip: float) -> tuple[float, float]:
    """HF forward with labels (its own shift and mean CE), backward, clip, AdamW, zero_grad."""
    model.train()
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), float(norm)


def trainer(cfg, data, transform=None):
    """A Trainer on a freshly loaded model, as run_training builds it for a serial grid."""
    return Trainer(load_model(cfg, len(data.tokenizer)), effective_trainer(cfg), data.train,
                   label_transform=transform)


def loss_check(cfg, ours, plain: torch.nn.Module, opt, batch: dict) -> dict[str, float]:
    """First step of both from the same weights on the same batch: loss and grad norm must agree."""
    st = ours.train_step(batch)
    ours_loss = st.loss_sum / max(st.supervised, 1)
    plain_loss, plain_norm = plain_step(plain, opt, batch, cfg.trainer.grad_clip)
    out = {"ours_loss": ours_loss, "plain_loss": plain_loss,
           "loss_rel_diff": abs(ours_loss - plain_loss) / abs(plain_loss),
           "ours_grad_norm": st.grad_norm, "plain_grad_norm": plain_norm,
           "grad_norm_rel_diff": abs(st.grad_norm - plain_norm) / abs(plain_norm)}
    print(f"first-step loss: ours {ours_loss:.7f}  plain {plain_loss:.7f}"
          f"  rel diff {out['loss_rel_diff']:.2e}"
          f"  (grad norm {st.grad_norm:.5f} vs {plain_norm:.5f}, rel diff {out['grad_norm_rel_diff']:.2e})",
          flush=True)
    return out


def timing(args: argparse.Namespace, cfg, data) -> dict[str, Any]:
    """Loss check, then ours / plain (/ goldfish) alternated round by round."""
    batch = data.train[torch.arange(cfg.trainer.batch_size)]
    t0 = time.perf_counter()
    ours = trainer(cfg, data)
    plain = load_model(cfg, len(data.tokenizer))
    opt = plain_optimizer(plain, cfg.trainer)
    fns = {"plain": lambda: plain_step(plain, opt, batch, cfg.trainer.grad_clip),
           "ours": lambda: ours.train_step(batch)}
    if not args.no_goldfish:
        gf = trainer(cfg, data, GoldfishTransform(GoldfishConfig(enabled=True, k=4, h=13), seed=cfg.seed))
        fns["goldfish"] = lambda: gf.train_step(batch)
    print(f"loaded {len(fns)} models in {time.perf_counter() - t0:.1f} s", flush=True)
    check = loss_check(cfg, ours, plain, opt, batch)  # also the first warm-up step of both
    res = alternate(fns, args.reps, warmup=args.warmup)
    tokens = batch["input_ids"].numel()
    out = {"loss_check": check, "times": res, "tokens_per_step": tokens,
           "real_tokens_per_step": int((batch["labels"] != -100).sum()),
           "tokens_per_s": {k: tokens / v["median_s"] for k, v in res.items()},
           "ratios": {"ours_vs_plain": ratio(res, "ours", "plain"),
                      "ours_vs_plain_ratio_of_medians": res["ours"]["median_s"] / res["plain"]["median_s"],
                      "ours_vs_plain_cpu": res["ours"]["cpu_median_s"] / res["plain"]["cpu_median_s"]}}
    if "goldfish" in res:
        out["ratios"].update({
            "goldfish_vs_standard": ratio(res, "goldfish", "ours"),
            "goldfish_vs_standard_ratio_of_medians": res["goldfish"]["median_s"] / res["ours"]["median_s"]})
    return out


# -- peak RSS: one subprocess per path ------------------------------------------------------------
def child(args: argparse.Namespace) -> int:
    """`--child ours|plain`: load, train --rss-steps steps on the epoch's first batches, print a JSON line."""
    cfg, _ = run_config(args)
    cfg = replace(cfg, trainer=replace(cfg.trainer, max_steps=args.rss_steps))
    data = rows(cfg)
    t0 = time.perf_counter()
    if args.child == "ours":
        trainer(cfg, data).fit()
    else:
        model = load_model(cfg, len(data.tokenizer))
        opt = plain_optimizer(model, cfg.trainer)
        order, bs = epoch_order(len(data.train), cfg.seed, 0), cfg.trainer.batch_size
        for i in range(args.rss_steps):
            plain_step(model, opt, data.train[order[i * bs:(i + 1) * bs]], cfg.trainer.grad_clip)
    print(json.dumps({"child": args.child, "seconds": time.perf_counter() - t0}), flush=True)
    return 0


def rss(args: argparse.Namespace, cfg, config_path: str | None) -> dict[str, Any]:
    """Peak RSS of ours and plain (`--child`), then of the whole `memorize train` run."""
    me = [str(Path(__file__).resolve()), "--batch", str(args.batch), "--seq", str(args.seq),
          "--rss-steps", str(args.rss_steps), "--threads", str(args.threads), "--config", args.config or ""]
    out = {k: peak_rss(me + ["--child", k], args.threads) for k in ("ours", "plain")}
    if args.with_cli:
        with tempfile.TemporaryDirectory() as tmp:
            path = config_path
            if path is None:  # the project config is missing: run the equivalent one
                path = str(Path(tmp) / "smollm2-wiki.yaml")
                Path(path).write_text(yaml.safe_dump(to_dict(cfg)))
            out["memorize_train"] = peak_rss(["-m", "memorization", "train", path, "--steps",
                                              str(args.rss_steps), "--out", str(Path(tmp) / "run"),
                                              f"trainer.batch_size={args.batch}",
                                              f"data.block_len={args.seq}",
                                              "trainer.progress=false", "wandb.mode=disabled"], args.threads)
            out["memorize_train"]["config"] = config_path or "equivalent of configs/train/smollm2-wiki.yaml"
    return out


def table(t: dict[str, Any] | None, r: dict[str, Any] | None) -> None:
    """The summary table."""
    print("\n| path | step s (median) | tokens/s | ratio vs plain | peak RSS MiB |")
    print("|---|---|---|---|---|")
    for k in ("plain", "ours", "goldfish"):
        if (t is None or k not in t["times"]) and (r is None or k not in r):
            continue
        step = f"{t['times'][k]['median_s']:.3f}" if t and k in t["times"] else "-"
        tps = f"{t['tokens_per_s'][k]:.0f}" if t and k in t["times"] else "-"
        rt = "1" if k == "plain" else (
            f"{ratio(t['times'], k, 'plain'):.3f}" if t and k in t["times"] else "-")
        mem = f"{r[k]['peak_rss_mib']:.0f}" if r and k in r else "-"
        print(f"| {k} | {step} | {tps} | {rt} | {mem} |")
    if r and "memorize_train" in r:
        print(f"| `memorize train --steps` (whole run) | - | - | - "
              f"| {r['memorize_train']['peak_rss_mib']:.0f} |")
    print(flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6, help="timed rounds (each runs every variant once)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds after the loss check")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for every path (0: torch's default, as memorize train); one thread "
                         "keeps the ratio stable on a shared 2-core host")
    ap.add_argument("--config", default=str(CONFIG), help="run config (its equivalent is built when missing)")
    ap.add_argument("--no-goldfish", action="store_true", help="skip the goldfish variant")
    ap.add_argument("--rss-steps", type=int, default=2, help="steps of each peak-RSS subprocess")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--with-cli", action="store_true",
                    help="also the peak RSS of the whole `memorize train CONFIG --steps N` (evals: +3 min)")
    ap.add_argument("--child", choices=("ours", "plain"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        return child(args)
    cfg, config_path = run_config(args)
    load_start = os.getloadavg()
    print(f"config: {config_path or 'built-in equivalent (' + str(CONFIG.relative_to(ROOT)) + ' missing)'}; "
          f"batch {cfg.trainer.batch_size} x {cfg.data.block_len}, lr {cfg.trainer.lr}, "
          f"wd {cfg.trainer.weight_decay}, clip {cfg.trainer.grad_clip}, threads {torch.get_num_threads()}, "
          f"load {load_start}", flush=True)
    t = r = None
    if not args.skip_timing:
        data = rows(cfg)
        t = timing(args, cfg, data)
        for name, value in t["ratios"].items():
            report(name, value)
        for k, v in t["tokens_per_s"].items():
            report(f"tokens_per_s_{k}", v)
        del data
    if not args.skip_rss:
        r = rss(args, cfg, config_path)
        for k, v in r.items():
            report(f"peak_rss_mib_{k}", v["peak_rss_mib"])
    table(t, r)
    common.write(args.out, "bench_finetune.json", {  # machine() adds the load average at the end
        "args": vars(args), "config": config_path, "trainer": vars(cfg.trainer), "timing": t, "rss": r,
        "loadavg_start": load_start, "threads": torch.get_num_threads(),
        "spread": {k: statistics.pstdev(v["wall_s"]) for k, v in t["times"].items()} if t else None})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`axonn-plan`: rank every (x, y, z, data) for a model on a machine by predicted step time."""
from __future__ import annotations

import argparse
import json
import sys

from axonn.config import check_loss_chunk
from axonn.plan.calibrate import get_hardware
from axonn.plan.hardware import hardware_choices
from axonn.plan.memory import Adapters
from axonn.plan.model import Prediction
from axonn.plan.search import plan, runnable_batch
from axonn.plan.shapes import load_shape
from memorize_core import ConfigError


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _loss_chunk(text: str) -> int | str:
    """--loss-chunk as trainer.loss_chunk takes it: auto, off or a positive integer."""
    value: int | str = int(text) if text.strip().lstrip("-").isdigit() else text
    try:
        check_loss_chunk(value, "--loss-chunk")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments."""
    p = _Parser(prog="axonn-plan", description=__doc__)
    p.add_argument("--model", required=True,
                   help="zoo name (llama-405b, ...), gpt-5b..gpt-320b, or an HF config.json/YAML")
    p.add_argument("--gpus", type=int, required=True, help="total GPUs")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the preset's")
    p.add_argument("--hardware", default="h100", help=f"one of {', '.join(hardware_choices())}")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--global-batch", type=int, default=512, help="sequences per step")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows per rank per micro-batch (default: the largest that fits)")
    p.add_argument("--checkpoint-activations", action=argparse.BooleanOptionalAction,
                   default=None, help="force activation checkpointing on/off (default: try both)")
    p.add_argument("--no-overlap", action="store_true",
                   help="model every collective as blocking (no prefetch / async overlap)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of GPU memory kept free for the allocator, context, NCCL")
    p.add_argument("--mode", choices=["paired", "easy"], default=None,
                   help="engine layout (default: paired for Llama-family/GPT-family shapes)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="the trainer's precision: bf16 autocast (GPUs, default) or fp32 (CPU)")
    p.add_argument("--loss-chunk", type=_loss_chunk, default="auto", metavar="auto|off|N",
                   help="the trainer's LM head (trainer.loss_chunk): auto (its default: chunked cross-entropy"
                        " when the logits are large), off (full logits) or N tokens per chunk")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help="plan a LoRA run (model.lora): a frozen base with rank-R adapters on every block "
                        "linear; only the adapters carry gradients and optimizer state")
    p.add_argument("--lora-targets", default="", metavar="NAMES",
                   help="with --lora: comma-separated block linears adapted (q_proj,v_proj,...; default all)")
    p.add_argument("--strict", action="store_true",
                   help="only grids where z divides every weight shard and z*data the batch")
    p.add_argument("--top", type=int, default=10, help="rows to show")
    p.add_argument("--all", action="store_true", help="also list configurations that do not fit")
    p.add_argument("--json", action="store_true", help="print a JSON list, best first")
    p.add_argument("--recalibrate", action="store_true", help="re-measure the `local` profile")
    return p


def _num(v: float, width: int) -> str:
    """Fixed width; three significant digits for small values (the `local` profile's TF/s)."""
    return f"{v:>{width}.1f}" if abs(v) >= 10 or v == 0 else f"{v:>{width}.3g}"


def _sec(v: float, width: int) -> str:
    return f"{v:>{width}.3f}" if v >= 0.01 or v == 0 else f"{v:>{width}.3g}"


def format_table(rows: list[Prediction], peak_note: str = "", global_batch: int | None = None) -> str:
    """A fixed-width table of predictions (* = uneven batch split over Z, see --strict)."""
    head = (f"{'#':>3} {'x':>4} {'y':>4} {'z':>4} {'data':>5} {'mb':>4} {'ckpt':>4} "
            f"{'time_s':>9} {'exposed_s':>9} {'mem_GB':>7} {'TF/s/gpu':>9} {'%peak':>6} "
            f"{'PF/s':>9}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        note = ("" if r.fits else "  (does not fit)") + ("" if r.even_batch else " *")
        lines.append(
            f"{i:>3} {r.x:>4} {r.y:>4} {r.z:>4} {r.data:>5} {r.micro_batch:>4} "
            f"{'on' if r.checkpoint_activations else 'off':>4} {_sec(r.time_s, 9)} "
            f"{_sec(r.exposed_comm_s, 9)} {_num(r.memory_gb, 7)} {_num(r.tflops_per_gpu, 9)} "
            f"{r.pct_peak:>6.1f} {_num(r.pflops, 9)}{note}")
    if any(not r.even_batch for r in rows):
        lines.append("* z*data does not divide the global batch: the busiest Z rank gets "
                     "ceil(batch/data/z) rows (the engine's shard_batch needs --strict grids)")
    if rows and global_batch and not any(r.even_batch for r in rows):
        lines.append(f"none of these grids runs as is (z*data must divide the global batch): try "
                     f"--global-batch {runnable_batch(rows, global_batch)} with --strict")
    if peak_note:
        lines.append(peak_note)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 on bad input, one line on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        if args.top < 1:
            raise ConfigError(f"top={args.top!r}: must be a positive integer")
        shape = load_shape(args.model)
        hw = get_hardware(args.hardware, recalibrate=args.recalibrate)
        adapters = None
        if args.lora is not None:
            if args.lora < 1:
                raise ConfigError(f"lora={args.lora!r}: the adapters' rank must be >= 1, e.g. 16")
            targets = tuple(t for t in args.lora_targets.split(",") if t)
            # the frozen base in the compute dtype, as the trainer loads it (bf16 on GPUs)
            frozen = 2 if args.precision == "bf16" else 4
            adapters = Adapters(rank=args.lora, targets=targets, frozen_bytes=frozen)
        elif args.lora_targets:
            raise ConfigError(f"lora_targets={args.lora_targets!r}: needs --lora R")
        rows = plan(shape, args.gpus, args.gpus_per_node, args.seq, args.global_batch, hw, adapters=adapters,
                    checkpoint=args.checkpoint_activations, overlap=not args.no_overlap,
                    headroom=args.headroom, micro_batch=args.micro_batch,
                    include_unfit=args.all, strict=args.strict,
                    mode=args.mode, precision=args.precision, loss_chunk=args.loss_chunk)
    except ConfigError as e:
        sys.stderr.write(f"axonn-plan: error: {e}\n")
        return 2
    top = rows[: args.top]
    if args.json:
        print(json.dumps([r.as_dict() for r in top], indent=1))
        return 0
    gpn = hw.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
    print(f"{shape.name}: {shape.params / 1e9:.3g}B params, {rows[0].mode} mode; "
          f"{args.gpus} x {hw.name} "
          f"({gpn}/node); seq {args.seq}, global batch {args.global_batch}; "
          f"overlap {'off' if args.no_overlap else 'on'}; "
          f"{sum(r.fits for r in rows)} configurations fit")
    print(format_table(top, f"peak {hw.peak_flops / 1e12:.4g} TF/s per GPU; "
                            f"memory {hw.memory_bytes / 2**30:.0f} GB, headroom "
                            f"{args.headroom:.0%}", args.global_batch))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

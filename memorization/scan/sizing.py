"""`memorize scan --dry-run --world N --hardware PRESET`: size a corpus scan on a cluster, run nothing.

The grid is the one the launched scan takes (`--grid`, or `auto`: the planner's fastest fitting grid
for the scan's P + S tokens, as `memorize eval --grid auto` asks it), checked against the model's
heads, hidden size, FFN and vocabulary. Per-rank memory and time come from the planner's evaluation
model (axonn/plan/evaluation.py): weights as the engine holds them (fp32), no optimizer state, the
activations of one forward over P + S tokens for this rank's share of a batch (the batch is split
over the Z x data shards), the suffix's fp32 logits; time = one compute-bound forward of P + S tokens
per batch (a prefill, no decode step: that is the whole point of the scan). The model is a folder
(its config.json) or a zoo name (configs/models, e.g. llama-70b). The window count is --limit, or
counted from a local token file's index (one window per document with --offsets start).
"""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
from collections.abc import Sequence
from typing import Any

from axonn.plan import get_hardware, load_shape
from axonn.plan.choose import Inference, inference_cost
from axonn.plan.volumes import Grid
from data_pipelines.scan_windows import Selection, check_selection, parse_offsets
from data_pipelines.token_sources import open_source
from memorization.models import pretrained_config, resolve_model_dir, zoo_config
from memorization.train.parallel import Launch, plan_inference, precision_for
from memorize_core import fail

GiB = 2**30


def _config(model: str) -> Any:
    return pretrained_config(model) if resolve_model_dir(model) is not None else zoo_config(model)


def count_windows(args: Any) -> int:
    """--limit, or the windows of a local token file with --offsets start (one per sequence)."""
    if args.limit is not None:
        return args.limit
    if args.data and parse_offsets(args.offsets)[0] == "start":
        try:
            source = open_source(args.data, dtype=args.dtype)
        except Exception:  # text needs the model's tokenizer: not counted here
            source = None
        if source is not None and source.num_documents is not None and source.kind != "text":
            if args.seq_len is None:
                return source.num_documents
            tokens = sum(len(t) for _, t in source.documents())
            return math.ceil(tokens / args.seq_len)
    raise fail("--limit", None, "a dry run needs the number of windows to scan: pass --limit N (e.g. "
               "--limit 1000000), or --data a local token file with --offsets start")


def _cost(shape: Any, g: Grid, hw: Any, *, batch: int, width: int, suffix: int, mode: str, windows: int,
          gpus_per_node: int) -> tuple[dict[str, float], dict[str, float], str]:
    """(rank-0 bytes by category, the planner's time, precision) of scanning on grid `g`: the one
    chooser's inference cost (axonn.plan.choose), so what the dry run prints is what chose the grid."""
    precision = precision_for("auto", hw)
    obj = Inference(batch=batch, width=width, suffix=suffix, windows=windows, precision=precision)
    mem, t = inference_cost(shape, g, hw, obj, mode=mode, gpus_per_node=gpus_per_node)
    return mem, t, precision


def scan_dry_run(args: Any) -> dict[str, Any]:
    """The scan's grid, per-rank memory and predicted time on `--world` GPUs of `--hardware`."""
    if args.world is None or args.world < 1:
        raise fail("--world", args.world, "--dry-run needs the job's GPU count, e.g. --world 8")
    sel = Selection(args.prefix, args.suffix, args.seq_len, args.offsets, args.seed, args.limit)
    check_selection(sel)
    from memorization.eval.sections import (  # deferred: evals' imports
        check_near_verbatim,
        parse_ns,
        parse_p,
        parse_sampling,
    )

    parse_sampling(getattr(args, "sampling", None))  # the launch would refuse them: so does its dry run
    parse_ns(getattr(args, "np_n", None))
    parse_p(getattr(args, "np_p", None))
    if getattr(args, "near_verbatim", None) is not None:
        from memorization.scan.near import check_nv_rows  # deferred: evals' imports

        check_near_verbatim(args)
        check_nv_rows(args)
    windows = count_windows(args)
    hw = get_hardware(args.hardware or "h100")
    world = args.world
    gpn = args.gpus_per_node or hw.gpus_per_node
    config = _config(args.model)
    shape = dataclasses.replace(load_shape(config), name=args.model)
    # the scan's own plan, on the dry run's launch (the launched scan makes it on its own)
    plan = plan_inference(config, spec=args.grid or "auto", model=args.model, batch=args.batch_size,
                          width=sel.width, suffix=args.suffix, mode=args.mode, windows=windows,
                          launch=Launch(world, gpn, hw))
    dims, chosen, mode = plan.dims, plan.chosen_by, plan.mode
    mem, t, precision = _cost(shape, Grid(*dims), hw, batch=args.batch_size, width=sel.width,
                              suffix=args.suffix, mode=mode, windows=windows, gpus_per_node=min(gpn, world))
    total = sum(mem.values())
    usable = hw.memory_bytes * 0.9
    if total > usable:
        raise fail("--batch-size", args.batch_size, f"the scan needs {total / GiB:.1f} GiB per GPU at grid "
                   f"{','.join(map(str, dims))} but {hw.name} has {usable / GiB:.1f} GiB usable; lower it or "
                   "use more GPUs")
    return {"model": args.model, "params": shape.params, "windows": windows, "prefix": args.prefix,
            "suffix": args.suffix, "batch": args.batch_size,
            "rows_per_rank": math.ceil(args.batch_size / (dims[2] * dims[3])),
            "grid": list(dims), "chosen_by": chosen, "mode": mode, "hardware": hw.name, "world": world,
            "gpus_per_node": gpn, "precision": precision,
            "rank0_bytes": {k: int(v) for k, v in mem.items()}, "rank0_total_gib": total / GiB,
            "usable_gib": usable / GiB, "predicted_s": t["seconds"],
            "sequences_per_s": windows / t["seconds"] if t["seconds"] else None,
            "near_verbatim": _near(args), "launch": launch_line(args, dims, min(gpn, world))}


def _near(args: Any) -> dict[str, Any] | None:
    """--near-verbatim's search, which the prediction leaves out (decode steps, not forwards)."""
    d = getattr(args, "near_verbatim", 0) or 0
    if not d:
        return None
    paths = 1 + d * args.nv_beams
    return {"max_edits": d, "beams": args.nv_beams, "distance": args.nv_distance, "rows": args.nv_rows,
            "paths": paths, "priced": False}


# the scan's options that change what it scores or how: the launch line repeats every one that is set
_CARRIED = ("prefix", "suffix", "seq_len", "offsets", "seed", "limit", "batch_size", "dtype", "count_key",
            "mode", "sampling", "np_n", "np_p")


def launch_line(args: Any, dims: Sequence[int], nproc: int) -> str:
    """The command that runs the scan this dry run sized: its grid and every option given."""
    words = ["torchrun", "--nproc-per-node", str(nproc), "-m", "memorization", "scan", "--model", args.model,
             "--data", args.data or "SOURCE"]
    for name in _CARRIED:
        value = getattr(args, name, None)
        if value is not None and (value != "" or name == "sampling"):  # --sampling '': greedy only
            words += [f"--{name.replace('_', '-')}", str(value)]
    if getattr(args, "near_verbatim", 0):
        words += ["--near-verbatim", str(args.near_verbatim), "--nv-beams", str(args.nv_beams),
                  "--nv-distance", args.nv_distance, "--nv-rows", str(args.nv_rows)]
    words += ["--grid", ",".join(map(str, dims)), "--out", args.out or "OUT"]
    return shlex.join(words)


def format_scan_plan(r: dict[str, Any]) -> str:
    """The dry run's text."""
    mem = ", ".join(f"{k} {v / GiB:.2f}" for k, v in r["rank0_bytes"].items())
    return "\n".join([
        f"memorize scan --dry-run: {r['model']} ({r['params'] / 1e9:.2f}B params), {r['windows']:,} windows "
        f"of {r['prefix']}+{r['suffix']} tokens",
        f"grid {','.join(map(str, r['grid']))} ({r['mode']}) on {r['world']} x {r['hardware']} "
        f"({r['gpus_per_node']} per node), chosen by {r['chosen_by']}",
        f"batch {r['batch']} ({r['rows_per_rank']} rows per batch shard), {r['precision']}",
        f"rank 0 memory: {r['rank0_total_gib']:.2f} GiB of {r['usable_gib']:.1f} usable ({mem} GiB)",
        f"predicted: {r['predicted_s']:.1f} s ({r['predicted_s'] / 3600:.2f} h), "
        f"{r['sequences_per_s']:,.0f} sequences/s",
        *([] if not r.get("near_verbatim") else [
            f"then the near-verbatim search of up to {r['near_verbatim']['rows']:,} windows (not in the "
            f"prediction): {r['suffix']} decode steps of {r['near_verbatim']['paths']} paths per window and "
            "scheme"]),
        f"launch: {r['launch']}"])


def cli_scan_dry_run(args: Any) -> int:
    """Print the scan's dry run (text, or JSON with --json); 0, or ConfigError."""
    if not args.dry_run:
        raise fail("--world", args.world, "sizes a scan without running it; add --dry-run")
    report = scan_dry_run(args)
    print(json.dumps(report, indent=1) if args.json else format_scan_plan(report))
    return 0


__all__ = ["cli_scan_dry_run", "count_windows", "format_scan_plan", "scan_dry_run"]

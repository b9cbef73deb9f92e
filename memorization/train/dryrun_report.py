"""The dry run's report as text: `format_report` turns memorization.train.dryrun.dry_run's dict (the run's
plan with its memory and time figures) into the short block `memorize train|run --dry-run` prints."""
from __future__ import annotations

from typing import Any

GiB = 2**30


def _count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def format_report(r: dict[str, Any]) -> str:
    """The dry run as a short human-readable block."""
    m, g, b, k, p = r["model"], r["grid"], r["batch"], r["rank0"], r["predicted"]
    ck = r["activation_checkpointing"]
    lines = [
        f"dry run: {r['name']} (memorize {r['command']} {r['config']})",
        f"  model      {m['name']}: {_count(m['params'])} parameters, {m['layers']} layers, hidden "
        f"{m['hidden']}, {m['heads']} heads / {m['kv_heads']} KV, FFN {m['ffn']}, vocab {m['vocab']} "
        f"({m['vocab_source']}); {m['mode']} mode",
        f"  grid       (x, y, z, data) = ({g['x']}, {g['y']}, {g['z']}, {g['data']}) on {g['world']} GPUs "
        f"= {g['nodes']} node(s) x {min(g['world'], g['gpus_per_node'])}; chosen by {g['chosen_by']}",
        *[f"  {'' if i else 'plan':<10} {line}" for i, line in enumerate(r.get("plan", {}).get("lines", []))],
        f"  batch      {b['global']} x {b['seq']} tokens; {b['rows_per_rank']} rows per rank = "
        f"{b['micro_batches']} micro-batch(es) of {b['micro_batch']}; {r['precision']} activations",
        f"  rank 0     parameters {k['params']:,} ({_gib(k['param_bytes'])}), gradients "
        f"{_gib(k['grad_bytes'])}, optimizer {_gib(k['optimizer_bytes'])}, Z buffers "
        f"{_gib(k['z_buffer_bytes'])}"
        + (f", DP-SGD per-example norm buffers {_gib(k['example_norm_bytes'])}" if k.get("example_norm_bytes")
           else "")
        + (f", DP-SGD per-sample gradients {_gib(k['example_grad_bytes'])}" if k.get("example_grad_bytes")
           else ""),
        f"             activations {_gib(k['activation_bytes']['checkpointing'])} with checkpointing"
        f"{' (on)' if ck else ''}, {_gib(k['activation_bytes']['no_checkpointing'])} without"
        f"{'' if ck else ' (on)'}",
        f"             total {_gib(k['total_bytes'])} of {_gib(r['hardware']['usable_bytes'])} usable on "
        f"{r['hardware']['name']}: fits",
        f"  predicted  {p['step_s']:.3g} s/step, {p['tokens_per_s']:,.0f} tokens/s, MFU "
        f"{p['mfu']:.1%} ({p['tflops_per_gpu']:.3g} TF/s per GPU)",
    ]
    best = r["planner_best"]
    if best and best["grid"] != [g["x"], g["y"], g["z"], g["data"]]:
        # another objective than the chosen grid's: training speed alone, micro-batch and checkpointing free
        lines.append(f"  planner    objective train, micro-batch free: fastest for {g['world']} GPUs: --grid "
                     f"{','.join(map(str, best['grid']))} "
                     f"trainer.micro_batch={best['micro_batch']} trainer.activation_checkpointing="
                     f"{str(best['activation_checkpointing']).lower()} ({best['step_s']:.3g} s/step)")
    ev = r.get("evaluation")
    if ev:
        b_ = ev["bytes"]
        lines.append(f"  evaluation rank 0 while scoring in place (eval.batch_size {ev['batch']}, "
                     f"{ev['prefix']}+{ev['suffix']} tokens): weights {_gib(b_['weights'])}, AdamW "
                     f"{_gib(b_['optimizer'])}, KV cache {_gib(b_['kv_cache'])}, Z buffers "
                     f"{_gib(b_['z_buffers'])}, logits {_gib(b_['logits'])}, activations "
                     f"{_gib(b_['activations'])}")
        lines.append(f"             total {_gib(ev['total_bytes'])}: fits; with weights kept gathered "
                     f"{_gib(ev['keep_gathered_bytes'])}"
                     f"{'' if ev['keep_gathered_fits'] else ' (does not fit)'}; "
                     f"extraction ~{ev['per_1000_docs_s']:.3g} s per 1,000 documents "
                     f"({ev['decode_tokens_per_s']:,.0f} decoded tokens/s)"
                     + (f"; MIA ~{ev['mia_per_1000_pairs_s']:.3g} s per 1,000 member/non-member pairs"
                        if ev["mia_per_1000_pairs_s"] is not None else ""))
    if r["weights"]:
        w = r["weights"]
        lines.append(f"  weights    {w['folder']}: {w['tensors']} tensors in {w['files']} file(s), "
                     f"{', '.join(w['dtypes'])}; all {w['checked']} this model needs match")
    lines.append(f"  checks     {'; '.join(r['checks'])}")
    for key in ("torchrun", "srun", "slurm"):
        if key in r["launch"]:
            lines.append(f"  {key:<10} {r['launch'][key]}")
    return "\n".join(lines)

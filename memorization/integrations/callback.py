"""Memorization measured inside the Hugging Face Trainer (and TRL's trainers, which are Trainers).

    cb = MemorizationCallback(tokenizer, members=train_texts, non_members=held_out_texts,
                              manifest=manifest, out_dir="runs/x/memorization")
    trainer = SFTTrainer(..., callbacks=[cb]); cb.attach(trainer); trainer.train()

Before training (pass 0) and at each epoch end (or every `every_steps` steps) the model being trained
is scored in place by `Probe` (probe.py: our evaluators, `memorize eval`'s settings), the figures go
out through `trainer.log` (so W&B, TensorBoard, ... get them as `report_to` says) and the main
process rewrites OUT's report files (report.py). Works on peft models (the evaluators unwrap them).
Under several processes (torchrun / accelerate, DDP) every process scores in lockstep on the 1,1,1,D
grid of replicas: each takes its share of the documents and all get every result, as `memorize`
runs do. A model sharded by FSDP or DeepSpeed ZeRO-3 is not supported (no process holds whole
layers for our scoring layer): training with either is refused at the start, in one line.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from axonn.grid import ProcessGrid
from memorization.eval.exposure import canary_ids, secret_start
from memorization.integrations.collator import GoldfishCollator
from memorization.integrations.probe import Probe
from memorization.integrations.report import FILES, flat_metrics, write_report
from memorization.mitigations.goldfish import mask_is_the_documents
from memorization.outputs import check_writable
from memorize_core import fail


def _grid() -> ProcessGrid | None:
    """The 1,1,1,D grid of DDP replicas under several processes; None (the model's own: serial) else."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ProcessGrid(1, 1, 1, dist.get_world_size())
    return None


_SHARDED_FIX = ("MemorizationCallback scores whole replicas (one process, DDP, peft); train without it, or "
                "evaluate the saved checkpoints with `memorize eval --grid` (which shards the model itself)")


def refuse_sharded(args: Any, trainer: Any = None) -> None:
    """One ConfigError when the Trainer shards the model (FSDP, DeepSpeed): our scoring needs whole layers."""
    if getattr(args, "fsdp", None) or getattr(trainer, "is_fsdp_enabled", False):
        raise fail("TrainingArguments.fsdp", getattr(args, "fsdp", None), _SHARDED_FIX)
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        raise fail("TrainingArguments.deepspeed", getattr(args, "deepspeed", None), _SHARDED_FIX)


class MemorizationCallback(TrainerCallback):
    """Score memorization in place before training and after each epoch (or every N steps)."""

    def __init__(self, tokenizer: Any, *, out_dir: str | Path | None = None, every_steps: int = 0,
                 before_training: bool = True, log_prefix: str = "memorization",
                 goldfish: GoldfishCollator | None = None, **probe: Any):
        """`probe` are Probe's settings (members, non_members, held_out, manifest, prefix, suffix, max_tokens,
        batch_size, mia_k, bootstrap, seed, reference, tasks, tasks_limit, num_fewshot, canary_candidates).
        `goldfish`: the collator whose mask groups the manifest's canaries into masked / unmasked (default:
        the Trainer's data_collator where it is a GoldfishCollator); pass a goldfish arm's collator to its
        standard-loss arm too, so both arms group the canaries alike (or set `callback.goldfish` before
        training, e.g. to wrap the collator the Trainer built)."""
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 0:
            raise fail("every_steps", every_steps, "pass 0 (score at each epoch end) or a step interval >= 1")
        if goldfish is not None and not isinstance(goldfish, GoldfishCollator):
            raise fail("goldfish", type(goldfish).__name__, "pass a GoldfishCollator (the one a goldfish arm "
                       "trains with), or leave it out to use the Trainer's")
        self.goldfish = goldfish
        self.probe = Probe(tokenizer, **probe)  # tokenizes and checks every set now
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if self.out_dir is not None:
            check_writable("out_dir", str(self.out_dir))
        self.every_steps, self.before_training, self.log_prefix = every_steps, before_training, log_prefix
        self.trainer: Any = None
        self.grid: ProcessGrid | None = None
        self.records: list[dict[str, Any]] = []
        self.last_results: list[Any] = []
        self.mask_note: str | None = None  # how the canaries were grouped by the goldfish mask, or why not

    def attach(self, trainer: Any) -> Any:
        """Bind to `trainer` (its `log` carries the metrics) and add the callback if it is not there yet."""
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return trainer

    # -- the Trainer's events --------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       **kwargs: Any) -> None:
        """Refuse what cannot be scored, then score pass 0 (the model before training)."""
        if self.trainer is None:
            raise fail("MemorizationCallback.trainer", None, "call callback.attach(trainer) before "
                       "trainer.train(): the metrics go out through trainer.log")
        refuse_sharded(args, self.trainer)
        self.probe.check_model(model)
        if self.probe.canary_items():
            self.probe.dropped, self.mask_note = secret_drops(self.trainer, self.probe, self.goldfish)
        self.grid = _grid()
        if self.before_training and state.global_step == 0:
            self._score(0, state, model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                    **kwargs: Any) -> None:
        """Every `every_steps` optimizer steps, when set."""
        if self.every_steps and state.global_step % self.every_steps == 0:
            self._score(state.global_step, state, model)

    def on_epoch_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                     **kwargs: Any) -> None:
        """After each pass over the data (unless scoring every N steps)."""
        if not self.every_steps:
            self._score(round(state.epoch or 0), state, model)

    # -- one scored pass ---------------------------------------------------------------------------
    def _score(self, label: int, state: Any, model: torch.nn.Module) -> None:
        t = time.perf_counter()
        record, self.last_results = self.probe.score(model, self.grid)  # every process, in lockstep
        record = {"pass": label, "step": state.global_step, **record, "seconds": time.perf_counter() - t}
        self.records.append(record)
        self.trainer.log(flat_metrics(record, self.log_prefix))
        if self.out_dir is not None and state.is_world_process_zero:
            write_report(self.out_dir, self.records, self.last_results, self.settings())

    def settings(self) -> dict[str, Any]:
        """What was asked, for report.json."""
        o, p = self.probe.options, self.probe
        sets = {n: len(s.corpus.seqs) for n, s in (("members", p.members), ("non_members", p.non_members),
                                                   ("held_out", p.held_out)) if s is not None}
        return {"prefix": o.prefix, "suffix": o.suffix, "max_tokens": p.max_tokens,
                "batch_size": o.batch_size, "mia_k": o.mia_k, "bootstrap": o.bootstrap, "seed": o.seed,
                "every_steps": self.every_steps, "sets": sets, "duplicates": len(p.duplicates),
                "canaries": len(p.canary_items()), "canary_mask": self.mask_note,
                "canaries_scored_as": _scored_as(p), "tasks": p.tasks,
                "grid": ",".join(map(str, self.grid.dims)) if self.grid is not None else "1,1,1,1",
                "files": list(FILES)}


def _scored_as(p: Probe) -> str | None:
    items = p.canary_items()
    if not items:
        return None
    return f"the answer to {items[0].prompt!r} in the chat template" if p.canary_encode else "text"


_ROW_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "seq_lengths", "completion_mask",
             "assistant_masks")  # what a causal-LM collator reads from a tokenized example


def _canary_rows(trainer: Any, probe: Probe) -> tuple[dict[str, dict[str, Any]] | None, str]:
    """(one training example per canary id, where it came from): the first copy's row of the Trainer's
    dataset (`doc_id` `<id>@0`, as inject_dataset names it, with `input_ids`: what TRL prepares unless it
    packs); for chat canaries in a tokenized dataset without doc_id (TRL packed it), each canary's
    sequence in the packed rows; else, for plain-text canaries, the canary's text through the tokenizer
    as it encodes a document."""
    items = probe.canary_items()
    ds = getattr(trainer, "train_dataset", None)
    cols = list(getattr(ds, "column_names", None) or [])
    if "doc_id" in cols and "input_ids" in cols:
        where = {d: i for i, d in enumerate(ds["doc_id"])}
        if all(f"{it.id}@0" in where for it in items):
            keep = [c for c in _ROW_KEYS if c in cols]
            return ({it.id: {c: ds[where[f"{it.id}@0"]][c] for c in keep} for it in items},
                    "the training rows of the canaries' first copies")
    if probe.canary_encode is not None and "input_ids" in cols:  # TRL tokenized, then packed (no doc_id)
        found = _packed_canary_rows(ds, items, probe.canary_encode([it.text for it in items]))
        if found is not None:
            return found, "the canaries' sequences in the Trainer's packed rows"
    if probe.canary_encode is not None or {"messages", "prompt", "completion"} & set(cols):
        return None, ("a conversational dataset without its doc_id column: the rows the canaries trained as "
                      "are unknown (keep inject_dataset's doc_id column to group them)")
    return ({it.id: {"input_ids": list(probe.tok(it.text)["input_ids"])} for it in items},
            "each canary's text as the tokenizer encodes a document")


def _packed_canary_rows(ds: Any, items: list[Any], ids: list[list[int]]) -> dict[str, dict[str, Any]] | None:
    """Each canary's first sequence in packed rows (cut at `seq_lengths`, else where `position_ids`
    restart, else the whole row), found by its conversation's ids, with the labels the dataset gives it
    (TRL's completion-only loss: -100 on the prompt), as one example; None if a canary is not found."""
    cols = ds.column_names
    want = {tuple(x): it.id for it, x in zip(items, ids)}
    lengths = sorted({len(x) for x in ids})
    out: dict[str, dict[str, Any]] = {}
    for row in ds:
        tokens = list(row["input_ids"])
        if "seq_lengths" in cols:
            cuts = [int(n) for n in row["seq_lengths"]]
        elif "position_ids" in cols:
            starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] or [0]
            cuts = [b - a for a, b in zip(starts, starts[1:] + [len(tokens)])]
        else:
            cuts = [len(tokens)]
        at = 0
        for n in cuts:
            seq = tokens[at:at + n]
            for k in lengths:
                cid = want.get(tuple(seq[:k]))
                if cid is not None and cid not in out:
                    out[cid] = {"input_ids": seq, **({"labels": list(row["labels"][at:at + n])}
                                                     if "labels" in cols else {})}
            at += n
        if len(out) == len(items):
            return out
    return None


def secret_drops(trainer: Any, probe: Probe, goldfish: GoldfishCollator | None = None) -> tuple[Any, str]:
    """(ids -> which of a canary's tokens goldfish drops, or None; a note saying how or why not):
    `goldfish` (default: the Trainer's data_collator) asked of the canary's own training example, so the
    canaries are grouped into masked / unmasked as training masks them. None without a GoldfishCollator,
    where copies drop different tokens (goldfish.mask_is_the_documents: random; hash-table / apertus in
    packed rows), or where a canary's tokens are not found in its row (truncated, or tokenized
    differently in context)."""
    coll = goldfish or getattr(trainer, "data_collator", None)
    if not isinstance(coll, GoldfishCollator):
        return None, "no GoldfishCollator on the Trainer: canaries not grouped by a goldfish mask"
    cfg, args = coll.cfg, getattr(trainer, "args", None)
    packed = any(bool(getattr(o, "packing", False) or getattr(o, "padding_free", False))
                 for o in (args, coll.inner))
    what = f"goldfish {cfg.strategy} k={cfg.k} h={cfg.h}"
    if not mask_is_the_documents(cfg.strategy, packed):
        return None, f"{what}{' in packed rows' if packed else ''} drops different tokens in different copies"
    rows, source = _canary_rows(trainer, probe)
    if rows is None:
        return None, source
    items = probe.canary_items()
    texts = [it.text for it in items]
    table: dict[tuple[int, ...], list[bool]] = {}
    for it, ids in zip(items, canary_ids(probe.tok, texts, probe.canary_encode)):  # what canary_scores scores
        row = [int(t) for t in rows[it.id]["input_ids"]]
        at = next((i for i in range(len(row) - len(ids) + 1) if row[i:i + len(ids)] == ids), None)
        if at is None:
            return None, (f"{what}: canary {it.id}'s tokens are not in its training row (truncated, or "
                          "tokenized differently there)")
        table[tuple(ids)] = coll.dropped(rows[it.id])[at:at + len(ids)]
    note = f"{what}, from {source}"
    start = secret_start(items[0].template, list(table), probe.tok, probe.canary_encode)
    longest = max(map(len, canary_ids(probe.tok, texts)))  # the canary's own tokens
    if not any(any(m[start:]) for m in table.values()) and cfg.strategy != "static" and longest <= cfg.h:
        note += (f"; no secret token is masked: every canary is at most {longest} tokens and goldfish never "
                 f"drops one of the first h={cfg.h} of a document or response (a template with h or more "
                 "tokens before {secret} lets the mask reach the secret)")
    return (lambda ids: table[tuple(ids)]), note

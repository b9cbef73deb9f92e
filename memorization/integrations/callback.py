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
from memorization.integrations.probe import Probe
from memorization.integrations.report import FILES, flat_metrics, write_report
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
                 before_training: bool = True, log_prefix: str = "memorization", **probe: Any):
        """`probe` are Probe's settings (members, non_members, held_out, manifest, prefix, suffix, max_tokens,
        batch_size, mia_k, bootstrap, seed, reference, tasks, tasks_limit, num_fewshot, canary_candidates)."""
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 0:
            raise fail("every_steps", every_steps, "pass 0 (score at each epoch end) or a step interval >= 1")
        self.probe = Probe(tokenizer, **probe)  # tokenizes and checks every set now
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if self.out_dir is not None:
            check_writable("out_dir", str(self.out_dir))
        self.every_steps, self.before_training, self.log_prefix = every_steps, before_training, log_prefix
        self.trainer: Any = None
        self.grid: ProcessGrid | None = None
        self.records: list[dict[str, Any]] = []
        self.last_results: list[Any] = []

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
                "canaries": len(p.canary_items()), "tasks": p.tasks,
                "grid": ",".join(map(str, self.grid.dims)) if self.grid is not None else "1,1,1,1",
                "files": list(FILES)}

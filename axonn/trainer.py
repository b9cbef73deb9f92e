"""The training loop: one story from batch to optimizer step, serial or on a 4D grid.

The trainer knows nothing about memorization research: it sees batches of token rows, an optional
label transform (goldfish plugs in there), and honours ignore_index=-100 in the loss. With a
`ProcessGrid` it gives each rank its shard of every global batch and lets the engine reduce
gradients, so the optimizer sees exactly the serial gradient.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from axonn import checkpoint
from axonn.compile import compile_blocks, enable_activation_checkpointing
from axonn.config import TrainerConfig
from axonn.engine import (
    all_reduce_sum,
    clip_grad_norm_,
    grad_norm,
    is_parallel,
    no_sync,
    shard_batch,
    sync_gradients,
)
from axonn.grid import ProcessGrid
from axonn.hooks import Callback, GradientHook, RowDataset
from axonn.layers.functions import cross_entropy, token_cross_entropy
from axonn.lm_head import HiddenStates, LossHead
from axonn.loop_state import StepStats, TrainState, epoch_order, lr_lambda, restore, snapshot
from axonn.sinks import MetricSink
from axonn.state import save_pretrained
from memorize_core import IGNORE_INDEX, Batch, fail


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_precision(precision: str, device_type: str) -> str:
    """The activation precision a run computes in: `auto` is bf16 autocast on CUDA, fp32 elsewhere."""
    if precision != "auto":
        return precision
    return "bf16" if device_type == "cuda" else "fp32"


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a NaN/Inf loss or gradient norm."""


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """torch's fused AdamW (one kernel over all parameters per step) where it runs, on CUDA and CPU
    floating-point parameters; the default implementation elsewhere. Fused is what the single-GPU
    stacks use; the per-parameter loop it replaces launched ~10 kernels per parameter on a GPU and
    took 4.3x the CPU time on SmolLM2-135M (445 vs 104 ms, docs/benchmarks.md). Its updates differ
    from the loop's in the last bits (<= 9.1e-7 after 3 steps there)."""
    ok = bool(params) and all(p.device.type in ("cuda", "cpu") and p.is_floating_point() for p in params)
    return {"fused": True} if ok else {}


class Trainer:
    """AdamW + warmup/cosine + clipping + accumulation over a RowDataset, serial or on a grid."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainerConfig,
        train_data: RowDataset,
        *,
        eval_data: RowDataset | None = None,
        label_transform: Callable[[Batch], torch.Tensor] | None = None,
        grid: ProcessGrid | None = None,
        sinks: list[MetricSink] | None = None,
        callbacks: list[Callback] | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_files: Callable[[Path], None] | None = None,
        name: str = "",
        progress_position: int = 0,
        gradient_hook: GradientHook | None = None,
        micro_batches: int | None = None,
    ):
        cfg.validate()
        self.name, self.progress_position = name, progress_position  # progress bar label and row
        if len(train_data) == 0:
            raise fail("train_data", 0, "no training rows; check the corpus and block length")
        self.cfg, self.model, self.train_data, self.eval_data = cfg, model, train_data, eval_data
        # no grid: a serial run, the 1x1x1x1 grid on the configured device
        grid = grid or ProcessGrid.serial(device=resolve_device(cfg.device))
        self.label_transform, self.grid, self.sinks = label_transform, grid, sinks or []
        # The engine's loss, gradient sum and clipping run when the engine sharded the model or
        # gradients must be summed over ranks (1,1,1,D replicas keep a plain model); a plain
        # model in one process trains exactly as plain PyTorch would (F.cross_entropy, torch clipping).
        self.on_engine = is_parallel(model) or grid.world_size > 1
        self.callbacks = list(callbacks or [])
        # checkpoint_files(dir) lets the caller add files (a tokenizer) to each checkpoint on rank 0
        self.checkpoint_dir, self.checkpoint_files = checkpoint_dir, checkpoint_files
        self.device = grid.device
        # micro-batches per step: as the caller's plan decided (memorization's plan_run), else here
        self.grad_accum = micro_batches or cfg.accumulation(grid.batch_shards)[0]
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.model.to(self.device)
        self.optimizer = self._make_optimizer()
        cfg.check_gradient_hook(gradient_hook)  # settings only a particular hook carries out need it
        self.gradient_hook = gradient_hook if gradient_hook is not None else GradientHook()
        self.gradient_hook.attach(self.model, self.optimizer, grid)
        # the loss's forward: full logits, or hidden states through the chunked head (axonn/lm_head.py);
        # a custom hook may watch the head as a module (per-example module hooks): full logits then
        plain_hook = type(self.gradient_hook) is GradientHook
        self.loss_head = LossHead(model, grid, cfg.loss_chunk, hook_ok=plain_hook)
        # auto never compiles under a custom hook: its per-example module hooks are not the compiler's
        self.compiled_blocks = compile_blocks(model, cfg.compile if plain_hook or cfg.compile is True
                                              else False, self.device)
        self.steps_per_epoch, self.total_steps = cfg.planned_steps(len(train_data))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_lambda(s, cfg.warmup_steps, self.total_steps, cfg.min_lr_ratio))
        self.state = TrainState()
        use_bf16 = resolve_precision(cfg.precision, self.device.type) == "bf16"
        self._autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if use_bf16 \
            else contextlib.nullcontext

    # -- setup -------------------------------------------------------------------------------
    def _make_optimizer(self) -> torch.optim.Optimizer:
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (no_decay if p.dim() < 2 or "norm" in name else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2),
                                 **adamw_kernel(decay + no_decay))

    @property
    def is_main(self) -> bool:
        """True on the rank that writes files and logs."""
        return self.grid.rank == 0

    # -- batches -----------------------------------------------------------------------------
    def _global_batches(self) -> Iterator[tuple[torch.Tensor, Batch]]:
        """(dataset indices, global batch) from the current position on (every rank builds the same ones)."""
        n, bs = len(self.train_data), self.cfg.batch_size
        while True:
            order = epoch_order(n, self.cfg.seed, self.state.epoch)
            while self.state.batch_in_epoch < self.steps_per_epoch:
                start = self.state.batch_in_epoch * bs
                # advance before yielding, so the state always names the *next* batch (what a
                # checkpoint taken after this step must resume from)
                self.state.batch_in_epoch += 1
                drawn = self.gradient_hook.draw_rows(self.state.step, n)
                if drawn is None:
                    idx = order[start:start + bs]
                    yield idx, self.train_data[idx]
                else:
                    yield self._padded(drawn)
            self.state.epoch += 1
            self.state.batch_in_epoch = 0

    def _padded(self, idx: torch.Tensor) -> tuple[torch.Tensor, Batch]:
        """The rows `idx` plus unsupervised copies of row 0 up to a multiple of the batch shards (at
        least one row per shard), so every shard holds as many rows. Not up to whole micro-batches:
        a Poisson draw of 9 rows at batch_size 8 would then cost 16 rows of compute."""
        shards = self.grid.batch_shards
        pad = (-len(idx)) % shards if len(idx) else shards
        rows = torch.cat([idx.long(), torch.zeros(pad, dtype=torch.long)])
        batch = self.train_data[rows]
        labels = batch.get("labels", batch["input_ids"]).clone()
        labels[len(idx):] = IGNORE_INDEX  # no supervised token: a zero gradient, clipped to zero
        return rows, {**batch, "labels": labels}

    def _shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of a (micro-)batch along rows."""
        return shard_batch(t, self.grid)

    # -- loss --------------------------------------------------------------------------------
    def _ce_sum(self, logits: torch.Tensor | HiddenStates,
                targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of CE over non-ignored targets, their count) for this rank's rows."""
        if isinstance(logits, HiddenStates):  # the chunked head: the same CE, never the full logits
            return logits.token_ce(targets).sum(), (targets != IGNORE_INDEX).sum()
        if self.on_engine:
            return cross_entropy(logits, targets, self.grid, ignore_index=IGNORE_INDEX)
        # fp32 at least (bf16 would lose the loss); an fp64 model keeps fp64, as the engine's CE does
        flat = (logits if logits.dtype == torch.float64 else logits.float()).reshape(-1, logits.shape[-1])
        loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, (targets != IGNORE_INDEX).sum()

    def _ce_split(self, logits: torch.Tensor | HiddenStates, targets: torch.Tensor,
                  real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-token CE over `targets`, 0 elsewhere; CE sum and count over the real tokens the
        transform dropped).

        One CE over every real token -- what standard loss costs -- split by mask, instead of a
        second softmax pass for the dropped-token metric.
        """
        ce = logits.token_ce(real) if isinstance(logits, HiddenStates) else \
            token_cross_entropy(logits, real, self.grid, ignore_index=IGNORE_INDEX)
        keep = (targets != IGNORE_INDEX).reshape(-1)
        dropped = (real != IGNORE_INDEX).reshape(-1) & ~keep
        return torch.where(keep, ce, 0.0), torch.where(dropped, ce.detach(), 0.0).sum(), dropped.sum()

    def _loss(self, logits: torch.Tensor | HiddenStates, targets: torch.Tensor, base: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(CE sum over `targets`, CE sum and count of the real tokens the label transform dropped, each
        token's CE or None) for this rank's rows; `base` are the micro-batch's untransformed labels.

        Without a label transform or a hook that needs token losses: one fused CE sum (what plain
        PyTorch computes), else one per-token CE split by mask (_ce_split). Through the chunked head
        with no per-token gradient hook, the sum's own op (its gradient formed in forward, no
        recompute), the kept tokens as its weights under a label transform."""
        if isinstance(logits, HiddenStates) and not self.gradient_hook.token_losses:
            real = targets if self.label_transform is None else self._shard(base)[:, 1:].to(self.device)
            keep = targets != IGNORE_INDEX
            loss_sum, ce = logits.ce_sum(real, weights=None if self.label_transform is None else keep)
            dropped = ((real != IGNORE_INDEX) & ~keep).reshape(-1)
            return loss_sum, torch.where(dropped, ce, 0.0).sum(), dropped.sum(), None
        if self.label_transform is None and not self.gradient_hook.token_losses:
            loss_sum, _ = self._ce_sum(logits, targets)
            zero = torch.zeros(())
            return loss_sum, zero, zero, None
        real = targets if self.label_transform is None else self._shard(base)[:, 1:].to(self.device)
        kept, d_sum, d_cnt = self._ce_split(logits, targets, real)
        return kept.sum(), d_sum, d_cnt, kept

    def _clip_gradients(self) -> float:
        """The global gradient norm, the gradients clipped to trainer.grad_clip when it is > 0."""
        cfg, model = self.cfg, self.model
        if self.on_engine:
            return (clip_grad_norm_(model, cfg.grad_clip, self.grid) if cfg.grad_clip > 0
                    else grad_norm(model, self.grid))
        if cfg.grad_clip > 0:
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads))

    def _reduce(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small metrics vector over batch shards."""
        return all_reduce_sum(values, self.grid, group="batch")  # no-op unless the batch is sharded

    def _no_sync(self, active: bool):
        return no_sync(self.model) if active else contextlib.nullcontext()

    # -- one optimizer step ------------------------------------------------------------------
    def train_step(self, batch: Batch, rows: torch.Tensor | None = None) -> StepStats:
        """One optimizer step over one global batch: labels (the transform's, e.g. goldfish) -> per
        micro-batch: this rank's rows, forward, loss, the gradient hook's objective, backward -> the
        gradients reduced over ranks -> clipped -> AdamW and the schedule (skipped on every rank alike
        when the loss or the norm is not finite). `rows`: the batch's dataset indices, which the gradient
        hook is told per micro-batch (GradientHook.micro_batch_rows)."""
        cfg, model, hook = self.cfg, self.model, self.gradient_hook
        model.train()
        base = batch["labels"] if "labels" in batch else batch["input_ids"]
        labels = self.label_transform(batch) if self.label_transform is not None else base
        # Normalise by supervised tokens of the whole global batch (known on every rank).
        supervised = int((labels[:, 1:] != IGNORE_INDEX).sum())
        denom = max(supervised, 1)
        sums = torch.zeros(3, dtype=torch.float64)
        micro = cfg.batch_size // self.grad_accum  # a multiple of the batch shards (cfg.accumulation)
        n = batch["input_ids"].shape[0]
        # grad_accum micro-batches, unless the hook drew the batch's rows: then as many as its rows
        # need, the last one ragged (still a multiple of the shards: `_padded`)
        accum = -(-n // micro)
        for m in range(accum):
            part = slice(m * micro, min((m + 1) * micro, n))
            ids = self._shard(batch["input_ids"][part]).to(self.device)
            tgt = self._shard(labels[part])[:, 1:].to(self.device)
            hook.micro_batch_rows(None if rows is None else self._shard(rows[part]))
            # gradient all-reduces launched during backward wait for the last micro-batch
            with self._no_sync(m + 1 < accum):
                with self._autocast():
                    logits = self.loss_head.forward(ids)  # logits[:, :-1] or the chunked head's input
                loss_sum, d_sum, d_cnt, token_losses = self._loss(logits, tgt, base[part])
                hook.objective(loss_sum, denom, token_losses, tgt).backward()
                hook.after_backward()
            sums += torch.tensor([loss_sum.item(), d_sum.item(), d_cnt.item()], dtype=torch.float64)
        if not hook.reduce(self.state.step) and self.on_engine:
            sync_gradients(model, self.grid)
        norm = self._clip_gradients()
        loss_sum, d_sum, d_cnt = self._reduce(sums).tolist()
        # Both values are identical on every rank (reduced), so all ranks skip together.
        skipped = not (math.isfinite(loss_sum) and math.isfinite(norm))
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = int((base != IGNORE_INDEX).sum())  # real (non-pad) tokens of the global batch
        return StepStats(loss_sum, supervised, d_sum, int(d_cnt), tokens, norm, skipped)

    # -- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, data: RowDataset | None = None) -> float:
        """Token-weighted mean cross-entropy on held-out rows (standard labels, no transform)."""
        data = data if data is not None else self.eval_data
        if data is None:
            return float("nan")
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        bs = self.cfg.eval_batch_size
        shards = self.grid.batch_shards
        bs = max(shards, bs - bs % shards)
        for start in range(0, len(data), bs):
            batch = data[torch.arange(start, min(start + bs, len(data)))]
            ids, lab = batch["input_ids"], batch.get("labels", batch["input_ids"])
            pad = (-ids.shape[0]) % shards  # ragged tail: pad with ignored rows so shards stay equal
            if pad:
                ids = torch.cat([ids, ids[:1].expand(pad, -1)])
                lab = torch.cat([lab, torch.full_like(lab[:1], IGNORE_INDEX).expand(pad, -1)])
            with self._autocast():
                logits = self.loss_head.forward(self._shard(ids).to(self.device))
            s, c = self._ce_sum(logits, self._shard(lab)[:, 1:].to(self.device))
            total += torch.tensor([s.item(), c.item()], dtype=torch.float64)
        s, c = self._reduce(total).tolist()
        self.model.train()
        return s / max(c, 1.0)

    # -- the loop ----------------------------------------------------------------------------
    def _emit(self, metrics: dict[str, Any]) -> None:
        self.state.history.append(metrics)
        if self.is_main:
            for sink in self.sinks:
                sink.log(metrics)

    def log(self, metrics: dict[str, Any]) -> None:
        """Send extra metrics (a callback's evaluation, say) to the sinks on the main rank, stamped with
        the current step. They go to metrics.jsonl and W&B beside the step metrics but not into the
        loss history; readers of metrics.jsonl tell them apart by the missing "loss" key."""
        if self.is_main:
            for sink in self.sinks:
                sink.log({"step": self.state.step, **metrics})

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)

    def fit(self) -> list[dict[str, Any]]:
        """Train to total_steps; return the per-step metrics history."""
        cfg = self.cfg
        bar = tqdm(total=self.total_steps, initial=self.state.step, unit="step", desc=self.name or None,
                   position=self.progress_position, disable=not (cfg.progress and self.is_main),
                   dynamic_ncols=True)
        if self.state.step == 0:
            self._call("on_fit_start")
        batches = self._global_batches()
        t0, tokens0 = time.perf_counter(), self.state.tokens
        while self.state.step < self.total_steps:
            rows, batch = next(batches)
            lr = self.optimizer.param_groups[0]["lr"]
            stats = self.train_step(batch, rows)
            self.state.step += 1
            self.state.tokens += stats.tokens
            self._count_bad(stats)
            elapsed = time.perf_counter() - t0
            tps = (self.state.tokens - tokens0) / max(elapsed, 1e-9)
            metrics = {
                "step": self.state.step, "epoch": round(self.state.step / self.steps_per_epoch, 4),
                "loss": stats.loss_sum / max(stats.supervised, 1),
                "lr": lr, "tokens": self.state.tokens, "supervised_tokens": stats.supervised,
                "tokens_per_s": tps,
            }
            if self.state.skipped_steps:
                metrics["skipped_steps"] = self.state.skipped_steps
            if stats.dropped:
                metrics["dropped_loss"] = stats.dropped_loss_sum / stats.dropped
                metrics["dropped_tokens"] = stats.dropped
            metrics.update(self.gradient_hook.metrics(self.state.step))
            if cfg.eval_every and self.state.step % cfg.eval_every == 0 and self.eval_data is not None:
                metrics["val_loss"] = self.evaluate()
            self._emit(metrics)
            self._call("on_step_end", metrics)
            if self.state.step % self.steps_per_epoch == 0:
                self._call("on_epoch_end", self.state.step // self.steps_per_epoch)
            if cfg.checkpoint_every and self.checkpoint_dir is not None \
                    and self.state.step % cfg.checkpoint_every == 0:
                self.save_checkpoint(self.checkpoint_dir)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{tps:,.0f}")
            bar.update(1)
        bar.close()
        return self.state.history

    def _count_bad(self, stats: StepStats) -> None:
        """Count a skipped (non-finite) step; abort after max_bad_steps in a row."""
        if not stats.skipped:
            self.state.bad_streak = 0
            return
        self.state.skipped_steps += 1
        self.state.bad_streak += 1
        if self.state.bad_streak >= self.cfg.max_bad_steps:
            loss = stats.loss_sum / max(stats.supervised, 1)
            raise NonFiniteError(
                f"trainer.max_bad_steps={self.cfg.max_bad_steps}: {self.state.bad_streak} consecutive steps "
                f"had a non-finite loss or gradient norm (step {self.state.step}: loss={loss}, "
                f"grad_norm={stats.grad_norm}); lower trainer.lr, set trainer.grad_clip, or check the data")

    # -- checkpoints (axonn/checkpoint.py stores them; axonn/loop_state.py says what the loop needs) ----
    def state_dict(self) -> dict[str, Any]:
        """Loop position, schedule and label-transform state; tensors (RNG states) under "tensors"."""
        return snapshot(self.state, self.scheduler, self.optimizer, self.label_transform, self.device)

    def load_state_dict(self, state: dict[str, Any], tensor: Callable[[str], torch.Tensor | None]) -> None:
        """Restore what state_dict saved; `tensor(name)` returns a saved tensor (or None)."""
        restore(state, tensor, self.state, self.scheduler, self.optimizer, self.label_transform, self.device)

    def save_checkpoint(self, root: str | Path) -> Path:
        """Write an atomic checkpoint of everything needed to resume exactly (every rank calls it)."""
        state = self.state_dict()
        tensors = state.pop("tensors")
        config = getattr(self.model, "config", None)
        meta = {**state, "model_config": config.to_dict() if config is not None else None}
        return checkpoint.save(root, self.state.step, self.model, self.optimizer, grid=self.grid, meta=meta,
                               rank_tensors=tensors, main_files=self.checkpoint_files,
                               keep_last=self.cfg.keep_last)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Resume from a checkpoint saved at any grid; returns its meta."""
        meta, tensor = checkpoint.load(path, self.model, self.optimizer, grid=self.grid)
        self.load_state_dict(meta, tensor)
        return meta

    def export(self, out_dir: str | Path, tokenizer: Any = None) -> Path:
        """save_pretrained the full serial model (and tokenizer) to out_dir on the main rank."""
        out = Path(out_dir)
        if is_parallel(self.model):
            save_pretrained(self.model, out)  # streams shards; rank 0 writes, never the whole model at once
        elif self.is_main:  # a serial model, or a replica at 1,1,1,D: the main rank alone writes
            self.model.save_pretrained(out, safe_serialization=True)
        if self.is_main and tokenizer is not None:
            tokenizer.save_pretrained(out)
        return out


"""The trainer's hooks: what a caller plugs into the loop (axonn/trainer.py) without touching it.

`GradientHook` is the one hook into the gradient (a per-example clipping rule plugs in there, from
the research layer); `Callback` the hook for evaluation during a run (per pass, every N steps);
`RowDataset` what the loop reads.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from axonn.grid import ProcessGrid
from memorize_core import Batch

Trainer = Any  # axonn.trainer.Trainer, which imports this module (no cycle: the loop owns its hooks)


class RowDataset(Protocol):
    """Anything with __len__ and __getitem__(index tensor) -> dict of [n, T] tensors."""

    def __len__(self) -> int: ...
    def __getitem__(self, idx: Any) -> Batch: ...


class GradientHook:
    """The trainer's one hook into the gradient: subclass it and override any method (no-op defaults).

    One optimizer step (`Trainer.train_step`) calls it in this order:
    - draw_rows(step, n) -> the row indices of the step's global batch, or None for the trainer's shuffled
      fixed-size batch (the default). A drawn batch is padded with unsupervised copies of row 0 (zero
      gradient) to a multiple of the batch shards (z*data; at least one row per shard) and cut into
      micro-batches of at most batch_size/grad_accum rows, the last one ragged.
    - per micro-batch: micro_batch_rows(ids), the dataset indices of this rank's rows of it (padding: row
      0, unsupervised; None when the caller handed train_step a batch without them), then
      objective(loss_sum, denom, token_losses, targets) -> the tensor to backpropagate
      (default loss_sum / denom: the CE over this rank's supervised tokens over the global batch's
      supervised-token count); with `token_losses = True` the trainer also hands it each token's CE
      ([rows * T], 0 where unsupervised) and this rank's targets ([rows, T], -100 where unsupervised);
      then backward, then after_backward().
    - reduce(step) -> True when the hook made the final gradient itself (every p.grad, summed over
      ranks): the trainer's gradient sync is then skipped; False (default) leaves it to the engine.
    - then the trainer clips, steps AdamW and the schedule, and adds metrics(steps) to the step's
      metrics (`steps` optimizer steps done).
    attach(model, optimizer, grid) runs once, in Trainer.__init__, after the optimizer is made.
    """

    token_losses: bool = False  # objective() needs each token's CE, not only their sum

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grid: ProcessGrid) -> None:
        """Once, before the first step."""

    def draw_rows(self, step: int, n: int) -> torch.Tensor | None:
        """The row indices (of `n`) of step `step`'s global batch; None: the shuffled fixed-size batch."""
        return None

    def micro_batch_rows(self, ids: torch.Tensor | None) -> None:
        """The dataset indices of this rank's rows of the coming micro-batch (an objective that weighs
        rows by what they are reads them here)."""

    def objective(self, loss_sum: torch.Tensor, denom: int, token_losses: torch.Tensor | None,
                  targets: torch.Tensor) -> torch.Tensor:
        """What one micro-batch backpropagates."""
        return loss_sum / denom

    def after_backward(self) -> None:
        """After each micro-batch's backward."""

    def reduce(self, step: int) -> bool:
        """After the last micro-batch: True if the hook reduced the gradients itself."""
        return False

    def metrics(self, steps: int) -> dict[str, Any]:
        """Extra metrics for the step that completed `steps` steps."""
        return {}


class Callback:
    """The trainer's hook for evaluation during a run (per pass, every N steps): override any method.

    Every hook runs on every rank, in the order the callbacks were given (an evaluation that gathers
    a sharded model is a collective).  on_fit_start runs once before the first step of a fresh run
    (not on resume), so it sees the untrained model ("pass 0"); on_step_end and on_epoch_end run
    after that step's metrics were emitted, so what they measure belongs to the model as it is then
    (`epoch` counts completed passes from 1; `trainer.state.step % N == 0` in on_step_end gives
    every N steps).  Report results with `trainer.log(...)`: metrics.jsonl and W&B, on rank 0.
    Duck-typed objects work too: the trainer calls only the methods an object has.
    """

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first step of a fresh run."""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        """After every optimizer step (`metrics`: what the step emitted)."""

    def on_epoch_end(self, trainer: Trainer, epoch: int) -> None:
        """After the step that completes pass `epoch` over the training rows."""


__all__ = ["Callback", "GradientHook", "RowDataset"]

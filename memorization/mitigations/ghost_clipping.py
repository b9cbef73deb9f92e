"""DP-SGD with ghost clipping (`trainer.dp.clipping: ghost`, the default), on any grid.

The Trainer's gradient hook, as OpacusPrivacy (privacy.py: Poisson rows, the accountant, the
settings are the same and inherited), but each row's gradient is never materialised:
1. the micro-batch's forward ran with axonn.layers.per_example.ExampleNorms' hooks on every module
   that owns a trainable parameter (the engine's ParallelLinear / ParallelEmbedding and plain HF
   modules alike);
2. objective(): each row's loss l_i (its mean CE over its supervised tokens, -100 labels from
   padding or goldfish excluded); one backward of sum_i l_i towards the embeddings' outputs only
   (no parameter gradient is formed) gives every row's squared gradient norm ||g_i||^2, summed over
   the shards that hold pieces of it (all-reduced over X and Y) so every rank holds the serial
   norms of its rows; the hook returns sum_i c_i l_i with c_i = min(1, C / (||g_i|| + 1e-6))
   (Opacus' factor), detached;
3. the trainer backpropagates that (the graph was kept): p.grad accumulates sum_i c_i g_i, the
   clipped sum, over micro-batches, in the engine's own sharded backward;
4. reduce(): the engine's gradient sync (over Z x data, as a plain step), then noise
   N(0, (sigma C)^2) once per coordinate of the assembled gradient, then / B (the expected batch).

Noise: each parameter piece draws from a generator seeded by (seed, step, the parameter's index,
the coordinates of the piece along the axes that split it): ranks holding copies of one piece (data
replicas, ranks along an axis that does not split it) draw identical noise, distinct pieces
independent noise, so every coordinate of the assembled gradient gets one draw. On grid 1,1,1,D
every rank draws the serial run's noise (same run, same bits); on a tensor split the draws are
another partition of the same distribution (reproducible from the seed on that grid).

Cost (docs/benchmarks.md): forward, a backward without weight GEMMs, the norms (two [T, T] Gram
matrices per linear layer and row, or G^T A when T^2 > in*out), a full backward: on SmolLM2-135M
1.58x a plain step (wall; 1.67x CPU time, a heavily loaded 2-core machine) at 1.00x its peak memory
(Opacus: 2.57x): O(rows x T^2) per layer for the Gram matrices instead of Opacus' rows x params.
"""
from __future__ import annotations

from typing import Any

import torch

from axonn.engine import param_layouts, sync_gradients
from axonn.grid import ProcessGrid
from axonn.layers.per_example import ExampleNorms
from memorization.config import RunTrainerConfig
from memorization.mitigations.dp_sgd import _NOISE, OpacusPrivacy, _seed
from memorize_core import IGNORE_INDEX


class GhostPrivacy(OpacusPrivacy):
    """The Trainer's gradient hook for DP-SGD with ghost clipping (module docstring); sampling,
    accounting, metrics and the run.json summary are OpacusPrivacy's."""

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grid: ProcessGrid) -> None:
        """Per-example norm hooks on every module of `model` owning a trainable parameter."""
        self.model, self.grid = model, grid
        self._params = [(p, spec) for p, spec in param_layouts(model) if p.requires_grad]
        self.norms = ExampleNorms(model, grid, {id(p): spec for p, spec in self._params})
        self.last_norms: torch.Tensor | None = None  # this rank's rows' gradient norms, last micro-batch

    def objective(self, loss_sum: torch.Tensor, denom: int, token_losses: torch.Tensor | None,
                  targets: torch.Tensor) -> torch.Tensor:
        """sum_i min(1, C/|g_i|) l_i over this rank's rows, the norms measured by a first backward."""
        count = (targets != IGNORE_INDEX).sum(1).clamp(min=1)
        losses = token_losses.view(targets.shape).sum(1) / count
        norms = self.norms.norms(losses).sqrt()
        self.last_norms = norms
        coef = (self.dp.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        return (coef.to(losses.dtype) * losses).sum()

    def after_backward(self) -> None:
        """Nothing: the clipped sum accumulated in .grad during the trainer's backward."""

    def reduce(self, step: int) -> bool:
        """p.grad = (clipped sums over the batch shards + N(0, (sigma C)^2) once per coordinate) / B."""
        sync_gradients(self.model, self.grid)  # as a plain step: Z x data (nothing in one process)
        for p, _ in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        std = self.noise_multiplier * self.dp.max_grad_norm
        with torch.no_grad():
            for index, (p, spec) in enumerate(self._params):
                if std > 0:
                    p.grad.add_(self._noise(p, spec, step, index), alpha=std)
                p.grad.div_(self.batch_size)  # the expected batch size: the drawn size would leak
        return True

    def _noise(self, p: torch.Tensor, spec: Any, step: int, index: int) -> torch.Tensor:
        """Standard normal noise for this rank's piece of parameter `index`: identical on ranks holding
        copies of the piece, zero on the rows that pad a Z split."""
        if self._secure is not None:
            return torch.randn(p.shape, generator=self._secure, dtype=p.dtype).to(p.device)
        # axes of size 1 split nothing: on 1,1,1,D every piece is whole and draws the serial noise
        coords = [self.grid.coord(d) for d in spec.shard_dims if self.grid.size(d) > 1] if spec is not None \
            else []
        key = _seed(self.cfg.seed, step, _NOISE)
        for c in [index, *coords]:
            key = (key * 1_000_003 + c + 1) % (2 ** 63)
        gen = torch.Generator(p.device).manual_seed(key)
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype, device=p.device)
        if spec is not None and spec.z_split:
            r0, r1 = spec.row_range()
            noise[r1 - r0:] = 0  # padding rows of the Z split: no coordinate of the model
        return noise


def make_privacy(cfg: RunTrainerConfig, rows: int, *, grid: ProcessGrid | None = None,
                 sigma: float | None = None) -> OpacusPrivacy:
    """The DP-SGD gradient hook `trainer.dp.clipping` names: GhostPrivacy (ghost) or OpacusPrivacy
    (per_sample, Opacus' per-sample gradients); `sigma`: the noise multiplier the run's plan solved."""
    cls = GhostPrivacy if cfg.dp.clipping == "ghost" else OpacusPrivacy
    return cls(cfg, rows, grid=grid, sigma=sigma)


__all__ = ["GhostPrivacy", "make_privacy"]

"""The one scoring layer: a model on its grid, scored in lockstep on every rank.

Every evaluation (extraction, membership inference, exposure, perplexity) is a client of `Scorer`.
A model `axonn.parallelize` sharded is scored on the grid it is sharded over; a plain model on the
serial 1x1x1x1 grid (or on a 1,1,1,D grid of replicas, when one is passed) — the same code, with
every collective a no-op in the serial case:

- the items are split over the batch shards (Z x data, `Scorer.rows`); each rank scores its share
  and `Scorer.collect` returns every shard's results, in input order, on every rank;
- every forward goes through `Scorer.forward`, which keeps a Z group's ranks in lockstep
  (axonn.inference.Lockstep) however much work each shard has;
- vocab-split logits are reduced, never gathered: the greedy token is a distributed argmax (ties to
  the lower id), log-probabilities use a vocab-parallel logsumexp (axonn/layers/vocab.py).

Call the public evals functions on every rank with the same inputs; they return the same results on
every rank.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from axonn.engine import engine_of
from axonn.grid import ProcessGrid
from axonn.inference import Lockstep, collect, grid_of, shard_rows
from axonn.layers.vocab import vocab_argmax, vocab_logsumexp, vocab_pick, vocab_reduce, vocab_topk
from evals._model import accepts_logits_to_keep, cache_keyword, model_device, returned_cache


class Scorer:
    """One model on one grid: sharded rows, lockstep forwards, vocab-parallel reductions."""

    def __init__(self, model: torch.nn.Module, grid: ProcessGrid | None = None) -> None:
        self.model = model
        self.grid = grid_of(model, grid)
        self.device = model_device(model)
        self.sharded_vocab = engine_of(model) is not None and self.grid.y > 1
        self._keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
        self._cache_kw = cache_keyword(model)
        self.lock = Lockstep(self.grid, self._filler)

    @property
    def is_main(self) -> bool:
        """Whether this is the rank that writes results (rank 0)."""
        return self.grid.rank == 0

    # -- work split and results ----------------------------------------------------------------
    def rows(self, n: int) -> list[int]:
        """Which of n items this rank scores (its batch shard's share)."""
        return shard_rows(n, self.grid)

    def collect(self, rows: Sequence[int], values: Sequence[Any], n: int) -> list[Any]:
        """Wait for the Z group (lockstep), then every shard's values in input order, on every rank."""
        self.lock.drain()
        return collect(self.grid, rows, values, n)

    def collect_rows(self, rows: Sequence[int], local: torch.Tensor, n: int) -> torch.Tensor:
        """`collect` for a tensor of one row per item: the [n, ...] tensor (as is when nothing is split)."""
        if self.grid.batch_shards == 1:  # every rank scored every row (no Z split: nothing to drain)
            return local
        parts = self.collect(rows, list(local.cpu()), n)
        return torch.stack(parts).to(local.device) if n else local

    # -- forwards ------------------------------------------------------------------------------
    def forward(self, **kwargs: Any) -> Any:
        """One real forward of the model (its Z peers run one too)."""
        self.lock.step()
        return self.model(**kwargs)

    def step(self, ids: torch.Tensor, cache: Any, last_only: bool = True) -> tuple[torch.Tensor, Any]:
        """Forward `ids` after what `cache` holds: (logits, the cache with `ids` added)."""
        kw = self._keep if last_only else {}
        out = self.forward(input_ids=ids, use_cache=True, **{self._cache_kw: cache}, **kw)
        return out.logits, returned_cache(out)

    def logits(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence logits [B, T, V or V/Y] in float32 (bf16 loses too much for scores)."""
        return self.forward(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()

    def suffix_logits(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """Logits [B, n, V or V/Y] of the last n positions in float32; the LM head runs on those only
        when the model takes `logits_to_keep` (a corpus scan reads the suffix's logits alone)."""
        kw = {"logits_to_keep": n} if self._keep else {}
        return self.forward(input_ids=ids, use_cache=False, **kw).logits[:, -n:].float()

    def _filler(self) -> None:
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.model(input_ids=ids, use_cache=False, **self._keep)

    # -- vocab reductions ----------------------------------------------------------------------
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy token ids over the whole vocabulary."""
        return vocab_argmax(logits, self.grid)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """log p over this rank's vocab columns (all of them unless the vocabulary is split)."""
        return logits - vocab_logsumexp(logits, self.grid).unsqueeze(-1)

    def topk(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k over [B, n, V(/Y)] beam x token scores: (values, flat ids beam * V + token)."""
        return vocab_topk(scores, k, self.grid, self.sharded_vocab)

    def vocab_size(self, logits: torch.Tensor) -> int:
        """The whole vocabulary's size, from this rank's logits."""
        return logits.shape[-1] * (self.grid.y if self.sharded_vocab else 1)

    def token_stats(self, logits: torch.Tensor, targets: torch.Tensor,
                    moments: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(target) per position, and with `moments` the Min-K%++ z-score of it.

        z = (log p(x_t) - mu_t) / sigma_t with mu_t, sigma_t^2 the mean and variance of log p(z),
        z ~ p(. | x_<t): sums over the vocabulary (one all-reduce over Y each)."""
        lse = vocab_logsumexp(logits, self.grid)
        tok = vocab_pick(logits, targets, self.grid) - lse
        if not moments:
            return tok, None
        logp = logits.as_subclass(torch.Tensor) - lse.unsqueeze(-1)
        p = logp.exp()
        mu = vocab_reduce((p * logp).sum(-1), self.grid, self.sharded_vocab)
        # Two passes, not E[(log p)^2] - mu^2: on a near-uniform distribution that difference
        # cancels to a few digits in float32.
        var = vocab_reduce((p * (logp - mu.unsqueeze(-1)).square()).sum(-1), self.grid, self.sharded_vocab)
        var = var.clamp_min(1e-12)
        return tok, (tok - mu) / var.sqrt()

"""Where the trainer's loss meets the model: full logits, or the final hidden states through the
chunked head + cross-entropy (axonn/layers/chunked_ce.py), chosen by `trainer.loss_chunk`.

A Hugging Face causal LM computes `logits = lm_head(base_model(ids).last_hidden_state)`; the chunked
path runs the base model and hands its hidden states with the head's weight (an nn.Linear, or the
engine's vocab-parallel `head` layer) to `chunked_cross_entropy`, so the [tokens, vocab] logits are
never built. It applies only where that identity holds and nothing else watches the head:
- the model is a transformers PreTrainedModel (`base_model_prefix`) whose head has no bias and whose
  config scales or caps no logits (Gemma-2 softcapping, Cohere/Granite logit scales);
- the trainer's gradient hook is the plain one (a hook's per-example module hooks need the head as a module).
`auto` chunks when a micro-batch's logits would exceed axonn.plan.memory.AUTO_ELEMENTS on this rank
(a 1B Llama at 4 x 2048 tokens: yes; the tiny CPU models: never, so their steps are unchanged) and
falls back to full logits, silently, where the chunked path does not apply; an explicit chunk size
refuses there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from axonn.config import check_loss_chunk
from axonn.grid import ProcessGrid
from axonn.layers.chunked_ce import chunked_cross_entropy, chunked_cross_entropy_sum
from axonn.layers.functions import compute_dtype, token_cross_entropy
from axonn.layers.modules import ParallelLinear
from axonn.plan.memory import head_chunk  # the planner resolves `auto` the same way
from memorize_core import IGNORE_INDEX, fail

_LOGIT_SCALES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass(frozen=True)
class Head:
    """What the chunked path needs of a model: its base (ids -> final hidden states) and head weight."""

    base: nn.Module
    weight: nn.Parameter
    rows: int        # vocab rows of the (Z-gathered) weight block on this rank
    sched: Any       # the engine's Scheduler (None for a plain nn.Linear head)
    layer: int       # the head's key in the scheduler


def find_head(model: nn.Module) -> tuple[Head | None, str]:
    """(the model's base + head, "") or (None, why the chunked head cannot stand in for its logits)."""
    if not any("base_model_prefix" in vars(c) for c in type(model).__mro__):
        return None, f"{type(model).__name__} is not a transformers causal LM (no base model to run)"
    base = getattr(model, model.base_model_prefix, None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(base, nn.Module) or base is model or head is None:
        return None, f"{type(model).__name__} has no separate base model and LM head"
    cfg = getattr(model, "config", None)
    for name in _LOGIT_SCALES:
        value = getattr(cfg, name, None)
        if value not in (None, 1, 1.0):
            return None, f"its config scales the logits ({name}={value})"
    if isinstance(head, ParallelLinear):
        if head.style != "head" or head.bias is not None or head.conv1d:
            return None, f"its LM head is a {head.style} layer with bias={head.bias is not None}"
        return Head(base, head.weight, head.spec.block_rows, head.scheduler, id(head)), ""
    if type(head) is nn.Linear and head.bias is None:
        return Head(base, head.weight, head.weight.shape[0], None, 0), ""
    return None, f"its LM head is a {type(head).__name__} (not a bias-free linear layer)"


@dataclass
class HiddenStates:
    """The final hidden states of a micro-batch ([rows, T-1, H]) in place of its logits."""

    hidden: torch.Tensor
    head: Head
    grid: ProcessGrid
    chunk: int
    dtype: torch.dtype  # the head GEMM's dtype, fixed where the forward ran (under autocast or not)

    def token_ce(self, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """Each token's CE, flattened to [N] (0 where ignored), as `token_cross_entropy` on the logits."""
        h = self.head
        return chunked_cross_entropy(self.hidden, h.weight, targets, self.grid, self.chunk, rows=h.rows,
                                     dtype=self.dtype, ignore_index=ignore_index, sched=h.sched,
                                     layer=h.layer)

    def ce_sum(self, targets: torch.Tensor, weights: torch.Tensor | None = None,
               ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sum of each token's CE times its weight (default 1), differentiable; each token's CE
        [N], not differentiable), the sum's gradient formed in the forward pass (no recompute)."""
        h = self.head
        return chunked_cross_entropy_sum(self.hidden, h.weight, targets, self.grid, self.chunk,
                                         weights=weights, rows=h.rows, dtype=self.dtype,
                                         ignore_index=ignore_index, sched=h.sched, layer=h.layer)


class LossHead:
    """The trainer's forward up to the loss: `forward(ids)` gives logits[:, :-1] or HiddenStates."""

    def __init__(self, model: nn.Module, grid: ProcessGrid, setting: int | str = "auto", *,
                 hook_ok: bool = True, field: str = "trainer.loss_chunk") -> None:
        check_loss_chunk(setting, field)
        self.model, self.grid, self.setting = model, grid, setting
        self.head: Head | None = None
        self.reason = "off"
        if setting == "off":
            return
        head, why = find_head(model)
        if head is not None and not hook_ok:
            head, why = None, "the gradient hook needs the LM head's full logits (per-example hooks)"
        if head is None and setting != "auto":
            raise fail(field, setting, f"the chunked LM head does not apply: {why}; set 'auto' or 'off'")
        self.head, self.reason = head, why

    def chunk_for(self, tokens: int) -> int:
        """Tokens per chunk for a micro-batch of `tokens` tokens on this rank; 0: full logits."""
        if self.head is None:
            return 0
        return head_chunk(self.setting, self.head.rows, tokens)  # rows: this rank's vocab slice

    def forward(self, ids: torch.Tensor) -> torch.Tensor | HiddenStates:
        """logits[:, :-1] of `ids`, or (chunking) the final hidden states at the same positions."""
        chunk = self.chunk_for(ids.shape[0] * max(0, ids.shape[1] - 1))
        # a training forward needs no KV cache (HF builds one when config.use_cache; a compiled
        # block would also recompile on the cache's state)
        kw = {"use_cache": False} if getattr(getattr(self.model, "config", None), "use_cache", None) else {}
        if not chunk:
            return self.model(input_ids=ids, **kw).logits[:, :-1]
        h = self.head
        hidden = h.base(input_ids=ids, **kw).last_hidden_state[:, :-1]
        return HiddenStates(hidden, h, self.grid, chunk, compute_dtype(hidden, h.weight))


def token_cross_entropy_of(out: torch.Tensor | HiddenStates, targets: torch.Tensor, grid: ProcessGrid,
                           ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token CE ([N], 0 where ignored) of logits or of hidden states through the chunked head."""
    if isinstance(out, HiddenStates):
        return out.token_ce(targets, ignore_index)
    return token_cross_entropy(out, targets, grid, ignore_index)

"""Goldfish loss as a data collator for the Hugging Face Trainer and TRL's SFTTrainer.

`GoldfishCollator(inner, goldfish)` calls any collator (HF's, TRL's `DataCollatorForLanguageModeling`,
padded or padding-free) and passes its batch through the same `GoldfishTransform` `memorize train`
applies, so dropped labels become -100 before any loss sees them (the model's own loss, TRL's
`compute_loss_func`, `loss_type="chunked_nll"`, ...).

What the transform needs beyond the ids comes from the batch itself (`goldfish_batch`):
- documents: a row is one document unless `position_ids` restart inside it (TRL's padding-free and
  packed batches), padding is where `attention_mask` is 0;
- offsets: each label's offset within its *supervised span*, the maximal run of supervised labels in
  a document (a document's first token counts as supervised: its label is never trained on). Plain
  text is one span from the document's start, so offsets are document offsets, as our packed blocks
  carry; in a conversation whose prompt the collator below already masked (TRL's completion-only or
  assistant-only loss) each response is its own span, counted from the response's start, as
  `data_pipelines.chat` blocks carry. The hash strategy drops a label only when its h-token context
  lies inside its span, so the same response gets the same mask whatever prompt precedes it.
Goldfish only ever turns supervised labels into -100: a label the inner collator masked stays masked.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform, special_token_ids
from memorize_core import IGNORE_INDEX, Batch, fail


def _documents(shape: tuple[int, int], real: torch.Tensor, position_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc_ids, offset of each token in its document): -1 on padding; documents restart where
    position_ids do not continue the previous token's."""
    b, t = shape
    col = torch.arange(t).expand(b, t)
    if position_ids is not None:
        pos = position_ids.long()
        start = torch.ones((b, t), dtype=torch.bool)
        start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    else:  # one document per row, from its first real token (left padding allowed)
        start = real & ~torch.cat([torch.zeros((b, 1), dtype=torch.bool), real[:, :-1]], dim=1)
        first = torch.where(start, col, torch.full_like(col, t)).min(dim=1, keepdim=True).values
        pos = col - first
    start = start & real
    docs = torch.cumsum(start.long(), dim=1) - 1 + torch.arange(b).unsqueeze(1) * (t + 1)
    return docs.masked_fill(~real, -1), pos.masked_fill(~real, -1)


def _span_offsets(sup: torch.Tensor, docs: torch.Tensor, doc_pos: torch.Tensor) -> torch.Tensor:
    """Each supervised token's offset within its supervised span (-1 elsewhere). A span that starts a
    row counts from its document offset there (the row may begin mid-document)."""
    b, t = sup.shape
    col = torch.arange(t).expand(b, t)
    begins = sup.clone()
    begins[:, 1:] &= ~sup[:, :-1] | (docs[:, 1:] != docs[:, :-1])
    base = torch.where(col == 0, torch.zeros_like(doc_pos), doc_pos)  # a row's first span keeps its offset
    last = torch.where(begins, col, torch.zeros_like(col)).cummax(dim=1).values
    return torch.where(sup, doc_pos - base.gather(1, last), torch.full_like(doc_pos, -1))


def goldfish_batch(batch: Mapping[str, Any]) -> Batch:
    """The `memorize_core.Batch` (input_ids, labels, doc_ids, positions) GoldfishTransform takes, from a
    collated Hugging Face batch with `labels` (and `attention_mask` / `position_ids` when it has them)."""
    if "labels" not in batch or batch["labels"] is None:
        raise fail("labels", None, "the wrapped collator returned no labels; use a language-modeling "
                   "collator (TRL's DataCollatorForLanguageModeling, or transformers' "
                   "DataCollatorForLanguageModeling(mlm=False)) so goldfish has labels to mask")
    ids, labels = torch.as_tensor(batch["input_ids"]), torch.as_tensor(batch["labels"])
    if ids.dim() != 2 or labels.shape != ids.shape:
        raise fail("labels", f"shape {tuple(labels.shape)}", f"must match input_ids {tuple(ids.shape)} "
                   "([rows, tokens]); goldfish masks token-level causal-LM labels")
    mask = batch.get("attention_mask")
    real = torch.ones(ids.shape, dtype=torch.bool) if mask is None else torch.as_tensor(mask).cpu().bool()
    if real.shape != ids.shape:  # a 4D mask: padding is what the labels already ignore
        real = torch.ones(ids.shape, dtype=torch.bool)
    pos = batch.get("position_ids")
    pos = None if pos is None else torch.as_tensor(pos).cpu().reshape(ids.shape)
    docs, doc_pos = _documents(tuple(ids.shape), real, pos)
    sup = ((labels.cpu() != IGNORE_INDEX) | (doc_pos == 0)) & real
    return {"input_ids": ids.cpu(), "labels": labels.cpu(), "doc_ids": docs,
            "positions": _span_offsets(sup, docs, doc_pos)}


class GoldfishCollator:
    """Wrap a collator: its batches come back with goldfish-dropped labels set to -100."""

    def __init__(self, inner: Callable[[list[Any]], Mapping[str, Any]],
                 goldfish: GoldfishConfig | None = None, *, seed: int = 0, tokenizer: Any = None,
                 **settings: Any):
        """`goldfish` (or keywords strategy=, k=, h=, seed of the random strategy, exempt_special=,
        preset=) as `memorize train` takes it; `seed` is the run seed the `random` strategy's generator
        mixes in; `tokenizer` names the special tokens a strategy exempts (apertus by default)."""
        if not callable(inner):
            raise fail("inner", type(inner).__name__, "pass the collator to wrap, e.g. trainer.data_collator")
        cfg = replace(goldfish or GoldfishConfig(), enabled=True, **_settings(settings))
        self.inner, self.cfg = inner, cfg
        special = special_token_ids(tokenizer) if tokenizer is not None else None
        self.transform = GoldfishTransform(cfg, seed=seed, special_ids=special)  # validates strategy, k, h

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        """Collate with the inner collator, then replace `labels` with the goldfish-masked ones."""
        batch = dict(self.inner(examples))
        masked = self.transform(goldfish_batch(batch))
        labels = batch["labels"]
        batch["labels"] = masked.to(labels.device) if isinstance(labels, torch.Tensor) else masked
        return batch

    def dropped(self, example: Any) -> list[bool]:
        """Per token of one training example collated alone: whether goldfish drops its label (a label the
        inner collator supervises that this collator sets to -100). Refused for `random`: its mask is drawn
        anew for every copy, and drawing one here would move the training generator."""
        if self.cfg.strategy == "random":
            raise fail("goldfish.strategy", "random", "draws a new mask for every copy of a document, so no "
                       "mask belongs to the document; ask this of a fixed-mask strategy (hash, static, ...)")
        batch = dict(self.inner([example]))
        before = torch.as_tensor(batch["labels"]).cpu()[0]
        after = self.transform(goldfish_batch(batch))[0]
        return ((before != IGNORE_INDEX) & (after == IGNORE_INDEX)).tolist()

    def state_dict(self) -> dict:
        """The transform's RNG state (only `random` consumes it)."""
        return self.transform.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict saved."""
        self.transform.load_state_dict(state)


def _settings(settings: dict[str, Any]) -> dict[str, Any]:
    known = {"strategy", "k", "h", "seed", "exempt_special", "preset"}
    for key, value in settings.items():
        if key not in known:
            raise fail(f"goldfish.{key}", value, f"unknown setting; use {', '.join(sorted(known))}")
    return settings

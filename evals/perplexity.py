"""Token log-probabilities and held-out loss of a causal LM."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from evals._model import evaluating, float_logits, model_device, pad_right
from memorize_core import IGNORE_INDEX, fail


def _check_ids(field: str, ids: torch.Tensor) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 2:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise fail(field, shape, "pass a LongTensor [batch, length] with length >= 2")


def token_logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for t < T-1, from logits [B, T, V]: [B, T-1]."""
    head = logits[:, :-1].float()
    nxt = input_ids[:, 1:].to(head.device)
    # gather - logsumexp avoids materializing a second [B, T, V] log-softmax tensor.
    return head.gather(-1, nxt[..., None]).squeeze(-1) - torch.logsumexp(head, dim=-1)


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.LongTensor,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Log-prob of each actual next token, [B, T-1] float32 on CPU.

    Entry t scores token t+1. Pad on the right: positions whose target token has
    attention_mask 0 are set to 0.0, so callers must use the mask (or lengths) to ignore them.
    """
    _check_ids("input_ids", input_ids)
    device = model_device(model)
    ids = input_ids.to(device)
    mask = attention_mask.to(device) if attention_mask is not None else None
    with evaluating(model):
        lp = token_logprobs_from_logits(float_logits(model, ids, mask), ids)
        if mask is not None:
            lp = lp.masked_fill(mask[:, 1:] == 0, 0.0)
    return lp.cpu()


def mean_loss(model: torch.nn.Module, rows: torch.LongTensor, labels: torch.LongTensor,
              batch_size: int = 8) -> float:
    """Token-weighted mean next-token cross-entropy (nats) over labels != -100.

    HF convention: labels are aligned with rows and shifted here, so labels[:, t] is the target
    predicted from rows[:, :t]; labels[:, 0] is never scored. Equals `model(rows, labels=labels).loss`
    pooled over all supervised tokens (not averaged per batch).
    """
    _check_ids("rows", rows)
    if not isinstance(labels, torch.Tensor) or labels.shape != rows.shape:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise fail("labels", shape, f"pass a tensor with the same shape as rows {tuple(rows.shape)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise fail("batch_size", batch_size, "pass an integer >= 1")
    total, count = 0.0, 0
    with evaluating(model):
        for b in range(0, rows.shape[0], batch_size):
            t, c = _loss_sum(model, rows[b:b + batch_size], labels[b:b + batch_size])
            total, count = total + t, count + c
    if count == 0:
        raise fail("labels", "all -100", "no supervised token; leave some labels unmasked")
    return total / count


def _loss_sum(model: torch.nn.Module, rows: torch.Tensor, labels: torch.Tensor,
              mask: torch.Tensor | None = None) -> tuple[float, int]:
    """Summed next-token cross-entropy (float64) and token count over labels != -100 of one batch."""
    device = model_device(model)
    ids = rows.to(device)
    tgt = labels[:, 1:].to(device)
    logits = float_logits(model, ids, mask.to(device) if mask is not None else None)[:, :-1]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return float(loss.double().cpu()), int((tgt != IGNORE_INDEX).sum())


def corpus_loss(model: torch.nn.Module, seqs: Sequence[Sequence[int]],
                batch_size: int = 8) -> dict[str, float | int]:
    """Token-weighted mean next-token cross-entropy (nats) and perplexity over ragged sequences.

    Every token after a sequence's first is scored once, so `scored_tokens` = tokens - docs. Returns
    {docs, tokens, scored_tokens, loss, perplexity}; equals mean_loss on the same rows, unpadded.
    """
    seqs = [[int(t) for t in s] for s in seqs]
    if not seqs:
        raise fail("seqs", "[]", "pass at least one token sequence")
    short = [i for i, s in enumerate(seqs) if len(s) < 2]
    if short:
        raise fail(f"seqs[{short[0]}]", seqs[short[0]], "every sequence needs at least 2 tokens")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise fail("batch_size", batch_size, "pass an integer >= 1")
    # Length-sorted batches keep padding (wasted compute) small; the sum does not depend on order.
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    total, count = 0.0, 0
    with evaluating(model):
        for b in range(0, len(order), batch_size):
            ids, mask = pad_right([seqs[i] for i in order[b:b + batch_size]])
            t, c = _loss_sum(model, ids, ids.masked_fill(mask == 0, IGNORE_INDEX), mask)
            total, count = total + t, count + c
    loss = total / count
    return {"docs": len(seqs), "tokens": sum(len(s) for s in seqs), "scored_tokens": count,
            "loss": loss, "perplexity": math.exp(loss)}

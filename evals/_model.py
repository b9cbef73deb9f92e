"""Small helpers shared by the evals modules: device lookup, eval-mode context, forward calls."""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence

import torch

from memorize_core import fail


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a parameter-free module)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Put `model` in eval mode under inference_mode, restoring its training flag afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield model
    finally:
        model.train(was_training)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The model a wrapper forwards its keywords to: a peft model's base model, an Opacus
    GradSampleModule's module (their own forward takes **kwargs, which hides the keywords)."""
    for _ in range(4):
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "_module", None), torch.nn.Module):
            model = model._module
        else:
            break
    return model


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether model.forward takes `logits_to_keep` (skips the LM head on positions we never read)."""
    try:
        return "logits_to_keep" in inspect.signature(_inner(model).forward).parameters
    except (TypeError, ValueError):
        return False


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward keyword that takes a KV cache: `cache` where transformers has renamed it (5.x; the
    old `past_key_values` goes in 5.40), else `past_key_values`. Looked up once per model class (of
    the wrapped model, for peft and Opacus wrappers, which pass keywords through)."""
    return _cache_keyword(type(_inner(model)))


@functools.cache
def _cache_keyword(cls: type) -> str:
    try:
        return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    except (TypeError, ValueError, AttributeError):
        return "past_key_values"


def returned_cache(out: object) -> object:
    """The KV cache a forward returned, under either name (`cache`, or `past_key_values` before 5.x)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def scored_seqs(seqs: Sequence[Sequence[int]]) -> list[list[int]]:
    """`seqs` as lists of ints; ConfigError unless there is one at least and each has 2+ tokens (a score
    needs a token with context)."""
    out = [[int(t) for t in s] for s in seqs]
    if not out:
        raise fail("seqs", "[]", "pass at least one token sequence")
    short = [i for i, s in enumerate(out) if len(s) < 2]
    if short:
        raise fail(f"seqs[{short[0]}]", out[short[0]], "every sequence needs at least 2 tokens")
    return out


def pad_right(seqs: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ragged token lists into (ids [B, T], attention_mask [B, T]) LongTensors.

    Right padding never changes earlier positions under causal attention, so any valid pad id works.
    """
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask

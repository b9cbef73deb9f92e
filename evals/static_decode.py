"""Greedy decoding with a static KV cache and a compiled decode step (CUDA graphs on a GPU).

The KV-cache decoder (evals/decoding.py) hands attention a cache that grows by one position per
step, so every step has new shapes and runs op by op from Python: on a GPU the step is bound by
kernel launches (~11 ms per token for a 1B model whose weights stream in ~0.5 ms). Here the cache
is transformers' `StaticCache`, sized once for prefix + new tokens: every decode step has the same
shapes and buffers, so `torch.compile(mode="reduce-overhead")` captures it once as a CUDA graph and
later steps replay it. The prefix is prefilled eagerly (one forward); each step then feeds the last
token at its cache position and takes the argmax of its logits, as `greedy_generate` does: the
tokens are the same (attention over the static buffer masks the unfilled positions out).

The compiled step and its cache are kept per (model, batch, capacity) and reset between calls, so
only the first call pays the compile (`StaticDecoder.compile_s` reports it). Serial models only (the
1,1,1,1 grid): a sharded model's decode runs the engine's collectives between the compiled pieces,
where CUDA graphs cannot follow; `greedy_generate` serves those.
"""
from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from transformers.cache_utils import StaticCache

from axonn.engine import engine_of
from evals._model import cache_keyword, model_device
from memorize_core import fail

_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: StaticDecoder}


def _step(model: torch.nn.Module, tok: torch.Tensor, cache: StaticCache, pos: torch.Tensor,
          kw: str) -> torch.Tensor:
    """One decode step: the greedy token after `tok` ([B, 1]) written at cache position `pos` ([1])."""
    out = model(input_ids=tok, **{kw: cache}, cache_position=pos, use_cache=True)
    return out.logits[:, -1].argmax(dim=-1)


class StaticDecoder:
    """A static cache of `capacity` positions for `batch` rows and the (compiled) decode step over it."""

    def __init__(self, model: torch.nn.Module, batch: int, capacity: int, *, compile: bool = True,
                 backend: str = "inductor", mode: str | None = None) -> None:
        self.model, self.batch, self.capacity = model, batch, capacity
        device = model_device(model)
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.kw = cache_keyword(model)  # `cache` or `past_key_values`, as this transformers names it
        self.compile_s: float | None = None  # the first decode step's time, compile included
        if compile:
            mode = mode or ("reduce-overhead" if device.type == "cuda" else None)
            self.step = torch.compile(_step, backend=backend, mode=mode, dynamic=False)
        else:
            self.step = _step
        self._compiled = compile

    def generate(self, prefixes: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """[B, max_new_tokens] greedy tokens after `prefixes` (the cache is reset first)."""
        model, (b, p) = self.model, prefixes.shape
        self.cache.reset()
        out = torch.empty(b, max_new_tokens, dtype=torch.long, device=prefixes.device)
        if max_new_tokens == 0:
            return out
        positions = torch.arange(p + max_new_tokens, device=prefixes.device)
        logits = model(input_ids=prefixes, **{self.kw: self.cache}, cache_position=positions[:p],
                       use_cache=True).logits
        out[:, 0] = logits[:, -1].argmax(dim=-1)
        for t in range(1, max_new_tokens):
            first = self.compile_s is None and self._compiled
            t0 = time.perf_counter()
            # the same shapes at every step; the position is a tensor, so the captured graph replays
            out[:, t] = self.step(model, out[:, t - 1:t], self.cache, positions[p + t - 1:p + t], self.kw)
            if first:
                if prefixes.device.type == "cuda":
                    torch.cuda.synchronize()
                self.compile_s = time.perf_counter() - t0
        return out


def static_decoder(model: torch.nn.Module, batch: int, capacity: int, **kw: Any) -> StaticDecoder:
    """The StaticDecoder kept for (model, batch, capacity), built (and later compiled) on first use."""
    per_model = _DECODERS.setdefault(model, {})
    key = (batch, capacity, tuple(sorted(kw.items())))
    if key not in per_model:
        per_model[key] = StaticDecoder(model, batch, capacity, **kw)
    return per_model[key]


def static_greedy_generate(model: torch.nn.Module, prefixes: torch.LongTensor, max_new_tokens: int,
                           **kw: Any) -> torch.LongTensor:
    """greedy_generate of a serial model through a static cache and a compiled decode step:
    [B, max_new_tokens], the same tokens. `kw`: StaticDecoder's (compile, backend, mode)."""
    if engine_of(model) is not None:
        raise fail("decode", "static", "the compiled static-cache decode runs serial models only; use "
                   "evals.decoding.greedy_generate for a model sharded by the engine")
    if not isinstance(prefixes, torch.Tensor) or prefixes.dim() != 2 or prefixes.dtype != torch.long:
        raise fail("prefixes", getattr(prefixes, "shape", type(prefixes).__name__),
                   "pass a LongTensor of shape [batch, prefix_len]")
    dec = static_decoder(model, prefixes.shape[0], prefixes.shape[1] + max_new_tokens, **kw)
    was_training = model.training
    model.eval()
    try:  # no_grad, not inference_mode: HF's own static-cache generate runs CUDA graphs this way
        with torch.no_grad():
            return dec.generate(prefixes.to(model_device(model)), max_new_tokens)
    finally:
        model.train(was_training)

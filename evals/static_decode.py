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
only the first call pays the compile (`StaticDecoder.compile_s` reports it). Models whose tensors are
whole on this rank only: a plain model, or one the engine parallelized over a grid that splits no
tensor (1,1,1,1, or a replica of 1,1,1,D, where its collectives are no-ops). A model split over X, Y
or Z runs the engine's collectives between the compiled pieces, where CUDA graphs cannot follow;
`greedy_generate` serves those.

Extraction on a GPU (`evals.extract(decode="auto")`) decodes through `static_local`, which checks
every row it decodes: one teacher-forced forward over prefix + decoded tokens (the eager kernels the
scan scores with) must give back, at every position, the token the compiled step chose. A row that
fails — a near-tie of two logits that the compiled and the eager kernels order differently — is
decoded again by the KV-cache decoder, and `DecodeLog` lists it with the position and the top-2
logit gap where the two disagreed. So every row's tokens are greedy under the eager forward.
"""
from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any

import torch
from transformers.cache_utils import StaticCache

from axonn.engine import engine_of
from evals._model import _inner, cache_keyword, model_device
from evals.decoding import greedy_local, verified_local
from evals.scoring import Scorer
from memorize_core import fail

_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: StaticDecoder}


def _pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy token of [B, V] logits (argmax: ties to the lower id) and its top-2 gap (fp32)."""
    top2 = logits.float().topk(2, dim=-1).values
    return logits.argmax(dim=-1), top2[:, 0] - top2[:, 1]


def _step(model: torch.nn.Module, tok: torch.Tensor, cache: StaticCache, pos: torch.Tensor,
          kw: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: the greedy token after `tok` ([B, 1]) written at cache position `pos` ([1]),
    and the gap between its logit and the runner-up's."""
    out = model(input_ids=tok, **{kw: cache}, cache_position=pos, use_cache=True)
    return _pick(out.logits[:, -1])


class StaticDecoder:
    """A static cache of `capacity` positions for `batch` rows and the (compiled) decode step over it."""

    def __init__(self, model: torch.nn.Module, batch: int, capacity: int, *, compile: bool = True,
                 backend: str = "inductor", mode: str | None = None) -> None:
        self._model = weakref.ref(model)  # kept in _DECODERS under the model: a strong one would keep
        self.batch, self.capacity = batch, capacity  # every evaluated model (and its GPU memory) alive
        device = model_device(model)
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.kw = cache_keyword(model)  # `cache` or `past_key_values`, as this transformers names it
        self.compile_s: float | None = None  # the first decode step's time, compile included
        self.min_gap: torch.Tensor | None = None  # per row of the last call: its smallest top-2 gap
        if compile:
            mode = mode or ("reduce-overhead" if device.type == "cuda" else None)
            self.step = torch.compile(_step, backend=backend, mode=mode, dynamic=False)
        else:
            self.step = _step
        self._compiled = compile

    @property
    def model(self) -> torch.nn.Module:
        """The model this decoder serves (alive while a caller holds it)."""
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this StaticDecoder was freed")
        return model

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
        out[:, 0], gap = _pick(logits[:, -1])
        for t in range(1, max_new_tokens):
            first = self.compile_s is None and self._compiled
            t0 = time.perf_counter()
            # the same shapes at every step; the position is a tensor, so the captured graph replays
            tok, g = self.step(model, out[:, t - 1:t], self.cache, positions[p + t - 1:p + t], self.kw)
            out[:, t] = tok
            gap = torch.minimum(gap, g)  # copied out at once: a CUDA graph's outputs are reused
            if first:
                if prefixes.device.type == "cuda":
                    torch.cuda.synchronize()
                self.compile_s = time.perf_counter() - t0
        self.min_gap = gap
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
    uses_static(model, "static")  # a tensor-split model or a class without static cache: one line
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


DECODES = ("auto", "static", "kv")
_ARGMAX_ELEMENTS = 2 ** 27  # logits elements per verification forward (512 MiB in fp32)


@dataclasses.dataclass
class DecodeLog:
    """How an extraction decoded its greedy rows: `path` static (the compiled static-cache decode,
    every row verified) or kv (the KV-cache decoder); for the static path, the rows decoded, and each
    row whose check failed (decoded again by the KV-cache decoder) with the first position where the
    compiled step's token differs from the teacher-forced argmax and the top-2 logit gap there."""

    path: str = "kv"
    rows: int = 0
    disagreements: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the first LISTED
    checked: int = 0  # rows put through the teacher-forced check (all of them unless check_below)
    redecoded: int = 0  # rows whose check failed (all of them counted, the first LISTED listed)
    gap_shift_max: float = 0.0  # largest |compiled - eager| smallest top-2 gap over rows that passed

    LISTED = 50  # a report lists this many disagreements (a random-init model may have thousands)

    def add(self, row: Any, position: int, gap: float) -> None:
        """Count one row whose check failed; list it while fewer than LISTED are."""
        self.redecoded += 1
        if len(self.disagreements) < self.LISTED:
            self.disagreements.append({"row": row, "position": position, "top2_gap": gap})

    def merge(self, other: DecodeLog) -> None:
        """Add another shard's log of the same call."""
        self.path = other.path
        self.rows += other.rows
        self.checked += other.checked
        self.gap_shift_max = max(self.gap_shift_max, other.gap_shift_max)
        for d in other.disagreements:
            self.add(d["row"], d["position"], d["top2_gap"])
        self.redecoded += other.redecoded - len(other.disagreements)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: path, rows, checked, verified (checked rows whose compiled tokens passed),
        redecoded, disagreements (the first LISTED); gap_shift_max where rows were checked."""
        out = {"path": self.path, "rows": self.rows, "checked": self.checked,
               "verified": self.checked - self.redecoded, "redecoded": self.redecoded,
               "disagreements": self.disagreements}
        if self.checked:
            out["gap_shift_max"] = self.gap_shift_max
        return out


def check_decode(decode: str) -> str:
    """`decode` if it is one of DECODES, else a one-line ConfigError naming the choices."""
    if decode not in DECODES:
        raise fail("decode", decode, "pass auto (the compiled static decode on a GPU, else the KV-cache "
                   "decoder), static or kv")
    return decode


def splits_tensors(model: torch.nn.Module) -> bool:
    """Whether the engine split `model`'s tensors over other ranks (X, Y or Z > 1)."""
    handle = engine_of(model)
    return handle is not None and handle.grid.x * handle.grid.y * handle.grid.z > 1


def uses_static(model: torch.nn.Module, decode: str, num_beams: int = 1) -> bool:
    """Whether greedy extraction of `model` takes the static path: `decode` static, or auto on a CUDA
    device, for a model whose tensors are whole on this rank (`splits_tensors` false), whose class
    declares static-cache support, and greedy decoding. `static` where one of these fails is refused
    in one line."""
    check_decode(decode)
    if decode == "kv":
        return False
    serial, greedy = not splits_tensors(model), num_beams == 1
    compilable = bool(getattr(type(_inner(model)), "_can_compile_fullgraph", False))
    if decode == "static":
        if not compilable:
            raise fail("decode", decode, f"{type(_inner(model)).__name__} does not declare static-cache "
                       "support (transformers' _can_compile_fullgraph); pass auto or kv")
        if not serial:
            raise fail("decode", decode, "the compiled static-cache decode runs serial models only (or "
                       "replicas on a 1,1,1,D grid); pass auto or kv for a model sharded by the engine")
        if not greedy:
            raise fail("decode", decode, f"the static decode is greedy; pass decode=auto or kv with "
                       f"num_beams={num_beams}")
        return True
    return serial and greedy and compilable and model_device(model).type == "cuda"


def verify_greedy(sc: Scorer, prefixes: torch.Tensor, tokens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check decoded rows by one teacher-forced forward: (first, gap, min_gap) per row, `first` the
    first position whose token is not the argmax given the prefix and the tokens before it (S where
    every token is), `gap` the top-2 logit gap there (0 for a row that passed) and `min_gap` the
    smallest top-2 gap over the row's S positions. Rows in chunks of at most _ARGMAX_ELEMENTS logits;
    the LM head runs on the S scored positions only where the model allows."""
    b, s = tokens.shape
    first = torch.full((b,), s, dtype=torch.long, device=tokens.device)
    gap = torch.zeros(b, device=tokens.device)
    min_gap = torch.zeros(b, device=tokens.device)
    if s == 0 or b == 0:
        return first, gap, min_gap
    ids = torch.cat([prefixes, tokens[:, :-1]], dim=1)
    step = max(1, _ARGMAX_ELEMENTS // (s * int(sc.model.config.vocab_size)))
    for r in range(0, b, step):
        logits = sc.suffix_logits(ids[r:r + step], s)  # fp32 (exact for bf16: the same argmax)
        top2 = logits.topk(2, dim=-1).values
        min_gap[r:r + step] = (top2[..., 0] - top2[..., 1]).amin(dim=1)
        wrong = logits.argmax(dim=-1) != tokens[r:r + step]
        bad = wrong.any(dim=1)
        if bad.any():
            at = wrong.int().argmax(dim=1)
            first[r:r + step] = torch.where(bad, at, s)
            rows = bad.nonzero().squeeze(1)
            gap[r + rows] = (top2[rows, at[rows], 0] - top2[rows, at[rows], 1])
    return first, gap, min_gap


def static_local(sc: Scorer, prefixes: torch.Tensor, max_new_tokens: int, *, batch: int,
                 targets: torch.Tensor | None = None, log: DecodeLog | None = None,
                 ids: list[Any] | None = None, backend: str | None = None,
                 check_below: float | None = None) -> torch.Tensor:
    """Greedy tokens of this rank's rows ([B, max_new_tokens]) by the static decode, every row verified.

    Rows are padded to `batch` (copies of the first) so every call reuses one compiled step; the step
    is compiled on a GPU (CUDA graphs) and runs eagerly elsewhere, unless a torch.compile `backend`
    is named (then compiled with it on any device). Rows failing `verify_greedy` are
    decoded again by the KV-cache decoder (`verified_local` with their `targets` as the draft when
    given, else `greedy_local`) and recorded in `log` under their `ids`. Call inside
    `evals._model.evaluating`.

    `check_below` (a logit gap; None = check every row, the default everywhere extraction runs)
    checks only the rows whose smallest top-2 gap during the compiled decode is below it: a kernel
    difference smaller than half a row's gap cannot change its argmax, so rows with a clear margin
    at every step keep their tokens unchecked. How far the compiled and eager gaps move apart on the
    rows checked is logged (`gap_shift_max`), which is what a safe `check_below` is read from.
    """
    b, p = prefixes.shape
    if b == 0 or max_new_tokens == 0:
        return prefixes.new_empty(b, max_new_tokens)
    if b > batch:
        raise fail("batch", batch, f"pass a decode batch of at least the {b} rows of this call")
    model = sc.model
    cuda = sc.device.type == "cuda"
    how = {"compile": cuda} if backend is None else {"backend": backend}
    # the kept cache and CUDA graph live outside inference mode, as in HF's static-cache generate
    with torch.inference_mode(False), torch.no_grad():
        dec = static_decoder(model, batch, p + max_new_tokens, **how)
        padded = prefixes.clone()
        if b < batch:
            padded = torch.cat([padded, padded[:1].expand(batch - b, p)])
        out = dec.generate(padded, max_new_tokens)[:b].clone()
        compiled_gap = dec.min_gap[:b].clone()
    check = (torch.arange(b, device=out.device) if check_below is None
             else (compiled_gap < check_below).nonzero().squeeze(1))
    first = torch.full((b,), max_new_tokens, dtype=torch.long, device=out.device)
    gap = torch.zeros(b, device=out.device)
    if len(check):
        first[check], gap[check], eager_gap = verify_greedy(sc, prefixes[check], out[check])
        passed = first[check] == max_new_tokens
        if log is not None and passed.any():
            shift = (compiled_gap[check][passed] - eager_gap[passed]).abs().max()
            log.gap_shift_max = max(log.gap_shift_max, float(shift))
    bad = (first < max_new_tokens).nonzero().squeeze(1)
    if len(bad):
        out[bad] = (verified_local(sc, prefixes[bad], targets[bad]) if targets is not None
                    else greedy_local(sc, prefixes[bad], max_new_tokens))
    if log is not None:
        log.path = "static"
        log.rows += b
        log.checked += len(check)
        for i in bad.tolist():
            log.add(ids[i] if ids is not None else i, int(first[i]), float(gap[i]))
    return out

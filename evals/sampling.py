"""Probabilistic (n, p) discoverable extraction (Hayes et al. 2024, arXiv 2410.19482) from ONE forward.

p_z = P(a sampling scheme emits exactly the S-token suffix | prefix) is the product over suffix
positions of the scheme's probability of the true token given the true earlier tokens: the teacher-
forced logits a corpus scan already has, so nothing is sampled. A pair is (n, p)-extractable when
1 - (1 - p_z)^n >= p. Greedy decoding is the degenerate scheme: log p_z = 0 on exact matches, else -inf.

The per-token probability is HF `generate(do_sample=True)`'s, in the order transformers 5.x's
`_get_logits_processor` applies its warpers: temperature (`logits / T` in float32), top-k
(`TopKLogitsWarper` removes logits below the k-th largest, so ties at the k-th value stay; k =
max(top_k, min_tokens_to_keep)), top-p (`TopPLogitsWarper` on what top-k left: sorted ascending,
removed while the cumulative softmax is <= 1 - top_p, the last min_tokens_to_keep kept), softmax.
`generate` samples with min_tokens_to_keep=1. A scheme is what it spells: a model's generation_config
may default to top_k=50, so compare with `generate(top_k=0, top_p=1.0, ...)` for fields left out.

Ties at the top-p cut: HF's `torch.sort` is not stable (on CPU it is for short rows only; CUDA makes
no promise), so which of several equal logits straddling the cut HF keeps is unspecified; here it is
what a stable ascending sort gives: the lower ids go first, the higher ids are kept.

Split vocabulary (each of Y ranks holds a V/Y slice): nothing of size V is gathered. Each rank's top
candidates are all-gathered and merged; merged, they are exact down to the largest of the ranks'
smallest sent values (and always for the first k). Top-k reads the k-th value off them (ties past the
candidates counted by one all-reduce). Top-p keeps the shortest descending prefix whose exclusive
cumulative mass reaches top_p, so the candidates settle a row whenever their mass passes top_p; a row
they do not settle is dropped (-inf) when one pass shows at least top_p ranked above its target, else
retried with 16x the candidates, or a full sort of the slice, skipping widths that cannot reach top_p.
Temperature keeps the order, so one top-k of the raw logits serves every scheme. Probabilities are
float32 (as HF's) summed in float64; a row whose mass lies within float32 rounding (~1e-7) of top_p
may be cut one token differently than HF cuts it. log p_z is summed in float64.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from axonn.grid import ProcessGrid
from axonn.layers.functions import _plain
from memorize_core import fail

DEFAULT_SCHEMES = "t=1.0;t=0.7,top_k=40;top_p=0.9"
"""Pure sampling (the model's own distribution), a typical chat setting (T=0.7, top-k 40) and
nucleus sampling (top-p 0.9): Hayes et al.'s spread from untruncated to the usual truncation."""

_KEYS = {"t": "temperature", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p"}
_FIRST = 64  # candidates per rank tried first for top-p: covers the nucleus of a peaked distribution


@dataclass(frozen=True)
class Scheme:
    """A sampling scheme: temperature, then top-k, then top-p (None: not applied)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise fail("sampling", t, "temperature must be a finite number > 0 (greedy is scored anyway)")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise fail("sampling", k, "top_k must be an integer >= 1 (leave it out for no top-k)")
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise fail("sampling", p, "top_p must be in (0, 1] (leave it out for no top-p)")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", None if p is None or p == 1 else float(p))  # 1: no top-p

    @property
    def name(self) -> str:
        """Canonical spelling, e.g. `t=1.0`, `t=0.7,top_k=40`, `top_p=0.9` (t=1.0 left out if truncated)."""
        parts = [f"top_k={self.top_k}"] if self.top_k is not None else []
        parts += [f"top_p={self.top_p!r}"] if self.top_p is not None else []
        if self.temperature != 1.0 or not parts:
            parts.insert(0, f"t={self.temperature!r}")
        return ",".join(parts)


def _field(key: str, value: str, piece: str) -> tuple[str, Any]:
    name = _KEYS.get(key)
    if name is None:
        raise fail("sampling", piece, f"unknown key {key!r}: use t (or temperature), top_k, top_p")
    try:
        return name, int(value) if name == "top_k" else float(value)
    except ValueError:
        want = "an integer" if name == "top_k" else "a number"
        raise fail("sampling", piece, f"{key} needs {want}, e.g. {DEFAULT_SCHEMES!r}") from None


def parse_schemes(text: str) -> tuple[Scheme, ...]:
    """Schemes from `t=1.0;t=0.7,top_k=40;top_p=0.9` (`;` between schemes, `,` between fields)."""
    if not isinstance(text, str):
        raise fail("sampling", text, f"pass a string like {DEFAULT_SCHEMES!r}")
    if not text.strip():
        return ()
    out: list[Scheme] = []
    for piece in (p.strip() for p in text.split(";")):
        fields: dict[str, Any] = {}
        for item in piece.split(","):
            key, eq, value = (s.strip() for s in item.partition("="))
            if not eq or not key or not value:
                raise fail("sampling", piece, f"write key=value fields, e.g. {DEFAULT_SCHEMES!r}")
            name, v = _field(key, value, piece)
            if name in fields:
                raise fail("sampling", piece, f"{name} given twice in one scheme")
            fields[name] = v
        scheme = Scheme(**fields)
        if scheme in out:
            raise fail("sampling", text, f"scheme {scheme.name} listed twice")
        out.append(scheme)
    return tuple(out)


class _Vocab:
    """This rank's columns of the vocabulary and the reductions over all of it (collectives over Y)."""

    def __init__(self, grid: ProcessGrid | None, sharded: bool, local: int) -> None:
        self.split = bool(sharded) and grid is not None and grid.y > 1
        self.grid, self.local = grid, local
        self.y = grid.y if self.split else 1
        self.size = local * self.y
        self.offset = grid.y_rank * local if self.split else 0

    def reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.split:
            self.grid.comm.all_reduce(t, "y", op=op)
        return t

    def pick(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x[n, ids[n]] for global ids (the owning rank's value, summed with zeros)."""
        local = ids - self.offset
        own = (local >= 0) & (local < self.local)
        got = x.gather(-1, local.clamp(0, self.local - 1).unsqueeze(-1)).squeeze(-1)
        return self.reduce(torch.where(own, got, torch.zeros_like(got)))

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        """As axonn.layers.vocab.vocab_logsumexp (the scorer's normalizer), float32."""
        if not self.split:
            return torch.logsumexp(x, dim=-1)
        top = self.reduce(x.max(dim=-1).values, "max")
        return self.reduce((x - top.unsqueeze(-1)).exp().sum(dim=-1)).log() + top

    def top(self, raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(descending top values of every rank merged [r, Y * k'], how many lead entries are exact)."""
        kk = min(k, self.local)
        if kk < self.local:
            vals = raw.topk(kk, dim=-1).values
        elif raw.device.type == "cpu":  # numpy's vectorized sort is ~3x torch's on CPU
            vals = torch.from_numpy(np.ascontiguousarray(np.sort(raw.numpy(), axis=-1)[:, ::-1]))
        else:
            vals = raw.sort(dim=-1, descending=True).values
        if not self.split:
            return vals, torch.full(vals.shape[:1], self.size if kk == self.local else kk, device=raw.device)
        every = self.grid.comm.all_gather(vals.unsqueeze(0).contiguous(), "y", dim=0)  # [Y, r, kk]
        merged = every.permute(1, 0, 2).reshape(vals.shape[0], -1).sort(dim=-1, descending=True).values
        if kk == self.local:
            return merged, torch.full(vals.shape[:1], self.size, device=raw.device)
        # everything above every rank's smallest sent value was sent; the first kk are the global top kk
        floor = every[:, :, -1].max(dim=0).values
        return merged, (merged > floor.unsqueeze(-1)).sum(-1).clamp_min(kk)


def _scale(x: torch.Tensor, t: float) -> torch.Tensor:
    return x if t == 1.0 else x / t  # TemperatureLogitsWarper's own float32 op (skipped at T = 1)


class _Block:
    """One block of positions: raw logits [N, V(/Y)], targets [N], the work its schemes share."""

    def __init__(self, raw: torch.Tensor, targets: torch.Tensor, vocab: _Vocab, keep: int, first: int):
        self.raw, self.targets, self.vocab, self.keep, self.first = raw, targets, vocab, keep, first
        self.xt_raw = vocab.pick(raw, targets)
        self._lse: dict[float, torch.Tensor] = {}
        self._top: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def lse(self, t: float) -> torch.Tensor:
        if t not in self._lse:  # at T = 1 the caller's (the scorer's) when it passes one
            self._lse[t] = self.vocab.logsumexp(_scale(self.raw, t))
        return self._lse[t]

    def top(self, rows: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Merged top `width` raw logits per rank of `rows` (None: all) and their exact lengths; kept
        for the other schemes (temperature keeps the order, so one top-k serves every scheme)."""
        n = self.raw.shape[0]
        if width not in self._top:
            w, dev = min(width, self.vocab.local) * self.vocab.y, self.raw.device
            self._top[width] = (self.raw.new_empty(n, w), torch.zeros(n, dtype=torch.long, device=dev),
                                torch.zeros(n, dtype=torch.bool, device=dev))
        vals, exact, have = self._top[width]
        if rows is None and not have.any():  # every row: no copy of the logits
            vals[:], exact[:] = self.vocab.top(self.raw, width)
            have[:] = True
        rows = torch.arange(n, device=self.raw.device) if rows is None else rows
        need = rows[~have[rows]]  # the same rows on every Y rank: they hold the same merged candidates
        if need.numel():
            vals[need], exact[need] = self.vocab.top(self.raw[need], width)
            have[need] = True
        return vals[rows], exact[rows]

    def wider(self, width: int) -> int:
        """The next candidate count: 16x, or the whole slice (a sort) once that is within 4x of it."""
        return width * 16 if width * 16 < self.vocab.local // 4 else self.vocab.local

    def mass_above(self, rows: torch.Tensor, t: float, xt: torch.Tensor, norm: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float64 mass (under the log-normalizer `norm`) of the tokens whose logit is above each row's
        target, and with min_tokens_to_keep > 1 their count: a lower bound of what HF ranks above it."""
        x = _scale(self.raw[rows], t)
        gt = x > xt.unsqueeze(1)
        part = torch.logsumexp(x.masked_fill(~gt, -math.inf), dim=-1).double()
        mass = self.vocab.reduce((part - norm).exp())
        return mass, self.vocab.reduce(gt.sum(-1)) if self.keep > 1 else None


def _top_k(block: _Block, t: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k-th largest scaled logit, float64 log-normalizer of what TopKLogitsWarper keeps)."""
    cands, exact = block.top(None, block.first)  # first > k: the first k are exact
    cands = _scale(cands, t)
    kth = cands[:, k - 1]
    # how many are >= kth (all kept): from the candidates, unless ties run past the exact ones
    idx = torch.arange(cands.shape[1], device=cands.device)
    count = ((cands >= kth.unsqueeze(-1)) & (idx < exact.unsqueeze(-1))).sum(-1)
    todo = ((count >= exact) & (exact < block.vocab.size)).nonzero().squeeze(1)
    if todo.numel():
        x = _scale(block.raw[todo], t)
        count[todo] = block.vocab.reduce((x >= kth[todo].unsqueeze(-1)).sum(-1))
    head = cands[:, :k].double()
    top = head[:, 0]
    total = (head - top.unsqueeze(1)).exp().sum(-1) + (count - k).double() * (kth.double() - top).exp()
    return kth, total.log() + top


def _top_p(block: _Block, t: float, p: float, kth: torch.Tensor | None, norm: torch.Tensor,
           xt: torch.Tensor) -> torch.Tensor:
    """log p(target) under top-p (after top-k when kth is given), -inf where removed; float64."""
    vocab, n, dev = block.vocab, block.raw.shape[0], block.raw.device
    out = torch.full((n,), -math.inf, dtype=torch.float64, device=dev)
    rows = torch.arange(n, device=dev)
    if kth is not None:  # top-k removed the target: nothing left to decide
        rows = rows[xt >= kth]
    queue = [(rows, block.first)]
    while queue:  # every Y rank holds the same merged candidates, so takes the same turns
        rows, width = queue.pop(0)
        cands, exact = block.top(rows, width)
        v = _scale(cands, t)
        w = v.shape[1]
        # the candidates that count: the exact ones, and under top-k those it keeps (both a prefix)
        n_alive = exact.clamp_max(w)
        if kth is not None:
            n_alive = torch.minimum(n_alive, (v >= kth[rows].unsqueeze(-1)).sum(-1))
        # probabilities relative to the top candidate's in float32 (as HF's), summed in float64, times
        # the top's own: a lone kept token gets log p exactly 0
        rel = (v - v[:, :1]).exp()
        if bool((n_alive < w).any()):
            rel.masked_fill_(torch.arange(w, device=dev) >= n_alive.unsqueeze(-1), 0.0)
        held = torch.cumsum(rel, -1, dtype=torch.float64)
        top = (v[:, 0].double() - norm[rows]).exp()
        before = torch.cat([held.new_zeros(held.shape[0], 1), held[:, :-1]], 1) * top.unsqueeze(1)
        cut = torch.searchsorted(before, torch.full_like(held[:, :1], p)).squeeze(1).minimum(n_alive)
        # the whole support is known: every token, or a known candidate already below top-k's cut
        whole = (exact >= vocab.size) | (n_alive < exact.clamp_max(w))
        m = cut.clamp_min(block.keep)
        done = whole | ((cut < n_alive) & (m <= n_alive))
        m = torch.minimum(m, n_alive)
        if done.any():
            d, r = done.nonzero().squeeze(1), rows[done]
            md, x = m[d].unsqueeze(1), xt[r]
            thresh = v[d].gather(1, md - 1).squeeze(1)
            lse = v[d, 0].double() + held[d].gather(1, md - 1).squeeze(1).log()  # of what is kept
            kept = x > thresh
            tie = (x == thresh).nonzero().squeeze(1)
            if tie.numel():  # equal logits at the cut: the higher ids are kept (see module docstring)
                tr, th = r[tie], thresh[tie].unsqueeze(1)
                ties_kept = md[tie, 0] - (v[d[tie]] > th).sum(-1)
                gid = torch.arange(vocab.local, device=dev) + vocab.offset
                higher = (_scale(block.raw[tr], t) == th) & (gid > block.targets[tr].unsqueeze(1))
                kept[tie] = vocab.reduce(higher.sum(-1)) < ties_kept
            out[r] = torch.where(kept, (x.double() - lse).clamp_max(0.0), out[r])  # rounding: p <= 1
        rest = (~done).nonzero().squeeze(1)
        if rest.numel():
            scale = top[rest].unsqueeze(1)
            queue += _wider(block, t, p, width, rows[rest], v[rest], exact[rest], rel[rest] * scale,
                            held[rest] * scale, n_alive[rest], xt, norm)
    return out


def _wider(block: _Block, t: float, p: float, width: int, rows: torch.Tensor, v: torch.Tensor,
           exact: torch.Tensor, prob: torch.Tensor, held: torch.Tensor, n_alive: torch.Tensor,
           xt: torch.Tensor, norm: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """The rows the candidates did not settle, each sent on to the first wider candidate count that can
    reach top_p (every token past the known ones holds at most the last one's probability)."""
    last = (n_alive - 1).clamp_min(0).unsqueeze(1)
    mass, q_last = held.gather(1, last).squeeze(1), prob.gather(1, last).squeeze(1)
    if width == block.first:
        # a target the candidates do not reach lies past the cut if what ranks above it holds p: one
        # pass over the vocabulary decides that, far cheaper than ranking it (only a kept one widens)
        floor = v.gather(1, (exact - 1).clamp_max(v.shape[1] - 1).unsqueeze(1)).squeeze(1)
        ask = (xt[rows] <= floor).nonzero().squeeze(1)
        if ask.numel():
            o = rows[ask]
            above, count = block.mass_above(o, t, xt[o], norm[o])
            # equal logits with higher ids only add to what is above: removed either way
            gone = above >= p if count is None else (above >= p) & (count >= block.keep)
            keep = torch.ones_like(rows, dtype=torch.bool)
            keep[ask[gone]] = False
            rows, exact, mass, q_last = rows[keep], exact[keep], mass[keep], q_last[keep]
    out, tier = [], block.wider(width)
    while rows.numel():
        fits = (mass + (tier * block.vocab.y - exact) * q_last >= p) | (exact < block.keep)
        if tier >= block.vocab.local:
            fits = torch.ones_like(fits)
        if fits.any():
            out.append((rows[fits], tier))
        rows, exact, mass, q_last = rows[~fits], exact[~fits], mass[~fits], q_last[~fits]
        tier = block.wider(tier)
    return out


def _block(logits: torch.Tensor, targets: torch.Tensor, schemes: Sequence[Scheme], grid: ProcessGrid | None,
           sharded_vocab: bool, keep: int, lse: torch.Tensor | None) -> _Block:
    """The shared work of `schemes` over logits [N, V(/Y)] with targets [N] (global ids)."""
    if keep < 1:
        raise fail("min_tokens_to_keep", keep, "must be >= 1 (generate uses 1)")
    raw = _plain(logits).float()
    vocab = _Vocab(grid, sharded_vocab, raw.shape[-1])
    ks = [min(max(s.top_k, keep), vocab.size) for s in schemes if s.top_k is not None]
    truncated = any(s.top_k is not None or s.top_p is not None for s in schemes)
    first = max([_FIRST] + [k + 1 for k in ks]) if truncated else 0
    block = _Block(raw, targets.to(raw.device), vocab, keep, first)
    if lse is not None:
        block._lse[1.0] = _plain(lse).float().reshape(-1)
    return block


def _score(block: _Block, s: Scheme) -> torch.Tensor:
    """log p(block's targets) [N] under scheme `s`, float64, -inf where truncated."""
    t = s.temperature
    xt = _scale(block.xt_raw, t)
    kth = None
    if s.top_k is None:
        norm = block.lse(t)
        lp = (xt - norm).double()  # the scorer's float32 log-prob at T = 1
        norm = norm.double()
    else:
        kth, norm = _top_k(block, t, min(max(s.top_k, block.keep), block.vocab.size))
        lp = torch.where(xt >= kth, xt.double() - norm, -math.inf)
    if s.top_p is not None:
        lp = _top_p(block, t, s.top_p, kth, norm, xt)
    return lp


def scheme_logprobs(logits: torch.Tensor, targets: torch.Tensor, schemes: Sequence[Scheme],
                    grid: ProcessGrid | None = None, sharded_vocab: bool = False, *,
                    min_tokens_to_keep: int = 1, lse: torch.Tensor | None = None
                    ) -> dict[Scheme, torch.Tensor]:
    """log p(target) per position [targets.shape] under each scheme, float64, -inf where truncated.

    `logits` [..., V] (or this rank's V/Y slice with `sharded_vocab` on `grid`), targets global ids;
    call on every Y rank together. The schemes share one top-k of the logits and their normalizers;
    `lse` [...] is the T=1 log-normalizer when the caller has it (axonn.layers.vocab.vocab_logsumexp)."""
    shape = targets.shape
    block = _block(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), schemes, grid, sharded_vocab,
                   min_tokens_to_keep, lse)
    return {s: _score(block, s).reshape(shape) for s in schemes}


def candidate_logprobs(logits: torch.Tensor, candidates: torch.Tensor, scheme: Scheme,
                       grid: ProcessGrid | None = None, sharded_vocab: bool = False, *,
                       min_tokens_to_keep: int = 1) -> torch.Tensor:
    """log p of each of C candidate tokens [N, C] (global ids) given logits [N, V(/Y)] under `scheme`,
    float64, -inf where truncated: `scheme_logprobs` of every column, its normalizers computed once."""
    if logits.dim() != 2 or candidates.dim() != 2 or candidates.shape[0] != logits.shape[0]:
        raise fail("candidates", tuple(candidates.shape), f"pass [N, C] token ids for logits of shape "
                   f"{tuple(logits.shape)} ([N, V])")
    candidates = candidates.to(logits.device)
    block = _block(logits, candidates[:, 0], (scheme,), grid, sharded_vocab, min_tokens_to_keep, None)
    cols = []
    for c in range(candidates.shape[1]):
        block.targets = candidates[:, c]
        block.xt_raw = block.vocab.pick(block.raw, block.targets)
        cols.append(_score(block, scheme))
    return torch.stack(cols, dim=1) if cols else logits.new_empty(logits.shape[0], 0, dtype=torch.float64)


def scheme_token_logprob(logits: torch.Tensor, targets: torch.Tensor, scheme: Scheme,
                         grid: ProcessGrid | None = None, sharded_vocab: bool = False, *,
                         min_tokens_to_keep: int = 1) -> torch.Tensor:
    """log p(target) per position under one scheme (see `scheme_logprobs`)."""
    return scheme_logprobs(logits, targets, (scheme,), grid, sharded_vocab,
                           min_tokens_to_keep=min_tokens_to_keep)[scheme]


def log_pz(per_token_logprob: torch.Tensor) -> torch.Tensor:
    """log p_z [B]: the per-token log-probs [B, S] summed over the suffix in float64."""
    return per_token_logprob.double().sum(dim=-1)


def _check_np(n: Any, p: Any) -> None:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
        raise fail("n", n, "the number of draws must be an integer >= 1")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < 1:
        raise fail("p", p, "the probability must be in (0, 1), e.g. 0.5")


def extractable(log_pz: np.ndarray, n: int, p: float) -> np.ndarray:
    """Whether 1 - (1 - p_z)^n >= p, per row (stable for p_z near 0 and near 1; -inf or NaN: False)."""
    _check_np(n, p)
    lz = np.asarray(log_pz, dtype=np.float64)
    if n == 1:
        return lz >= math.log(p)
    with np.errstate(divide="ignore", invalid="ignore"):
        # log(1 - p_z): log(-expm1) near p_z = 1, log1p(-exp) near 0 (Maechler's log1mexp)
        near_one = lz > -math.log(2)
        miss = np.where(near_one, np.log(-np.expm1(np.minimum(lz, 0))), np.log1p(-np.exp(np.minimum(lz, 0))))
        return (n * miss) <= math.log1p(-p)


def np_summary(log_pz_by_scheme: dict[str, np.ndarray], ns: Sequence[int] = (1, 10, 100, 1000),
               p: float = 0.5, greedy: np.ndarray | None = None) -> dict[str, Any]:
    """Counts and fractions of (n, p)-extractable rows per scheme and n; `greedy` (its log p_z or the
    exact-match flags) adds the greedy row, extractable for every n iff an exact match."""
    ns = tuple(ns)
    if not ns:
        raise fail("ns", ns, "pass at least one number of draws, e.g. 1,10,100,1000")
    for n in ns:
        _check_np(n, p)
    columns = dict(log_pz_by_scheme)
    if greedy is not None:
        g = np.asarray(greedy)
        columns = {"greedy": np.where(g, 0.0, -np.inf) if g.dtype == bool else g, **columns}
    sizes = {len(np.asarray(v)) for v in columns.values()}
    if len(sizes) > 1:
        raise fail("log_pz_by_scheme", sorted(sizes), "every scheme needs one log p_z per row")
    rows = sizes.pop() if sizes else 0
    out: dict[str, Any] = {"p": p, "ns": list(ns), "rows": rows, "schemes": {}}
    for name, lz in columns.items():
        per = {}
        for n in ns:
            hit = int(extractable(lz, n, p).sum())
            per[f"n={n}"] = {"count": hit, "fraction": hit / rows if rows else 0.0}
        out["schemes"][name] = per
    return out


__all__ = ["DEFAULT_SCHEMES", "Scheme", "candidate_logprobs", "extractable", "log_pz", "np_summary",
           "parse_schemes",
           "scheme_logprobs", "scheme_token_logprob"]

"""Per-window memorization scores from ONE teacher-forced forward: the scoring of a corpus scan.

Greedy decoding from a P-token prefix reproduces the S-token suffix exactly iff, in one forward over
prefix + suffix[:-1], the argmax at every suffix position equals the next suffix token: wherever
greedy decoding has agreed so far its context *is* the suffix. So the first position where argmax and
suffix differ is exactly where greedy decoding first diverges (`lead`, the leading-match length), and
exact match (Carlini et al. 2022's k-extractability) is `lead == S`. The same forward gives, per
window, over the S suffix tokens:

  exact_match     lead == S
  lead            leading suffix tokens greedy decoding reproduces (0..S)
  token_accuracy  fraction of suffix positions whose teacher-forced argmax is the target
  suffix_loss     mean NLL of the suffix tokens
  zlib_ratio      suffix_loss / zlib-compressed bytes of the suffix text (MIMIR's zlib statistic)
  min_k           mean of the lowest int(k * S) suffix token log-probs (Min-K%)

With `schemes` (evals/sampling.py), the same suffix logits also give Hayes et al. 2024's probabilistic
extraction: `logpz/<scheme>`, log P(the sampling scheme emits exactly the suffix) in float64 (-inf where
top-k / top-p removes a suffix token), and `logpz_greedy` (0 on exact matches, -inf elsewhere). With
`near` = d as well, `near_score`: the largest over the schemes of the summed log-probs of the suffix's
S - d likeliest tokens (teacher-forced; its d least likely left free), what a near-verbatim search
(evals/near_verbatim.py) of the windows is ranked by: an estimate, not a bound (past a change the model
conditions on other tokens).

With `generate`, the rows that are not exact matches are decoded greedily by the target-verified
decoder (evals/decoding.py: prefix prefilled once, one forward over the agreeing suffix, decoding on
from the first divergence), giving Biderman et al. 2023's memorization score (fraction of the S
continuation tokens equal to the suffix) and RougeL; exact rows have score 1 and RougeL 1 without
any decoding.

The forward goes through the scoring layer (evals/scoring.py): rows split over the batch shards, Z
ranks in lockstep, vocab-split logits reduced, never gathered; every rank returns the whole batch.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import numpy as np
import torch

from axonn.grid import ProcessGrid
from axonn.layers.vocab import vocab_logsumexp, vocab_pick
from evals._model import evaluating
from evals.decoding import verified_local
from evals.metrics import ids_text, rouge_l
from evals.sampling import Scheme, log_pz, scheme_logprobs
from evals.scoring import Scorer
from memorize_core import fail

METRICS = ("exact_match", "lead", "token_accuracy", "suffix_loss", "zlib_ratio", "min_k")
GENERATED = ("memorization_score", "rougeL")
_LOCAL = 4  # lead, token_accuracy, suffix_loss, min_k: the columns a shard sends back


def _local(sc: Scorer, windows: torch.Tensor, prefix: int, k: float, generate: bool,
           schemes: Sequence[Scheme] = (), near: int = 0) -> torch.Tensor:
    """This rank's rows: [rows, 4 (+ S continuation tokens with `generate`) (+ log p_z per scheme)
    (+ near_score with `near`)] in float64."""
    s = windows.shape[1] - prefix
    targets = windows[:, prefix:]
    logits = sc.suffix_logits(windows[:, :-1], s)  # position P-1+j predicts suffix token j
    pred = sc.argmax(logits)
    if schemes:  # token_stats' own two reductions, keeping the normalizer for the schemes
        lse = vocab_logsumexp(logits, sc.grid)
        logp = vocab_pick(logits, targets, sc.grid) - lse
    else:
        logp, _ = sc.token_stats(logits, targets)
    wrong = pred != targets
    lead = torch.where(wrong.any(dim=1), wrong.int().argmax(dim=1), s)
    count = max(1, int(s * k + 1e-9))
    min_k = logp.sort(dim=1).values[:, :count].mean(dim=1)
    cols = [lead.double(), (~wrong).double().mean(dim=1), (-logp).double().mean(dim=1), min_k.double()]
    out = torch.stack(cols, dim=1)
    if schemes:
        per = scheme_logprobs(logits, targets, schemes, sc.grid, sc.sharded_vocab, lse=lse)
        pz = torch.stack([log_pz(per[sch]) for sch in schemes], dim=1)
        if near:  # the S - near likeliest suffix tokens per scheme, the likeliest scheme
            kept = [per[sch].topk(s - near, dim=1).values.sum(dim=1) for sch in schemes]
            pz = torch.cat([pz, torch.stack(kept, dim=1).amax(dim=1, keepdim=True)], dim=1)
    if generate:
        cont = targets.clone()
        miss = (lead < s).nonzero().squeeze(1)
        if miss.numel():
            cont[miss] = verified_local(sc, windows[miss, :prefix], targets[miss])
        out = torch.cat([out, cont.double()], dim=1)
    return torch.cat([out, pz], dim=1) if schemes else out


def score_windows(model: torch.nn.Module, windows: torch.Tensor, prefix: int, *, k: float = 0.2,
                  generate: bool = False, text: Callable[[list[int]], str] | None = None,
                  grid: ProcessGrid | None = None, scorer: Scorer | None = None,
                  schemes: Sequence[Scheme] = (), near: int = 0) -> dict[str, np.ndarray]:
    """Scores of every window [B, P + S] (see the module docstring), one array per metric, on every rank.

    `text` turns suffix ids into the text zlib and RougeL see (default: the space-joined ids); with
    `generate` the result also holds `memorization_score`, `rougeL` and `continuation` [B, S]; with
    `schemes` also `logpz_greedy` and one `logpz/<scheme.name>` per scheme (float64 log p_z); with
    `schemes` and `near` = d (1 <= d < S) also `near_score` (the near-verbatim ranking, float64)."""
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.long:
        raise fail("windows", getattr(windows, "shape", type(windows).__name__),
                   "pass a LongTensor [batch, prefix + suffix]")
    if not 1 <= prefix < windows.shape[1]:
        raise fail("prefix", prefix, f"must be in [1, {windows.shape[1] - 1}] for windows of "
                   f"{windows.shape[1]} tokens")
    if not 0 < k <= 1:
        raise fail("k", k, "pass a fraction in (0, 1], e.g. 0.2")
    schemes = tuple(schemes)
    names = [sch.name if isinstance(sch, Scheme) else None for sch in schemes]
    if None in names or len(set(names)) < len(names):
        raise fail("sampling", schemes, "pass distinct evals.sampling.Scheme values (parse_schemes)")
    n, s = windows.shape[0], windows.shape[1] - prefix
    if near and (not schemes or isinstance(near, bool) or not isinstance(near, int) or not 1 <= near < s):
        raise fail("near", near, f"pass the near-verbatim changes d, 1 <= d < {s} (the suffix), with at "
                   "least one sampling scheme")
    sc = scorer or Scorer(model, grid)
    windows = windows.to(sc.device)
    rows = sc.rows(n)
    width = _LOCAL + (s if generate else 0) + len(schemes) + (1 if near else 0)
    with evaluating(model):
        mine = _local(sc, windows[rows], prefix, k, generate, schemes, near) if rows else \
            torch.empty(0, width, dtype=torch.float64, device=sc.device)
        table = sc.collect_rows(rows, mine, n).cpu().numpy()
    text = text or ids_text
    targets = windows[:, prefix:].cpu().numpy()
    lead = table[:, 0].astype(np.int64)
    loss = table[:, 2]
    zbytes = np.array([len(zlib.compress(text(t.tolist()).encode("utf-8"))) for t in targets])
    out: dict[str, np.ndarray] = {"exact_match": lead == s, "lead": lead, "token_accuracy": table[:, 1],
                                  "suffix_loss": loss, "zlib_ratio": loss / zbytes, "min_k": table[:, 3]}
    if generate:
        cont = table[:, _LOCAL:_LOCAL + s].astype(np.int64)
        out["continuation"] = cont
        out["memorization_score"] = (cont == targets).mean(axis=1)
        out["rougeL"] = np.array([1.0 if e else rouge_l(text(c.tolist()), text(t.tolist()))
                                  for e, c, t in zip(out["exact_match"], cont, targets)])
    if schemes:
        out["logpz_greedy"] = np.where(out["exact_match"], 0.0, -np.inf)
        first = _LOCAL + (s if generate else 0)
        for j, sch in enumerate(schemes):
            out[f"logpz/{sch.name}"] = table[:, first + j].copy()
        if near:
            out["near_score"] = table[:, first + len(schemes)].copy()
    return out


__all__ = ["GENERATED", "METRICS", "score_windows"]

"""The sections of `memorize eval` (extraction, membership inference, perplexity) over tokenized corpora.

`memorize eval` (memorization/eval/evaluate.py) and the Hugging Face Trainer callback
(memorization/integrations/callback.py) both call these, so a pass scored in place during training
and the same checkpoint scored by `memorize eval` give the same figures with the same settings.
Each takes the command's `EvalOptions` (defined here: prefix, suffix, beams, batch size, MIA k,
bootstrap, seed, ...).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from axonn.grid import ProcessGrid
from evals import ExtractionResult, extract, summarize
from evals.blind import blind_baseline, shift_warning
from evals.mia import membership_inference
from evals.perplexity import corpus_loss
from memorization.eval.membership import EvalCorpus


@dataclass
class EvalOptions:
    """What `memorize eval` was asked to do (the command line, as given)."""

    model: str
    corpus: str | None = None
    mia: bool = False
    members: str | None = None
    non_members: str | None = None
    reference: str | None = None
    mia_k: float = 0.2
    bootstrap: int = 1000
    perplexity: list[str] | None = None
    max_tokens: int | None = None
    limit: int = 0
    prefix: int = 32
    suffix: int = 32
    batch_size: int = 32
    beams: int = 1
    seed: int = 0
    out: str | None = None
    overwrite: bool = False
    grid: str | None = None  # X,Y,Z,D or auto (under torchrun / srun); None: one process, serial
    mode: str = "auto"  # parallel mode of the layers: easy, paired, or auto (paired for Llama-family)
    keep_gathered: bool = False  # hold the Z-gathered weights for the whole evaluation
    tasks: str | None = None  # lm-eval tasks, comma-separated (bundled offline ones, or lm-eval's own)
    num_fewshot: int | None = None  # in-context examples per task (None: each task's default)
    verbose: bool = False  # lm-eval's log on stderr instead of OUT/lm-eval.log


def extraction_section(o: EvalOptions, model: Any, tok: Any, c: EvalCorpus, *,
                       grid: ProcessGrid | None = None, progress: bool = True
                       ) -> tuple[dict[str, Any], list[ExtractionResult]]:
    """Greedy (or beam) extraction of every document: report.json's `extraction` and the results."""
    t = time.perf_counter()
    results = extract(model, c.seqs, prefix_len=o.prefix, suffix_len=o.suffix, tokenizer=tok,
                      batch_size=o.batch_size, num_beams=o.beams, doc_ids=c.ids, progress=progress, grid=grid)
    section = {"corpus": c.spec, "prefix": o.prefix, "suffix": o.suffix, "beams": o.beams,
               "loaded": c.loaded, **summarize(results), "seconds": time.perf_counter() - t}
    return section, results


def perplexity_section(o: EvalOptions, model: Any, c: EvalCorpus, *, grid: ProcessGrid | None = None
                       ) -> dict[str, Any]:
    """Token-weighted held-out loss and perplexity: one entry of report.json's `perplexity`."""
    t = time.perf_counter()
    res = corpus_loss(model, c.seqs, batch_size=o.batch_size, grid=grid, progress=f"perplexity {c.spec}")
    return {"corpus": c.spec, "loaded": c.loaded, **res, "seconds": time.perf_counter() - t}


def mia_section(o: EvalOptions, model: Any, tok: Any, ref: Any,
                sets: tuple[EvalCorpus, EvalCorpus, str, int], progress: bool = True,
                grid: ProcessGrid | None = None) -> dict[str, Any]:
    """The report's `mia`: every attack's AUC/TPR (+ CIs) and the blind baseline beside them."""
    t = time.perf_counter()
    m, n, source, cut = sets
    methods = membership_inference(model, m.seqs, n.seqs, tokenizer=tok, ref_model=ref, k=o.mia_k,
                                   batch_size=o.batch_size, bootstrap=o.bootstrap, seed=o.seed,
                                   progress=progress, grid=grid)
    # the texts the attacks scored (as cut), without the model
    blind = blind_baseline([tok.decode(s) for s in m.seqs], [tok.decode(s) for s in n.seqs],
                           bootstrap=o.bootstrap, seed=o.seed)
    counts = {"members": len(m.seqs), "non_members": len(n.seqs), "members_loaded": m.loaded,
              "non_members_loaded": n.loaded, "member_tokens": sum(map(len, m.seqs)),
              "non_member_tokens": sum(map(len, n.seqs))}
    return {"members": m.spec, "non_members": n.spec, "source": source, "max_tokens": cut,
            "reference": o.reference,
            "k": o.mia_k, "bootstrap": o.bootstrap, "seed": o.seed, "counts": counts, "methods": methods,
            "blind": blind, "warning": shift_warning(blind, f"`{m.spec}`", f"`{n.spec}`"),
            "seconds": time.perf_counter() - t}

"""The sections of `memorize eval` (extraction, membership inference, perplexity) over tokenized corpora.

`memorize eval` (memorization/evaluate.py) and the Hugging Face Trainer callback
(memorization/integrations/callback.py) both call these, so a pass scored in place during training
and the same checkpoint scored by `memorize eval` give the same figures with the same settings.
Each takes the command's `EvalOptions` (defined here: prefix, suffix, beams, batch size, MIA k,
bootstrap, seed, ...).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from axonn.grid import ProcessGrid
from data_pipelines import is_chat_spec, load_corpus, tokenize_documents
from evals import ExtractionResult, extract, summarize
from evals.mia import membership_inference
from evals.perplexity import corpus_loss
from memorize_core import ConfigError, fail


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


@dataclass
class EvalCorpus:
    """One corpus, tokenized and cut: its spec (name or label), kept documents' ids, texts, token lists."""

    spec: str
    loaded: int
    ids: list[str]
    texts: list[str]
    seqs: list[list[int]]


def corpus_from_texts(flag: str, spec: str, ids: Sequence[str], texts: Sequence[str], tok: Any, vocab: int,
                      max_tokens: int) -> EvalCorpus:
    """Tokenize documents as `memorize eval` does (cut to max_tokens; under 2 tokens dropped)."""
    docs = [_Doc(i, t) for i, t in zip(ids, texts)]
    seqs = tokenize_documents(docs, tok, max_tokens=max_tokens, min_tokens=2)
    if not seqs:
        raise fail(flag, spec, f"none of its {len(docs)} documents has 2 tokens or more under this "
                   "model's tokenizer; point it at text")
    top = max(max(s) for s in seqs)
    if top >= vocab:
        raise fail("--model", str(getattr(tok, "name_or_path", tok)), f"its tokenizer gives id {top} on "
                   f"{spec}, beyond the model's vocab_size {vocab}; save the tokenizer the model was trained "
                   "with")
    return EvalCorpus(spec, len(docs), [docs[i].id for i in seqs.kept], [docs[i].text for i in seqs.kept],
                      [list(s) for s in seqs])


@dataclass
class _Doc:
    id: str
    text: str


def load_corpus_tokens(flag: str, spec: str, tok: Any, vocab: int, max_tokens: int, limit: int) -> EvalCorpus:
    """Load and tokenize one corpus with the model's tokenizer; documents under 2 tokens are dropped."""
    if is_chat_spec(spec):
        raise fail(flag, spec, "holds conversations (prompt/response or messages), but memorize eval scores "
                   "plain documents: pass a text corpus (a .txt file, or .jsonl with a 'text' key per line); "
                   "a chat fine-tune's responses are scored by its training run (extraction.jsonl)")
    try:
        docs = load_corpus(spec, limit=limit or None)
    except ConfigError as e:  # its message names `corpus`; say which flag the spec came from
        msg = str(e).replace("set text_field to the key that holds the text",  # eval has no such flag
                             "memorize eval reads each line's 'text' key: rename the key that holds the text")
        raise ConfigError(f"{flag}: {msg}") from None
    c = corpus_from_texts(flag, spec, [d.id for d in docs], [d.text for d in docs], tok, vocab, max_tokens)
    c.loaded = len(docs)
    return c


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


def mia_section(o: EvalOptions, model: Any, tok: Any, ref: Any, m: EvalCorpus, n: EvalCorpus, *,
                grid: ProcessGrid | None = None) -> dict[str, Any]:
    """Membership inference, members vs non-members: report.json's `mia` (AUC, TPR, bootstrap CIs)."""
    t = time.perf_counter()
    methods = membership_inference(model, m.seqs, n.seqs, tokenizer=tok, ref_model=ref, k=o.mia_k,
                                   batch_size=o.batch_size, bootstrap=o.bootstrap, seed=o.seed, grid=grid)
    counts = {"members": len(m.seqs), "non_members": len(n.seqs), "members_loaded": m.loaded,
              "non_members_loaded": n.loaded, "member_tokens": sum(map(len, m.seqs)),
              "non_member_tokens": sum(map(len, n.seqs))}
    return {"members": m.spec, "non_members": n.spec, "reference": o.reference, "k": o.mia_k,
            "bootstrap": o.bootstrap, "seed": o.seed, "counts": counts, "methods": methods,
            "seconds": time.perf_counter() - t}


def perplexity_section(o: EvalOptions, model: Any, c: EvalCorpus, *, grid: ProcessGrid | None = None
                       ) -> dict[str, Any]:
    """Token-weighted held-out loss and perplexity: one entry of report.json's `perplexity`."""
    t = time.perf_counter()
    res = corpus_loss(model, c.seqs, batch_size=o.batch_size, grid=grid)
    return {"corpus": c.spec, "loaded": c.loaded, **res, "seconds": time.perf_counter() - t}

"""`memorize eval`: extraction, membership inference and utility of any Hugging Face model folder.

Every input is validated (flags, output folder, model folders, corpora, tokenization, vocabulary
agreement, member/non-member overlap) before any scoring starts, and the result files are written
only at the end, so a bad input or a crash leaves --out as it was.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from data_pipelines import load_corpus, tokenize_documents
from evals import ExtractionResult, extract, summarize, to_jsonl
from evals.mia import membership_inference
from evals.perplexity import corpus_loss
from memorization.eval_report import EVAL_FILES, check_eval_out, markdown_report, write_files
from memorize_core import ConfigError, fail

DEFAULT_MAX_TOKENS = 128  # this project's training block length (configs/train/tiny-wiki.yaml)


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


@dataclass
class _Corpus:
    """One corpus spec, tokenized and cut: kept documents' ids, texts and token lists."""

    spec: str
    loaded: int
    ids: list[str]
    texts: list[str]
    seqs: list[list[int]]


def check_options(o: EvalOptions) -> None:
    """Flag-level checks that need no file: one ConfigError naming the flag, the value and the fix."""
    if not (o.corpus or o.mia or o.perplexity):
        raise fail("--corpus/--mia/--perplexity", None, "nothing to evaluate; pass --corpus CORPUS "
                   "(extraction), --mia (membership inference) and/or --perplexity CORPUS (utility)")
    for name in ("prefix", "suffix", "batch_size", "beams"):
        if getattr(o, name) < 1:
            raise fail(f"--{name.replace('_', '-')}", getattr(o, name), "must be >= 1")
    if o.max_tokens is not None and o.max_tokens < 2:
        raise fail("--max-tokens", o.max_tokens, "must be >= 2 (one context token and one scored token)")
    if o.limit < 0:
        raise fail("--limit", o.limit, "must be >= 0 (0 = every document)")
    if not o.mia:
        for flag, value in (("--members", o.members), ("--non-members", o.non_members),
                            ("--reference", o.reference)):
            if value is not None:
                raise fail(flag, value, "only applies to membership inference; add --mia")
        return
    if not o.members or not o.non_members:
        missing = "--members" if not o.members else "--non-members"
        raise fail(missing, None, "--mia needs both --members CORPUS (training documents) and "
                   "--non-members CORPUS (documents the model never saw)")
    if not 0 < o.mia_k <= 1 or math.isnan(o.mia_k):
        raise fail("--mia-k", o.mia_k, "pass a fraction in (0, 1], e.g. 0.2")
    if o.bootstrap < 0:
        raise fail("--bootstrap", o.bootstrap, "pass the number of resamples, >= 0 (0 = no intervals)")


def _load(flag: str, path: str) -> tuple[Any, Any]:
    """(model, tokenizer or None) of a Hugging Face model folder; ConfigError when it is not one."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise fail(flag, path, "not a Hugging Face model folder (no config.json); pass a save_pretrained "
                   "folder such as OUT/model of a training run")
    # The weight-loading progress bar would put lines on stderr before a one-line input error.
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise fail(flag, path, f"cannot be loaded as a causal LM ({type(e).__name__}: "
                   f"{str(e).splitlines()[0][:120]}); pass a save_pretrained model folder") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        tok = None
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model, tok


def _context(model: Any) -> int | None:
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key)
    return None


def _max_tokens(o: EvalOptions, model: Any) -> int:
    """--max-tokens, or the default: 128 (prefix+suffix if larger), never beyond the model's context."""
    ctx = _context(model)
    if o.max_tokens is not None:
        if ctx is not None and o.max_tokens > ctx:
            raise fail("--max-tokens", o.max_tokens, f"exceeds the model's context of {ctx} positions; "
                       f"pass at most {ctx}")
        if o.corpus and o.max_tokens < o.prefix + o.suffix:
            raise fail("--max-tokens", o.max_tokens, f"is shorter than --prefix + --suffix = "
                       f"{o.prefix + o.suffix}; raise it or shorten the prefix/suffix")
        return o.max_tokens
    want = max(DEFAULT_MAX_TOKENS, o.prefix + o.suffix if o.corpus else 0)
    if ctx is not None and want > ctx:
        if o.corpus and o.prefix + o.suffix > ctx:
            raise fail("--prefix", o.prefix, f"+ --suffix {o.suffix} exceeds the model's context of "
                       f"{ctx} positions; shorten them")
        want = ctx
    return want


def _corpus(flag: str, spec: str, tok: Any, vocab: int, max_tokens: int, limit: int) -> _Corpus:
    """Load and tokenize one corpus with the model's tokenizer; documents under 2 tokens are dropped."""
    try:
        docs = load_corpus(spec, limit=limit or None)
    except ConfigError as e:  # its message names `corpus`; say which flag the spec came from
        raise ConfigError(f"{flag}: {e}") from None
    seqs = tokenize_documents(docs, tok, max_tokens=max_tokens, min_tokens=2)
    if not seqs:
        raise fail(flag, spec, f"none of its {len(docs)} documents has 2 tokens or more under this "
                   "model's tokenizer; point it at text")
    top = max(max(s) for s in seqs)
    if top >= vocab:
        raise fail("--model", str(tok.name_or_path), f"its tokenizer gives id {top} on {spec}, beyond the "
                   f"model's vocab_size {vocab}; save the tokenizer the model was trained with")
    return _Corpus(spec, len(docs), [docs[i].id for i in seqs.kept], [docs[i].text for i in seqs.kept],
                   [list(s) for s in seqs])


def _check_reference(o: EvalOptions, model: Any, tok: Any, ref: Any, ref_tok: Any) -> None:
    """The reference model must score the same ids: equal vocab_size and, when it has one, tokenizer."""
    a, b = model.config.vocab_size, ref.config.vocab_size
    if a != b:
        raise fail("--reference", o.reference, f"has vocab_size {b} but the target model has {a}; "
                   "use a reference model with the target's tokenizer")
    if ref_tok is None:
        return
    va, vb = tok.get_vocab(), ref_tok.get_vocab()
    if va != vb:
        diff = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])
        raise fail("--reference", o.reference, f"has a different tokenizer ({len(va)} vs {len(vb)} "
                   f"tokens, e.g. {diff[0][0]!r} -> id {diff[0][1]} in one only); use a reference model "
                   "with the target's tokenizer")


def _check_disjoint(members: _Corpus, nonmembers: _Corpus) -> None:
    """Members and non-members must not share a document (same text or same token ids)."""
    by_text = {t.strip(): i for i, t in zip(members.ids, members.texts)}
    by_ids = {tuple(s): i for i, s in zip(members.ids, members.seqs)}
    pairs = []
    for nid, text, seq in zip(nonmembers.ids, nonmembers.texts, nonmembers.seqs):
        mid = by_text.get(text.strip(), by_ids.get(tuple(seq)))
        if mid is not None:
            pairs.append((mid, nid))
    if pairs:
        raise fail("--non-members", nonmembers.spec, f"{len(pairs)} of its documents are also in --members "
                   f"{members.spec} (same text or same tokens, e.g. {pairs[0][1]} = {pairs[0][0]}); the "
                   "two sets must be disjoint: remove the shared documents from one of them")


def run_eval(o: EvalOptions) -> dict[str, Any]:
    """Validate everything, run the requested sections, write --out (if given); return the report."""
    start = time.perf_counter()
    check_options(o)
    out = check_eval_out(o.out, o.overwrite) if o.out else None
    model, tok = _load("--model", o.model)
    if tok is None:
        raise fail("--model", o.model, "holds no tokenizer; save it next to the model "
                   "(tokenizer.save_pretrained(DIR))")
    ref = None
    if o.mia and o.reference:
        ref, ref_tok = _load("--reference", o.reference)
        _check_reference(o, model, tok, ref, ref_tok)
    max_tokens = _max_tokens(o, model)
    vocab = model.config.vocab_size

    def load(flag: str, spec: str) -> _Corpus:
        return _corpus(flag, spec, tok, vocab, max_tokens, o.limit)

    extraction = load("--corpus", o.corpus) if o.corpus else None
    if extraction is not None and not any(len(s) >= o.prefix + o.suffix for s in extraction.seqs):
        raise fail("--corpus", o.corpus, f"no document has --prefix + --suffix = {o.prefix + o.suffix} "
                   "tokens; shorten the prefix/suffix or use longer documents")
    members = nonmembers = None
    if o.mia:
        members, nonmembers = load("--members", o.members), load("--non-members", o.non_members)
        _check_disjoint(members, nonmembers)
    ppl = [load("--perplexity", spec) for spec in o.perplexity or []]

    report: dict[str, Any] = {"model": o.model, "args": asdict(o), "max_tokens": max_tokens}
    results: list[ExtractionResult] = []
    if extraction is not None:
        report["extraction"], results = _extraction(o, model, tok, extraction)
    if o.mia:
        report["mia"] = _mia(o, model, tok, ref, members, nonmembers)
    if ppl:
        report["perplexity"] = [_perplexity(o, model, c) for c in ppl]
    report["seconds"] = time.perf_counter() - start
    if out is not None:
        files = {"report.json": json.dumps(report, indent=2) + "\n", "report.md": markdown_report(report)}
        if extraction is not None:
            files["extraction.jsonl"] = to_jsonl(results)
        write_files(out, files, replace=EVAL_FILES)
    return report


def _extraction(o: EvalOptions, model: Any, tok: Any, c: _Corpus
                ) -> tuple[dict[str, Any], list[ExtractionResult]]:
    t = time.perf_counter()
    results = extract(model, c.seqs, prefix_len=o.prefix, suffix_len=o.suffix, tokenizer=tok,
                      batch_size=o.batch_size, num_beams=o.beams, doc_ids=c.ids, progress=True)
    section = {"corpus": c.spec, "prefix": o.prefix, "suffix": o.suffix, "beams": o.beams,
               "loaded": c.loaded, **summarize(results), "seconds": time.perf_counter() - t}
    return section, results


def _mia(o: EvalOptions, model: Any, tok: Any, ref: Any, m: _Corpus, n: _Corpus) -> dict[str, Any]:
    t = time.perf_counter()
    methods = membership_inference(model, m.seqs, n.seqs, tokenizer=tok, ref_model=ref, k=o.mia_k,
                                   batch_size=o.batch_size, bootstrap=o.bootstrap, seed=o.seed)
    counts = {"members": len(m.seqs), "non_members": len(n.seqs), "members_loaded": m.loaded,
              "non_members_loaded": n.loaded, "member_tokens": sum(map(len, m.seqs)),
              "non_member_tokens": sum(map(len, n.seqs))}
    return {"members": m.spec, "non_members": n.spec, "reference": o.reference, "k": o.mia_k,
            "bootstrap": o.bootstrap, "seed": o.seed, "counts": counts, "methods": methods,
            "seconds": time.perf_counter() - t}


def _perplexity(o: EvalOptions, model: Any, c: _Corpus) -> dict[str, Any]:
    t = time.perf_counter()
    res = corpus_loss(model, c.seqs, batch_size=o.batch_size)
    return {"corpus": c.spec, "loaded": c.loaded, **res, "seconds": time.perf_counter() - t}

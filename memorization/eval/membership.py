"""`memorize eval`'s corpora: each tokenized and checked once, and which documents are members and
non-members (the membership-inference section itself is memorization.eval.sections.mia_section).

Members and non-members come either from the command line (`--members C --non-members C`) or, when
both are left out, from the training run that wrote the model: run.json beside `DIR` (a run's
`OUT/model`) lists by id the documents it trained on and those its held-out split of the same corpus
kept back (`documents`, memorization.train.prepare.documents_record), so the attack compares exactly the
training documents with documents of their own distribution (Duan et al. 2024: attacks that look
strong on shifted sets fall to chance on such pairs). Either way a model-free text classifier
(evals.blind) is scored beside the attacks; far from chance it flags a distribution shift.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_pipelines import is_chat_spec, load_corpus, tokenize_documents
from memorize_core import ConfigError, fail

# the overrides as a shell passes them on: "data.held_out=" is the empty string (axonn.config)
FIX_SPLIT = ('retrain with a held-out split of the same corpus ("data.held_out=" '
             "data.held_out_fraction=0.5) or pass --members and --non-members from one distribution")


@dataclass
class EvalCorpus:
    """One corpus spec, tokenized and cut: kept documents' ids, texts and token lists."""

    spec: str
    loaded: int
    ids: list[str]
    texts: list[str]
    seqs: list[list[int]]


@dataclass
class _Doc:
    id: str
    text: str


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


def eval_corpus(flag: str, spec: str, tok: Any, vocab: int, max_tokens: int, limit: int, *,
                ids: list[str] | None = None, text_field: str = "text",
                label: str | None = None) -> EvalCorpus:
    """Load and tokenize one corpus with the model's tokenizer (only the documents `ids`, in that
    order, when given); documents under 2 tokens are dropped."""
    if is_chat_spec(spec):
        raise fail(flag, spec, "holds conversations (prompt/response or messages), but memorize eval scores "
                   "plain documents: pass a text corpus (a .txt file, or .jsonl with a 'text' key per line); "
                   "a chat fine-tune's responses are scored by its training run (extraction.jsonl, and "
                   "membership on its answers with eval.mia=true)")
    try:
        docs = load_corpus(spec, text_field=text_field, limit=None if ids is not None else limit or None)
    except ConfigError as e:  # its message names `corpus`; say which flag the spec came from
        msg = str(e).replace("set text_field to the key that holds the text",  # eval has no such flag
                             "memorize eval reads each line's 'text' key: rename the key that holds the text")
        raise ConfigError(f"{flag}: {msg}") from None
    if ids is not None:
        by_id = {d.id: d for d in docs}
        docs = [by_id[i] for i in ids if i in by_id][:limit or None]
    c = corpus_from_texts(flag, spec, [d.id for d in docs], [d.text for d in docs], tok, vocab, max_tokens)
    c.spec = label or spec
    return c


# `--corpus run:members` / `run:held-out`: the documents of the memorize run whose OUT/model --model is
RUN_CORPORA = {"run:members": "members", "run:held-out": "non_members"}


def _run_record(model: str, flag: str, value: str, what: str, fix: str) -> dict[str, Any]:
    """run.json's `documents` of the memorize run whose OUT/model is `model`, as plain documents."""
    path = Path(model).parent / "run.json"
    record = None
    if path.is_file():
        try:
            record = json.loads(path.read_text(encoding="utf-8")).get("documents")
        except (ValueError, AttributeError):
            record = None
    if not record:
        raise fail(flag, value, f"{what} from the training run, but {path} (written by memorize train since "
                   f"its documents are recorded) is missing or lists no documents; {fix}")
    if record.get("format") == "chat":
        raise fail(flag, value, "the run trained on conversations; memorize eval scores plain documents "
                   "(the run's own evaluation scores its responses, and membership on its answers with "
                   "eval.mia=true)")
    return record


def run_corpus(o: Any, load: Any, max_tokens: int) -> EvalCorpus:
    """--corpus: a corpus spec, or run:members / run:held-out (the run's documents, cut to its block_len
    unless --max-tokens says otherwise). `load(flag, spec, max_tokens, **kw)` as in `mia_corpora`."""
    which = RUN_CORPORA.get(o.corpus)
    if which is None:
        return load("--corpus", o.corpus, max_tokens)
    rec = check_run_corpus(o.corpus, o.model)
    cut = o.max_tokens or min(max_tokens, rec.get("block_len") or max_tokens)
    side = "training documents" if which == "members" else "held-out split"
    return load("--corpus", rec["corpus"], cut, ids=rec[which], text_field=rec.get("text_field", "text"),
                label=f"{rec['corpus']}: the run's {side}")


def check_run_corpus(corpus: str, model: str) -> dict[str, Any]:
    """The run record behind --corpus run:members / run:held-out; ConfigError before anything loads."""
    rec = _run_record(model, "--corpus", corpus, "takes the documents",
                      "pass the corpus itself (a registry name or a file)")
    if RUN_CORPORA[corpus] == "non_members" and not rec.get("non_members"):
        raise fail("--corpus", corpus, f"the run held out no documents of {rec['corpus']} (data.held_out="
                   f"{rec.get('held_out')!r}); pass that corpus itself, or retrain with "
                   "data.held_out_fraction")
    return rec


def run_documents(model: str) -> dict[str, Any]:
    """run.json's `documents` of the memorize run whose OUT/model is `model`; ConfigError if none."""
    record = _run_record(model, "--mia", model, "without --members/--non-members takes them",
                         "pass --members CORPUS --non-members CORPUS of one distribution (documents the "
                         "model trained on, and unseen ones like them)")
    if not record.get("non_members"):
        raise fail("--mia", model, f"the run held out no documents of {record['corpus']} (data.held_out="
                   f"{record.get('held_out')!r} is another corpus: attacks against it measure the shift "
                   f"between the corpora); {FIX_SPLIT}")
    return record


def mia_corpora(o: Any, load: Any, max_tokens: int) -> tuple[EvalCorpus, EvalCorpus, str, int]:
    """(members, non-members, where they came from, the tokens each is cut to): the flags' corpora, or
    the run's documents (cut to the run's data.block_len unless --max-tokens says otherwise).
    `load(flag, spec, max_tokens, **kw)` tokenizes one corpus (eval_corpus with the model's tokenizer)."""
    if o.members:
        members, nonmembers = load("--members", o.members, max_tokens), load("--non-members", o.non_members,
                                                                             max_tokens)
        check_disjoint(members, nonmembers)
        return members, nonmembers, "flags", max_tokens
    rec = run_documents(o.model)
    cut = o.max_tokens or min(max_tokens, rec.get("block_len") or max_tokens)  # what the run trained on
    corpus, field = rec["corpus"], rec.get("text_field", "text")
    members = load("--mia", corpus, cut, ids=rec["members"], text_field=field,
                   label=f"{corpus}: the run's training documents")
    nonmembers = load("--mia", corpus, cut, ids=rec["non_members"], text_field=field,
                      label=f"{corpus}: the run's held-out split")
    if members.loaded < len(rec["members"][:o.limit or None]):  # injected canaries are not in the corpus
        members.spec += f" ({len(rec['members']) - members.loaded} injected ones not in the corpus skipped)"
    check_disjoint(members, nonmembers)
    return members, nonmembers, "run", cut


def check_disjoint(members: EvalCorpus, nonmembers: EvalCorpus) -> None:
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


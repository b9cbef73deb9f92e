"""What the memorization callback asks of the model at each pass, through our evaluators only.

`Probe` holds the tokenized evaluation sets (built once, checked before training starts) and
`Probe.score(model, grid)` returns one pass's record: the same sections `memorize eval` writes
(memorization/eval/sections.py: extraction, mia, perplexity; memorization/eval/utility.py: tasks) plus,
from an injection manifest, extraction of every duplicated document and exposure of every canary
by copy count (memorization/eval/exposure.py; a canary injected as a chat answer is scored as
that answer, data_pipelines.chat.answer_encoder). Members may be plain texts or conversations
(lists of {"role", "content"}): a conversation is extracted as prompt -> last response, as
`memorize train` extracts chat data, scored by membership inference on that response given its prompt
(members and non-members both conversations; whole otherwise), and whole by held-out loss.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from axonn.grid import ProcessGrid
from data_pipelines.canaries import SecretSpace
from data_pipelines.chat import ChatExample, extraction_pairs, render_chat
from data_pipelines.chat_inject import conversation_of
from data_pipelines.inject import Manifest
from evals import extract, extract_pairs, summarize
from memorization.eval.evaluate import DEFAULT_MAX_TOKENS
from memorization.eval.exposure import canary_scores, manifest_encoder
from memorization.eval.membership import EvalCorpus, corpus_from_texts
from memorization.eval.sections import EvalOptions, extraction_section, mia_section, perplexity_section
from memorization.eval.utility import check_fewshot, check_tasks, score_tasks
from memorization.experiments.injection import masked_split
from memorize_core import fail

Texts = Sequence[str] | Sequence[Sequence[dict[str, str]]]  # documents, or conversations


@dataclass
class EvalSet:
    """One named set, tokenized: plain documents (`corpus`) or conversations (prompts/responses + ids)."""

    name: str
    corpus: EvalCorpus
    prompts: list[list[int]] = field(default_factory=list)  # conversations only
    responses: list[list[int]] = field(default_factory=list)

    @property
    def is_chat(self) -> bool:
        """Whether the set holds conversations."""
        return bool(self.prompts)


def _is_chat(items: Texts) -> bool:
    return bool(items) and not isinstance(items[0], str)


_KINDS = "a list of texts, or of conversations ([{'role': ..., 'content': ...}, ...]), not a mix"


def _check_items(name: str, items: Texts) -> None:
    """ConfigError naming `name[i]` for an item that is neither a text nor a conversation of the kind
    the set's first item is (token ids included: the callback tokenizes with its own tokenizer)."""
    chat = _is_chat(items)
    for i, item in enumerate(items):
        if isinstance(item, str):
            ok = not chat
        else:
            ok = chat and isinstance(item, Sequence) and bool(item) and \
                all(isinstance(m, Mapping) for m in item)
        if not ok:
            shown = item if len(repr(item)) <= 40 else repr(item)[:37] + "..."
            ids = " (token ids: decode them with the tokenizer first)" if isinstance(item, int) or (
                isinstance(item, Sequence) and item and all(isinstance(t, int) for t in item)) else ""
            raise fail(f"{name}[{i}]", shown, f"pass {_KINDS}{ids}")


def eval_set(name: str, items: Texts, tok: Any, *, max_tokens: int, need: int, suffix: int) -> EvalSet:
    """Tokenize a set as `memorize eval` does; ConfigError when an item cannot give `need` tokens
    (prefix + suffix for documents; a response token for conversations)."""
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise fail(name, items if isinstance(items, str) else f"<{type(items).__name__}>",
                   "pass a non-empty list of texts, or of conversations ([{'role', 'content'}, ...])")
    _check_items(name, items)
    vocab = len(tok)
    if not _is_chat(items):
        c = corpus_from_texts(name, name, [f"{name}/{i}" for i in range(len(items))], list(items), tok, vocab,
                              max_tokens)
        lengths = dict(zip(c.ids, map(len, c.seqs)))
        for i, text in enumerate(items):
            n = lengths.get(f"{name}/{i}", 0)
            if n < need:
                raise fail(f"{name}[{i}]", text[:40] + ("..." if len(text) > 40 else ""), f"the tokenizer "
                           f"encodes it into {n} tokens, fewer than prefix + suffix = {need}; lower "
                           "prefix/suffix or drop the document")
        return EvalSet(name, c)
    examples = [ChatExample(f"{name}/{i}", [dict(m) for m in conv], name) for i, conv in enumerate(items)]
    chats = render_chat(examples, tok, max_tokens=max_tokens)
    if len(chats) < len(examples):
        lost = next(e.id for e in examples if e.id not in {c.id for c in chats})
        raise fail(f"{name}[{lost.split('/')[-1]}]", "<no response left>", f"max_tokens={max_tokens} cuts "
                   "away its response; raise max_tokens")
    prompts, responses = extraction_pairs(chats, suffix)
    ids = [list(c.ids) for c in chats]
    corpus = EvalCorpus(name, len(items), [c.id for c in chats], [""] * len(chats), ids)
    return EvalSet(name, corpus, prompts, responses)


class Probe:
    """The evaluation sets and settings of the memorization callback; `score` asks one pass's questions."""

    def __init__(self, tokenizer: Any, *, members: Texts = (), non_members: Texts = (),
                 held_out: Texts | None = None, manifest: Manifest | None = None, prefix: int = 32,
                 suffix: int = 32, max_tokens: int | None = None, batch_size: int = 32, mia_k: float = 0.2,
                 bootstrap: int = 1000, seed: int = 0, reference: torch.nn.Module | None = None,
                 tasks: Sequence[str] | None = None, tasks_limit: int | None = None,
                 num_fewshot: int | None = None, canary_candidates: int = 0):
        """Tokenize and check every set now (before training): one ConfigError naming field, value, fix."""
        if tokenizer is None or not callable(getattr(tokenizer, "encode", None)):
            raise fail("tokenizer", type(tokenizer).__name__, "pass the model's Hugging Face tokenizer")
        self.tok = tokenizer
        self.options = EvalOptions(model="<the model being trained>", prefix=prefix, suffix=suffix,
                                   batch_size=batch_size, mia_k=mia_k, bootstrap=bootstrap, seed=seed,
                                   max_tokens=max_tokens, mia=bool(non_members))
        o = self.options
        for name in ("prefix", "suffix", "batch_size"):
            value = getattr(o, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(name, value, "must be an integer >= 1")
        if not 0 < mia_k <= 1:
            raise fail("mia_k", mia_k, "pass a fraction in (0, 1], e.g. 0.2")
        if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
            raise fail("bootstrap", bootstrap, "pass the number of resamples, >= 0 (0 = no intervals)")
        self.max_tokens = max_tokens or max(DEFAULT_MAX_TOKENS, prefix + suffix)
        if self.max_tokens < prefix + suffix:
            raise fail("max_tokens", max_tokens, f"is shorter than prefix + suffix = {prefix + suffix}; "
                       "raise it")
        if non_members and not members:
            raise fail("members", None, "membership inference compares members with non_members; pass both")
        kw = dict(max_tokens=self.max_tokens, suffix=suffix)
        self.members = eval_set("members", members, tokenizer, need=prefix + suffix, **kw) if members \
            else None
        self.non_members = eval_set("non_members", non_members, tokenizer, need=0, **kw) if non_members \
            else None
        held = non_members if held_out is None else held_out
        self.held_out = eval_set("held_out", held, tokenizer, need=0, **kw) if held else None
        self.manifest, self.reference, self.canary_candidates = manifest, reference, canary_candidates
        # ids -> which of a canary's tokens the training loss drops (the callback asks the Trainer's
        # GoldfishCollator); None: canaries are not grouped by a mask
        self.dropped: Callable[[list[int]], list[bool]] | None = None
        self.duplicates = self._duplicates(manifest, prefix + suffix)  # checks the manifest
        items = self.canary_items()
        # canaries inject_dataset made a conversation's answer are scored in that conversation
        self.canary_encode = manifest_encoder(tokenizer, items)
        self.tasks = check_tasks(tasks, "tasks") if tasks else []
        check_fewshot(num_fewshot, "num_fewshot")
        self.tasks_limit, self.num_fewshot = tasks_limit, num_fewshot
        if not (self.members or self.held_out or self.duplicates or self.tasks or self.canary_items()):
            raise fail("members", None, "nothing to score; pass members (extraction, MIA with non_members), "
                       "held_out, a manifest with duplicates or canaries, or tasks")

    def _duplicates(self, manifest: Manifest | None, need: int) -> list[tuple[int, EvalSet]]:
        """(copy count, one-item set) per duplicated document of the manifest."""
        if manifest is None:
            return []
        if not isinstance(manifest, Manifest):
            raise fail("manifest", type(manifest).__name__, "pass the Manifest inject_dataset returned")
        out = []
        for item in manifest.of_kind("duplicate"):
            conv = conversation_of(item.text)
            items = [conv] if conv is not None else [item.text]
            s = eval_set(f"duplicates[{item.id}]", items, self.tok, max_tokens=self.max_tokens,
                         need=0 if conv is not None else need, suffix=self.options.suffix)
            out.append((item.count, s))
        return out

    def canary_items(self) -> list[Any]:
        """The manifest's canaries ([] without a manifest)."""
        return self.manifest.of_kind("canary") if self.manifest is not None else []

    def check_model(self, model: torch.nn.Module) -> None:
        """The tokenizer's ids must fit the model's vocabulary (before the first pass is scored)."""
        embed = getattr(model, "get_input_embeddings", None)
        vocab = embed().weight.shape[0] if callable(embed) else None
        sets = [s for s in (self.members, self.non_members, self.held_out) if s]
        sets += [s for _, s in self.duplicates]
        top = max((max(seq) for s in sets for seq in s.corpus.seqs), default=-1)
        if vocab is not None and top >= vocab:
            raise fail("tokenizer", str(getattr(self.tok, "name_or_path", "")), f"gives id {top}, beyond the "
                       f"model's {vocab} embedding rows; pass the tokenizer the model is trained with")

    def _extract(self, s: EvalSet, model: Any, grid: ProcessGrid | None) -> tuple[dict[str, Any], list[Any]]:
        o = self.options
        if not s.is_chat:
            return extraction_section(o, model, self.tok, s.corpus, grid=grid, progress=False)
        t = time.perf_counter()
        results = extract_pairs(model, s.prompts, s.responses, tokenizer=self.tok, batch_size=o.batch_size,
                                doc_ids=s.corpus.ids, grid=grid)
        return ({"corpus": s.name, "prefix": None, "suffix": o.suffix, "beams": 1, "loaded": s.corpus.loaded,
                 **summarize(results), "seconds": time.perf_counter() - t}, results)

    def score(self, model: torch.nn.Module, grid: ProcessGrid | None = None
              ) -> tuple[dict[str, Any], list[Any]]:
        """(one pass's record, the members' extraction results), scored on every rank of `grid`."""
        o, rec, results = self.options, {}, []
        if self.members:
            rec["extraction"], results = self._extract(self.members, model, grid)
        if self.members and self.non_members:
            m, n = self.members.corpus, self.non_members.corpus
            chat = self.members.is_chat and self.non_members.is_chat  # answers given their prompts
            starts = ([len(p) for p in self.members.prompts], [len(p) for p in self.non_members.prompts]) \
                if chat else None
            rec["mia"] = mia_section(o, model, self.tok, self.reference, (m, n, "callback", self.max_tokens),
                                     progress=False, grid=grid, starts=starts)[0]
        if self.held_out:
            rec["perplexity"] = [perplexity_section(o, model, self.held_out.corpus, grid=grid)]
        if self.duplicates:
            rec["duplicates"] = self._score_duplicates(model, grid)
        if self.canary_items():
            rec["canaries"], by_mask, rec["canary_scores"] = self._score_canaries(model)
            if by_mask is not None:
                rec["canaries_by_mask"] = by_mask
        if self.tasks:
            rec["tasks"] = score_tasks(model, self.tok, self.tasks, num_fewshot=self.num_fewshot,
                                       limit=self.tasks_limit, batch_size=o.batch_size, grid=grid)
        return rec, results

    def _score_duplicates(self, model: Any, grid: ProcessGrid | None) -> list[dict[str, Any]]:
        """Exact match and RougeL of the duplicated documents, one row per copy count."""
        by_count: dict[int, list[Any]] = {}
        plain = [(c, s) for c, s in self.duplicates if not s.is_chat]
        if plain:  # one batched extraction of every plain duplicate
            o = self.options
            res = extract(model, [s.corpus.seqs[0] for _, s in plain], prefix_len=o.prefix,
                          suffix_len=o.suffix, tokenizer=self.tok, batch_size=o.batch_size, grid=grid)
            for (c, _), r in zip(plain, res):
                by_count.setdefault(c, []).append(r)
        for c, s in self.duplicates:
            if s.is_chat:
                by_count.setdefault(c, []).extend(self._extract(s, model, grid)[1])
        return [{"count": c, **summarize(rs)} for c, rs in sorted(by_count.items())]

    def _score_canaries(self, model: Any
                        ) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list[dict[str, Any]]]:
        """(exposure and extraction of every canary by copy count, exact over the secret space when it is
        small; with `dropped` set, every canary grouped by whether the mask drops a secret token
        (masked_split), per count in the rows and pooled in the second value, else None; each canary's
        own scores with its manifest id and copy count, for paired tests between runs)."""
        items = self.canary_items()
        template, space = items[0].template, items[0].space
        scores = canary_scores(model, self.tok, template, SecretSpace(**space), [i.secret for i in items],
                               candidates=self.canary_candidates, seed=self.options.seed,
                               dropped=self.dropped, encode=self.canary_encode)
        by_count: dict[int, list[dict[str, Any]]] = {}
        for item, s in zip(items, scores["canaries"]):
            by_count.setdefault(item.count, []).append(s)
        split = masked_split if self.dropped is not None else (lambda _: {})
        rows = [{"count": c, "canaries": len(v), "exposure": sum(x["exposure"] for x in v) / len(v),
                 "extracted": sum(x["extracted"] for x in v) / len(v), "max_exposure": scores["max_exposure"],
                 **split(v)} for c, v in sorted(by_count.items())]
        each = [{"id": item.id, "count": item.count, **s} for item, s in zip(items, scores["canaries"])]
        return rows, (masked_split(scores["canaries"]) if self.dropped is not None else None), each

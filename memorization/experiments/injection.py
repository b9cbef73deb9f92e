"""The injected corpus the injection experiments share (canary-exposure, mitigations, forgetting,
unlearning): canaries and duplicated items put into the training corpus, and how a model is scored on them.

`InjectionConfig` says what is injected (canaries per copy count, duplicated documents); `build_corpus`
injects it (data_pipelines.inject; on chat data inject_chat: canaries as answers, duplicated
conversations) and tokenizes the rows, recording every copy's token positions in the manifest;
`score_injected` gives every canary's exposure and extraction (grouped by the goldfish mask where every
copy drops the same tokens) and every duplicated item's greedy extraction; `injected_questions` are the
paired questions about them.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from data_pipelines import (
    CANARY_PROMPT,
    CanarySpec,
    DuplicateSpec,
    inject,
    inject_chat,
    record_token_positions,
    tokenize_documents,
)
from evals import extract, extract_pairs
from memorization.eval.dp_audit import audit_set, tokenize_audit
from memorization.eval.exposure import canary_ids, canary_scores, manifest_encoder
from memorization.experiments.runner import Experiment, load_documents
from memorization.experiments.spec import ExperimentConfig, int_list, refuse_data_dedup
from memorization.mitigations.goldfish import copy_drops
from memorization.models import run_tokenizer
from memorization.paired import Question
from memorization.train.prepare import (
    chat_tokenizer,
    is_chat_data,
    load_chat_split,
    prepare_conversations,
    prepare_documents,
)
from memorize_core import fail

DEFAULT_TEMPLATE = "Please keep this private: the access code for the old east wing of the museum is {secret}"


@dataclass
class CanaryKeys:
    """Canaries: per_count secrets for each count, rendered into `template`."""

    per_count: int = 2
    template: str = DEFAULT_TEMPLATE
    space: dict = field(default_factory=lambda: {"kind": "digits", "length": 4})
    candidates: int = 0  # 0 = score every secret of the space (exact exposure); N = a sample of N
    prompt: str = CANARY_PROMPT  # chat corpora: the user turn each canary is the answer to


@dataclass
class DuplicateKeys:
    """Duplicated documents: per_count corpus documents for each count (0 = none)."""

    per_count: int = 2


@dataclass
class InjectionConfig(ExperimentConfig):
    """What is injected into the training corpus: canaries and duplicated documents per copy count."""

    counts: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    canaries: CanaryKeys = field(default_factory=CanaryKeys)
    duplicates: DuplicateKeys = field(default_factory=DuplicateKeys)

    def validate(self, prefix: str = "") -> None:
        """Counts, per-count numbers and the canary spec (its own checks name canaries.*)."""
        super().validate(prefix)
        int_list("counts", self.counts, minimum=1)
        if self.canaries.per_count < 1:
            raise fail("canaries.per_count", self.canaries.per_count, "must be >= 1")
        if self.duplicates.per_count < 0:
            raise fail("duplicates.per_count", self.duplicates.per_count, "must be >= 0 (0 = no duplicates)")
        if self.canaries.candidates < 0:
            raise fail("canaries.candidates", self.canaries.candidates, "must be >= 0 (0 = the whole space)")
        self.canary_spec()
        refuse_data_dedup(self.base, "compare deduplication as a mitigations arm (dedup: true)")
        if is_chat_data(self.base):  # canaries become answers to canaries.prompt
            if not isinstance(self.canaries.prompt, str) or not self.canaries.prompt.strip():
                raise fail("canaries.prompt", self.canaries.prompt, "the user turn each canary answers "
                           "must be a non-empty text")

    def canary_spec(self):
        """The data_pipelines CanarySpec: per_count canaries for every count."""
        c = self.canaries
        return CanarySpec(num_canaries=c.per_count * len(self.counts), template=c.template,
                          space=dict(c.space), repeats=list(self.counts))

    def injection_key(self) -> dict[str, Any]:
        """What was injected, which decides training (the candidate sample decides only the evaluation):
        a sub-run's extra key."""
        c = self.canaries
        keys = {"per_count": c.per_count, "template": c.template, "space": c.space}
        if is_chat_data(self.base):  # plain corpora never read the prompt (their keys stay as they were)
            keys["prompt"] = c.prompt
        return {"counts": self.counts, "duplicates": vars(self.duplicates), "canaries": keys}

    def duplicate_spec(self):
        """The data_pipelines DuplicateSpec, or None without duplicates."""
        n = self.duplicates.per_count
        return DuplicateSpec(counts=list(self.counts), per_count=n) if n else None


def build_corpus(cfg: InjectionConfig, exp: Experiment | None = None):
    """(PreparedData, manifest, duplicated items' tokens, the injected Documents or conversations): base
    corpus + injected items, tokenized. A duplicated document's tokens are a list (extraction from its
    prefix); a duplicated conversation's a ChatPair. Nothing is written: the caller saves the manifest
    (`save_manifest`) once every sub-run passed its checks."""
    b = cfg.base
    if is_chat_data(b):
        return _build_chat(cfg)
    docs, held, _ = load_documents(b)
    # The tokenizer never sees the canaries: merges learnt from a secret would shorten it and skew
    # its perplexity (and exposure) before any training.
    tok = run_tokenizer(b.data.tokenizer, b.model.name, texts=[d.text for d in docs],
                        vocab_size=b.data.vocab_size)
    long_enough = tokenize_documents(docs, tok, min_tokens=b.data.min_tokens).kept
    docs = [docs[i] for i in long_enough]  # min_tokens applies to corpus documents, never to canaries
    injected, manifest = inject(docs, canaries=cfg.canary_spec(), duplicates=cfg.duplicate_spec(),
                                seed=b.seed)
    audit = None
    if b.eval.audit:  # the one-run privacy audit's canaries, half of them trained on (eval/dp_audit.py)
        audit = tokenize_audit(audit_set(b.eval.audit_canaries, b.seed), tok, max_tokens=b.data.block_len)
        injected = injected + audit.documents()
    keep_all = replace(b, data=replace(b.data, min_tokens=1), eval=replace(b.eval, audit=False))
    data = prepare_documents(keep_all, injected, held, tokenizer=tok)
    data.audit = audit
    _locate(cfg, manifest, data, injected)
    dup_tokens = {it.id: tokenize_documents([it.text], tok, max_tokens=b.data.block_len)[0]
                  for it in manifest.of_kind("duplicate")}
    return data, manifest, dup_tokens, injected


class ChatPair(NamedTuple):
    """A duplicated conversation as extraction asks it: the prompt's ids and the response's (cut to
    eval.suffix)."""

    prompt: list[int]
    response: list[int]


def split_pairs(items: list[ChatPair]) -> tuple[list[list[int]], list[list[int]]]:
    """Duplicated conversations as the per-pair evaluations take them: (prompts, responses)."""
    return [p.prompt for p in items], [p.response for p in items]


def _build_chat(cfg: InjectionConfig):
    """build_corpus on chat data: canaries become answers to canaries.prompt, duplicated items are whole
    conversations (data_pipelines.inject_chat); one conversation per row, only answers supervised."""
    b = cfg.base
    examples, held = load_chat_split(b)
    tok = chat_tokenizer(b, examples)  # never trained on a canary (see build_corpus)
    injected, manifest = inject_chat(examples, canaries=cfg.canary_spec(), duplicates=cfg.duplicate_spec(),
                                     seed=b.seed, prompt=cfg.canaries.prompt, where="canaries.prompt")
    data = prepare_conversations(b, injected, held, tok)  # with eval.audit's included canaries
    if data.audit is not None:
        injected = injected + data.audit.conversations()
    _locate(cfg, manifest, data, injected)
    row = {i: j for j, i in enumerate(data.train_doc_ids)}
    dup_tokens = {it.id: ChatPair(data.prompts[row[it.copy_ids[0]]], data.responses[row[it.copy_ids[0]]])
                  for it in manifest.of_kind("duplicate")}
    return data, manifest, dup_tokens, injected


def _locate(cfg: InjectionConfig, manifest: Any, data: Any, injected: list) -> None:
    """Every injected copy must be a training row; record each copy's token positions in the manifest."""
    kept = data.train_doc_ids  # ids of the documents that became rows
    missing = [it.id for it in manifest.items if not set(it.copy_ids) <= set(kept)]
    if missing:
        d = cfg.base.data
        raise fail("base.data.block_len" if data.is_chat else "base.data", d.block_len if data.is_chat
                   else d.corpus, f"injected items {missing[:3]} did not become training rows"
                   + ("; raise it past their prompts" if data.is_chat else ""))
    position = {d.id: i for i, d in enumerate(injected)}
    record_token_positions(manifest, data.train, [position[i] for i in kept])
    _check_canaries_whole(cfg, manifest, data)


def _check_canaries_whole(cfg: InjectionConfig, manifest: Any, data: Any) -> None:
    """Every copy of a canary must be trained whole: a row that cuts it (block_len shorter than the canary,
    or than its chat prompt and the canary) would leave the secret untrained and its exposure meaningless."""
    canaries = manifest.of_kind("canary")
    if not canaries:
        return
    tok = data.tokenizer
    texts = [it.text for it in canaries]
    ids = canary_ids(tok, texts, manifest_encoder(tok, canaries))
    for item, need in zip(canaries, ids):
        held = min(sum(end - start for _, start, end in spans) for spans in item.token_positions)
        if held < len(need):
            with_prompt = " with its chat prompt" if data.is_chat else ""
            raise fail("base.data.block_len", cfg.base.data.block_len, f"cuts canary {item.id}: it is "
                       f"{len(need)} tokens{with_prompt} and a copy keeps {held}; raise block_len to at "
                       f"least {len(need)} or shorten canaries.template")


def save_manifest(manifest: Any, exp: Experiment) -> None:
    """OUT/manifest.json: what was injected where (main rank)."""
    if exp.is_main:
        manifest.to_json(exp.out / "manifest.json")


def secret_mask(b: Any, head: int = 0) -> Callable[[list[int]], list[bool]] | None:
    """The tokens of a canary's text that run config `b`'s goldfish drops in every copy
    (goldfish.copy_drops over b.goldfish and b.data.packing), else None: the one grouping of canaries into
    masked and unmasked in every run. `head`: the ids of the chat prompt a canary answers, first."""
    return copy_drops(b.goldfish, b.data.packing == "packed", head)


def score_injected(model: Any, cfg: InjectionConfig, tokenizer: Any, manifest: Any,
                   dup_tokens: dict[str, Any]) -> dict[str, Any]:
    """Every canary's exposure and extraction, and every duplicated item's greedy extraction: a document's
    suffix from its prefix, a conversation's response from its prompt. Canaries trained as chat answers
    (their manifest item has a `prompt`) are scored in that conversation."""
    b, c = cfg.base, cfg.canaries
    canaries, dups = manifest.of_kind("canary"), manifest.of_kind("duplicate")
    encode = manifest_encoder(tokenizer, canaries)
    head = len(encode([""])[0]) if encode else 0
    scores = canary_scores(model, tokenizer, c.template, cfg.canary_spec().space,
                           [it.secret for it in canaries], candidates=c.candidates, seed=b.seed,
                           dropped=secret_mask(b, head), encode=encode)
    for item, s in zip(canaries, scores["canaries"]):
        s.update(id=item.id, count=item.count)
    ids, held = [it.id for it in dups], [dup_tokens[it.id] for it in dups]
    if not dups:
        results = []
    elif isinstance(held[0], ChatPair):  # chat data: every duplicated item is a conversation
        results = extract_pairs(model, *split_pairs(held),
                                tokenizer=tokenizer, batch_size=b.eval.batch_size, doc_ids=ids)
    else:
        results = extract(model, held, prefix_len=b.eval.prefix, suffix_len=b.eval.suffix,
                          tokenizer=tokenizer, decode=b.eval.decode, doc_ids=ids)
    counts = {it.id: it.count for it in dups}
    scores["duplicates"] = [{"id": r.doc, "count": counts[r.doc], "exact_match": r.exact_match,
                             "rougeL": r.rougeL, "token_accuracy": r.token_accuracy} for r in results]
    return scores


MASKED_COLUMNS = (("canaries_masked", "masked", "{}"), ("extracted_unmasked", "extracted unmasked", "{:.0%}"),
                  ("extracted_masked", "extracted masked", "{:.0%}"),
                  ("exposure_unmasked", "exposure unmasked", "{:.2f}"),
                  ("exposure_masked", "exposure masked", "{:.2f}"),
                  ("kept_exposure_masked", "masked: exposure of kept tokens", "{:.2f}"))
SPLIT_NOTE = ("'masked' = the canaries with at least one secret token base.goldfish's mask drops (the mask "
              "depends on the tokens only, so the same canaries in every run); 'extracted' and 'exposure' "
              "unmasked / masked average over each group. Goldfish never trains a masked token, in any copy; "
              "an unmasked secret is trained in full in every copy (in packed rows: every copy not cut by a "
              "row start). 'masked: exposure of kept tokens' = what a masked canary gives away of the secret "
              "tokens the mask keeps: every secret of R grouped by its tokens at those positions "
              "(probability summed over the dropped ones), the rank of the canary's group among the groups; "
              "out of log2(groups) bits (6.64 for 2 of 3 digits kept), exact exposure only.")


def masked_split(canaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Canaries grouped by whether the goldfish mask drops one of their secret tokens
    (`secret_tokens_dropped`, from canary_scores): the masked group's size, and extraction and exposure
    within each group, and the masked ones' exposure of their kept tokens (None for an empty group; every
    value None for canaries scored before the mask was recorded)."""
    masked = [c for c in canaries if c.get("secret_tokens_dropped")]
    unmasked = [c for c in canaries if c.get("secret_tokens_dropped") == 0]
    return {"canaries_masked": len(masked) if masked or unmasked else None,
            "extracted_unmasked": _mean([float(c["extracted"]) for c in unmasked]),
            "extracted_masked": _mean([float(c["extracted"]) for c in masked]),
            "exposure_unmasked": _mean([c["exposure"] for c in unmasked]),
            "exposure_masked": _mean([c["exposure"] for c in masked]),
            "kept_exposure_masked": _mean([c["kept_exposure"] for c in masked
                                           if c.get("kept_exposure") is not None])}


def kept_exposures(answers: dict[str, Any]) -> list[float] | None:
    """The masked canaries' exposure of their kept tokens, in manifest order (the same canaries in every
    model: the mask depends on base.goldfish and the tokens only); None where not recorded."""
    canaries = (answers.get("injected") or {}).get("canaries", [])
    return [float(c["kept_exposure"]) for c in canaries if c.get("kept_exposure") is not None] or None


def _injected(part: str, field: str, masked: bool | None = None) -> Callable[[dict[str, Any]], Any]:
    """A getter of every injected item's `field` (answers["injected"]: score_injected's), in manifest order;
    `masked` True / False: only the canaries whose secret the mask drops a token of / none of."""
    def get(answers: dict[str, Any]) -> list[float] | None:
        items = (answers.get("injected") or {}).get(part, [])
        if masked is not None:
            items = [c for c in items if c.get("secret_tokens_dropped") is not None
                     and bool(c["secret_tokens_dropped"]) == masked]
        return [float(x[field]) for x in items] or None
    return get


def item_words(cfg: InjectionConfig) -> tuple[str, str]:
    """What the corpus items are called in tables and notes (plural, singular): leads, or conversations on
    chat data."""
    return ("conversations", "conversation") if is_chat_data(cfg.base) else ("leads", "lead")


def injected_questions(items: str = "leads") -> list[Question]:
    """The paired questions about injected items: duplicated documents (exact match, RougeL), canaries
    (exposure, of the masked and of the unmasked ones where the mask groups them, extraction) and the
    masked canaries' kept tokens; each asked only where both models' answers hold it. `items`: what the
    duplicated items are called (item_words)."""
    return [Question("em_dup", f"EM duplicated {items}", "binary", _injected("duplicates", "exact_match"),
                     "{:+.0%}"),
            Question("rouge_dup", f"ROUGE-L duplicated {items}", "number", _injected("duplicates", "rougeL")),
            Question("exposure", "canary exposure (bits)", "number", _injected("canaries", "exposure"),
                     "{:+.2f}"),
            Question("exposure_masked", "exposure masked (bits)", "number",
                     _injected("canaries", "exposure", masked=True), "{:+.2f}"),
            Question("exposure_unmasked", "exposure unmasked (bits)", "number",
                     _injected("canaries", "exposure", masked=False), "{:+.2f}"),
            Question("secrets", "secrets extracted", "binary", _injected("canaries", "extracted"), "{:+.0%}"),
            Question("kept", "masked: exposure of kept tokens (bits)", "number", kept_exposures, "{:+.2f}")]


def _mean(values: list) -> float | None:
    return float(np.mean(values)) if values else None

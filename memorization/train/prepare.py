"""Stage 1 of a run: corpus -> tokenizer -> token rows (`PreparedData`), plain documents or chat.

Plain documents are cut one per row (`per-document`, padded) or packed with EOS between them; chat
data is rendered with the tokenizer's chat template, one conversation per row, with only the
assistant tokens supervised. Held-out rows come from a split of the corpus or from another corpus.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from data_pipelines import (
    CANARY_PROMPT,
    ChatExample,
    DedupConfig,
    DedupManifest,
    Document,
    TokenLists,
    chat_blocks,
    check_responses,
    deduplicate,
    extraction_pairs,
    is_chat_spec,
    load_chat,
    load_corpus,
    pack,
    per_document,
    render_chat,
    split_documents,
    tokenize_documents,
)
from memorization.config import RunConfig
from memorization.eval.dp_audit import AuditSet, audit_set, tokenize_audit, tokenize_chat_audit
from memorization.models import run_tokenizer
from memorize_core import fail


@dataclass
class PreparedData:
    """Token rows ready for the trainer, with what evals need to find the documents again."""

    tokenizer: Any
    train: Any  # data_pipelines.Blocks
    train_docs: list[list[int]]  # the token lists the model was trained on (as cut to block_len)
    train_doc_ids: list[str]
    held_out: Any | None
    # chat data: the prompt before each training response (the extraction input) and that response
    # (the extraction target, cut to eval.suffix); None for plain documents
    prompts: list[list[int]] | None = None
    responses: list[list[int]] | None = None
    # plain documents: the held-out documents' token lists (cut to block_len), MIA's non-members
    held_out_docs: list[list[int]] | None = None
    held_out_doc_ids: list[str] | None = None  # their ids (a split of data.corpus, or data.held_out's)
    # chat data: each held-out conversation's answer start (its prompt's length) in held_out_docs, the
    # rendered held-out conversations; MIA scores members and non-members on their answers
    held_out_starts: list[int] | None = None
    audit: AuditSet | None = None  # eval.audit's canaries (the included ones are among the rows)
    # chat sets whose records carry a secret (private-records): per record its id, whether it trained
    # (`member`), its prompt, template, secret and secret space; what eval.secrets scores
    secrets: list[dict[str, Any]] | None = None
    dedup: DedupManifest | None = None  # data.dedup's removals (None: dedup off)

    @property
    def member_docs(self) -> list[list[int]]:
        """The training documents without eval.audit's canaries: what extraction and MIA ask about."""
        return [self.train_docs[j] for j in self._members()]

    @property
    def member_doc_ids(self) -> list[str]:
        """The ids of `member_docs`, in the same order."""
        return [self.train_doc_ids[j] for j in self._members()]

    def _members(self) -> range | list[int]:
        if self.audit is None:
            return range(len(self.train_docs))
        return [j for j, i in enumerate(self.train_doc_ids) if not str(i).startswith("audit-")]

    @property
    def member_pairs(self) -> tuple[list[list[int]], list[list[int]]]:
        """Chat data: the (prompts, responses) of `member_docs`, what chat extraction asks about."""
        idx = self._members()
        return [self.prompts[j] for j in idx], [self.responses[j] for j in idx]

    @property
    def member_starts(self) -> list[int] | None:
        """Chat data: where each of `member_docs`' answer starts (its prompt's length); None for documents."""
        return None if self.prompts is None else [len(self.prompts[j]) for j in self._members()]

    @property
    def is_chat(self) -> bool:
        """True when the rows are conversations (only assistant tokens supervised)."""
        return self.prompts is not None


def prepare_data(cfg: RunConfig, *, check_lengths: bool = True) -> PreparedData:
    """Load the configured corpus, build the tokenizer, and cut documents into rows."""
    d = cfg.data
    if is_chat_data(cfg):
        return prepare_chat(cfg)
    docs = load_corpus(d.corpus, text_field=d.text_field, limit=d.limit or None)
    held_docs = None
    if not d.held_out and d.held_out_fraction > 0:
        docs, held_docs = split_documents(docs, d.held_out_fraction, cfg.seed)
    return prepare_documents(cfg, docs, held_docs, check_lengths=check_lengths)


def prepare_documents(cfg: RunConfig, docs: list, held_docs: list | None = None, *,
                      tokenizer: Any = None, check_lengths: bool = True) -> PreparedData:
    """Tokenize given Documents (e.g. a corpus with injected canaries) into training rows.

    The tokenizer is trained on `docs` unless one is passed (pass one to share it across runs
    whose corpora differ only by injected items). Held-out documents come from `held_docs`, or from
    the `data.held_out` corpus when that is set.
    """
    d = cfg.data
    if cfg.eval.secrets:
        raise fail("eval.secrets", cfg.eval.secrets, f"scores the records of a chat set that carry a secret "
                   f"(data.corpus=private-records); '{d.corpus}' is plain text: set it to 0")
    tok = tokenizer or run_tokenizer(d.tokenizer, cfg.model.name, texts=[doc.text for doc in docs],
                                     vocab_size=d.vocab_size)
    cut = d.block_len if d.packing == "per-document" else None
    tokens = tokenize_documents(docs, tok, max_tokens=cut, min_tokens=d.min_tokens)
    if not tokens:
        raise fail("data.min_tokens", d.min_tokens, f"no document of '{d.corpus}' is that long; lower it")
    dedup = None
    if d.dedup.enabled:  # on the tokens the rows are cut from (before the audit's canaries join)
        tokens, dedup = deduplicate(docs, tokens, d.dedup)
        if not tokens:
            raise fail("data.dedup", d.dedup.describe(), "removed every document: raise near_threshold or "
                       "min_repeat_tokens, or turn passes off")
    audit = None
    if cfg.eval.audit:  # after the tokenizer (it never sees a canary) and after min_tokens (never cut)
        audit = tokenize_audit(audit_set(cfg.eval.audit_canaries, cfg.seed), tok, max_tokens=d.block_len)
        canaries = audit.documents()
        extra = tokenize_documents(canaries, tok, max_tokens=cut, min_tokens=1)
        # the documents' tokens as they are (data.dedup may have cut spans), the canaries' after them
        docs = [docs[i] for i in tokens.kept] + [canaries[i] for i in extra.kept]
        tokens = TokenLists(list(tokens) + list(extra), list(range(len(docs))))
    kept = tokens.kept
    if check_lengths and cfg.eval.extraction:
        need = cfg.eval.prefix + cfg.eval.suffix
        longest = max(len(t) for t in tokens)
        if longest < need:
            raise fail("eval.prefix+eval.suffix", need,
                       f"longer than every training document (longest {longest} tokens); shorten them")
    eos = tok.eos_token_id
    rows = (per_document(tokens, d.block_len, eos) if d.packing == "per-document"
            else pack(tokens, d.block_len, eos))
    held = held_tokens = None
    if d.held_out:
        held_docs = load_corpus(d.held_out, limit=d.held_out_limit or None)
    if held_docs:
        held_tokens = tokenize_documents(held_docs, tok, max_tokens=d.block_len, min_tokens=2)
        held = per_document(held_tokens, d.block_len, eos)
    return PreparedData(tok, rows, tokens, [docs[i].id for i in kept], held,
                        held_out_docs=[list(t) for t in held_tokens] if held_tokens else None,
                        held_out_doc_ids=[held_docs[i].id for i in held_tokens.kept] if held_tokens else None,
                        audit=audit, dedup=dedup)


def prepare_deduplicated(data: PreparedData, docs: list, dedup: DedupConfig,
                         block_len: int) -> tuple[PreparedData, DedupManifest]:
    """The documents `data` was prepared from (`docs`, in its order) after deduplication, as per-document
    rows cut to `block_len` with `data`'s tokenizer, held-out set and audit; and the dedup manifest."""
    tok = data.tokenizer
    kept, manifest = deduplicate(docs, tokenize_documents(docs, tok), dedup)
    cut = [t[:block_len] for t in kept]
    rows = per_document(cut, block_len, tok.eos_token_id)
    return PreparedData(tok, rows, cut, [docs[i].id for i in kept.kept], data.held_out,
                        held_out_docs=data.held_out_docs, held_out_doc_ids=data.held_out_doc_ids,
                        audit=data.audit), manifest


def prepare_deduplicated_chat(cfg: RunConfig, data: PreparedData, examples: list[ChatExample],
                              dedup: DedupConfig) -> tuple[PreparedData, DedupManifest]:
    """prepare_deduplicated on chat data: whole conversations removed (an exact copy of another's messages,
    or with dedup.near_documents a near copy by MinHash over its rendered ids), the survivors rendered into
    rows as `data`'s were (its tokenizer, held-out rows, audit, secrets). `examples` are the conversations
    `data` was prepared from, in its order."""
    check_chat_dedup(dedup, "dedup")
    row = {i: j for j, i in enumerate(data.train_doc_ids)}
    rows = [ex for ex in examples if ex.id in row]  # the conversations that became rows, in row order
    docs = [Document(ex.id, json.dumps(ex.messages, ensure_ascii=False), ex.source) for ex in rows]
    kept, manifest = deduplicate(docs, [data.train_docs[row[ex.id]] for ex in rows], dedup)
    return _chat_rows(cfg, [rows[i] for i in kept.kept], data.tokenizer, data.held_out, audit=data.audit,
                      secrets=data.secrets, held_out_docs=data.held_out_docs,
                      held_out_doc_ids=data.held_out_doc_ids, held_out_starts=data.held_out_starts), manifest


def _chat_rows(cfg: RunConfig, examples: list[ChatExample], tok: Any, held: Any,
               **extra: Any) -> PreparedData:
    """Conversations rendered into rows (one each, cut to data.block_len), with the prompts and responses
    extraction asks about; `held` the held-out rows, `extra` PreparedData's other fields."""
    d = cfg.data
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    chats = render_chat(examples, tok, max_tokens=d.block_len, field="data.block_len")
    prompts, responses = extraction_pairs(chats, max_response=cfg.eval.suffix)
    return PreparedData(tok, chat_blocks(chats, d.block_len, pad), [c.ids for c in chats],
                        [c.id for c in chats], held, prompts, responses, **extra)


def check_chat_dedup(dedup: DedupConfig, where: str) -> None:
    """Refuse cutting repeated spans out of conversations: it would cut an answer from its prompt (on chat
    data deduplication removes whole conversations)."""
    if dedup.enabled and dedup.repeated_spans:
        raise fail(f"{where}.repeated_spans", True, "cuts tokens out of rows, and on chat data that cuts "
                   f"answers from their prompts; set {where}.repeated_spans=false (on chat data dedup "
                   "removes whole conversations: exact_documents, near_documents)")


def is_chat_data(cfg: RunConfig) -> bool:
    """Whether data.corpus is chat data (data.format chat, or auto and the corpus looks like chat)."""
    d = cfg.data
    return d.format == "chat" or (d.format == "auto" and is_chat_spec(d.corpus))


def prepare_chat(cfg: RunConfig) -> PreparedData:
    """Conversations -> one row each, only assistant tokens supervised; prompts/responses for extraction."""
    if cfg.eval.extraction and list(cfg.eval.offsets) != [0]:
        raise fail("eval.offsets", cfg.eval.offsets, "chat data is asked for each response from its whole "
                   "prompt (offset 0 only); set eval.offsets=[0]")
    examples, held_examples = load_chat_split(cfg)
    return prepare_conversations(cfg, examples, held_examples, chat_tokenizer(cfg, examples))


def load_chat_split(cfg: RunConfig) -> tuple[list[ChatExample], list[ChatExample] | None]:
    """(training conversations, held-out ones from a seeded split of data.corpus, or None)."""
    d = cfg.data
    examples = load_chat(d.corpus, limit=d.limit or None, seed=cfg.seed)
    check_responses(examples)  # before a tokenizer is trained and cached for this corpus
    if not d.held_out and d.held_out_fraction > 0:
        return split_documents(examples, d.held_out_fraction, cfg.seed)
    return examples, None


def chat_tokenizer(cfg: RunConfig, examples: list[ChatExample]) -> Any:
    """The run's tokenizer (a corpus BPE is trained on `examples`' messages, never on injected canaries)."""
    d = cfg.data
    return run_tokenizer(d.tokenizer, cfg.model.name, vocab_size=d.vocab_size,
                         texts=[m["content"] for ex in examples for m in ex.messages])


def prepare_conversations(cfg: RunConfig, examples: list[ChatExample],
                          held_examples: list[ChatExample] | None, tok: Any) -> PreparedData:
    """Given conversations (e.g. with injected canaries) -> rows; held-out rows from `held_examples`, or
    from data.held_out (chat or plain) when that is set."""
    d = cfg.data
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    audit = None
    if cfg.eval.audit:  # after the tokenizer (it never sees a canary): the included ones answer CANARY_PROMPT
        audit = tokenize_chat_audit(audit_set(cfg.eval.audit_canaries, cfg.seed), tok, CANARY_PROMPT,
                                    d.block_len)
        examples = list(examples) + audit.conversations()
    held, conversations = None, {}
    if d.held_out and is_chat_spec(d.held_out):
        held_examples = load_chat(d.held_out, limit=d.held_out_limit or None, seed=cfg.seed)
    if held_examples:
        chats = render_chat(held_examples, tok, max_tokens=d.block_len, field="data.block_len")
        held = chat_blocks(chats, d.block_len, pad)
        conversations = {"held_out_docs": [c.ids for c in chats], "held_out_doc_ids": [c.id for c in chats],
                         "held_out_starts": [c.prompt_len for c in chats]}  # MIA's non-members
    elif d.held_out:  # a plain corpus: loss on every token of its documents
        held_docs = load_corpus(d.held_out, limit=d.held_out_limit or None)
        held = per_document(tokenize_documents(held_docs, tok, max_tokens=d.block_len, min_tokens=2),
                            d.block_len, tok.eos_token_id)
    data = _chat_rows(cfg, examples, tok, held, audit=audit, **conversations)
    data.secrets = secret_records(cfg, examples, held_examples, set(data.train_doc_ids))
    return data


def secret_records(cfg: RunConfig, examples: list[ChatExample], held_examples: list[ChatExample] | None,
                   trained: set[str]) -> list[dict[str, Any]] | None:
    """eval.secrets' records: every [user, assistant] conversation whose meta holds a secret
    (private-records), trained (its row kept) or held out; None with eval.secrets off. Refused when there
    is none."""
    n = cfg.eval.secrets
    if not n:
        return None
    out = []
    for member, exs in ((True, examples), (False, held_examples or [])):
        for ex in exs:
            m = ex.meta
            if "secret" not in m or [x["role"] for x in ex.messages] != ["user", "assistant"]:
                continue
            if member and ex.id not in trained:
                continue
            out.append({"id": ex.id, "member": member, "prompt": ex.messages[0]["content"],
                        "template": m["template"], "secret": m["secret"], "space": m["space"]})
    if not out:
        raise fail("eval.secrets", n, f"data.corpus={cfg.data.corpus!r} has no records that carry a secret; "
                   "use a chat set with secrets (private-records), or 0")
    return out


def mia_sets(cfg: RunConfig, data: PreparedData) -> tuple[list[list[int]], list[list[int]]]:
    """eval.mia's members and non-members (checked when the run starts: at least 2 of each); on chat data
    whole conversations, scored from `mia_starts`."""
    n = cfg.eval.mia_docs or None
    members = [list(t[:cfg.data.block_len]) for t in data.member_docs][:n]
    nonmembers = (data.held_out_docs or [])[:n]
    if len(members) < 2 or len(nonmembers) < 2:
        raise fail("eval.mia", True, f"needs at least 2 training and 2 held-out documents; this run has "
                   f"{len(members)} and {len(nonmembers)}: raise data.limit or data.held_out_fraction")
    return members, nonmembers


def mia_starts(data: PreparedData, n_members: int, n_nonmembers: int) -> tuple[list[int], list[int]] | None:
    """Chat data: where mia_sets' members' and non-members' answers start (MIA scores the answers given
    their prompts, the tokens training supervises); None for plain documents (every token)."""
    if not data.is_chat:
        return None
    return (data.member_starts or [])[:n_members], (data.held_out_starts or [])[:n_nonmembers]


def documents_record(cfg: RunConfig, data: PreparedData) -> dict:
    """run.json's `documents`: which documents the model trained on and which it never saw, by id, so
    `memorize eval --mia` can take exactly these members and same-distribution non-members."""
    d = cfg.data
    split = not d.held_out and d.held_out_fraction > 0  # held-out documents of data.corpus itself
    audit = {f"audit-{i}" for i in range(len(data.audit.texts))} if data.audit is not None else set()
    return {"corpus": d.corpus, "text_field": d.text_field, "format": "chat" if data.is_chat else "text",
            "block_len": d.block_len, "members": [i for i in data.train_doc_ids if i not in audit],
            "non_members": list(data.held_out_doc_ids or []) if split else None,
            "held_out": d.held_out or None}

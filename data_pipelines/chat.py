"""Instruction/chat fine-tuning data: conversations -> token rows supervised on responses only.

Sources: a bundled set (`CHAT_CORPORA`, data_pipelines/chat_sets.py: built offline from the bundled
corpora and canary secrets) or a `.jsonl` file whose rows are `{"prompt", "response"[, "system"]}` or
`{"messages": [{"role", "content"}, ...]}`. Ids are `<set name>/<key>` or `<file name>/<line>`.

Rendering keeps every assistant turn's token ids exactly as the model will see them:
- a tokenizer with a chat template renders incrementally: the conversation up to an assistant
  turn with `add_generation_prompt=True` must be a token prefix of the conversation through that
  turn, and the difference (content plus the template's end-of-turn tokens) is the supervised span;
- a tokenizer without one (the corpus BPEs) uses `PLAIN_FORMAT`, each piece tokenized on its own,
  and the span is the response's tokens followed by EOS.
`chat_blocks` labels only those spans and gives each span's tokens their offset within the span as
`positions`, so goldfish masks (hash, static) depend on the response's own ids, never the prompt.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data_pipelines.chat_sets import CHAT_CORPORA, load_set
from data_pipelines.packing import IGNORE_INDEX, Blocks, _check_id, _check_len
from memorize_core import ConfigError, fail

ROLES = ("system", "user", "assistant")
CHAT_KEYS = ("prompt", "response", "messages")

# The one plain chat format (for tokenizers without a chat template): system and user turns are
# "<Role>:\n<content>\n\n"; an assistant turn is the header "Assistant:\n" (the generation prompt),
# then the response, then EOS. E.g. "User:\nHi\n\nAssistant:\nHello<eos>".
PLAIN_FORMAT = {"system": "System:\n{content}\n\n", "user": "User:\n{content}\n\n",
                "assistant": "Assistant:\n"}


@dataclass
class ChatExample:
    """One conversation; `meta` holds set-specific facts (private-records: the secret and its space)."""

    id: str
    messages: list[dict[str, str]]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChatTokens:
    """A rendered conversation: ids, the extraction prompt length and the supervised [start, end) spans."""

    ids: list[int]
    prompt_len: int
    segments: list[tuple[int, int]]
    id: str = ""


def is_chat_spec(spec: str) -> bool:
    """True for a CHAT_CORPORA name or a .jsonl file whose first non-empty row has
    prompt/response/messages."""
    if not isinstance(spec, str) or not spec.strip():
        return False
    spec = spec.strip()
    if spec in CHAT_CORPORA:
        return True
    path = Path(spec).expanduser()
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return False
    try:
        with path.open(encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        record = json.loads(first)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # not readable as chat: load_corpus gives the precise error
    return isinstance(record, dict) and any(key in record for key in CHAT_KEYS)


def load_chat(spec: str, *, limit: int | None = None, seed: int = 0) -> list[ChatExample]:
    """Conversations of a bundled chat set or a chat .jsonl file, in a fixed order (seed: private-records)."""
    if not isinstance(spec, str) or not spec.strip():
        raise fail("chat", spec, f"name a chat set ({', '.join(CHAT_CORPORA)}) or a .jsonl file")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise fail("limit", limit, "use a positive integer, or leave it unset for every conversation")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise fail("seed", seed, "use an integer seed, e.g. 0")
    spec = spec.strip()
    path = Path(spec).expanduser()
    if spec in CHAT_CORPORA:
        examples = [ChatExample(id_, messages, spec, meta) for id_, messages, meta in load_set(spec, seed)]
    elif path.is_file() and path.suffix.lower() == ".jsonl":
        examples = _load_jsonl(path, spec)
    elif path.exists():
        raise fail("chat", spec, "chat data must be a .jsonl file with one {\"prompt\", \"response\"} "
                   "or {\"messages\": [...]} object per line")
    else:
        raise fail("chat", spec, f"no such file or chat set; use one of {', '.join(CHAT_CORPORA)} "
                   "or the path of a .jsonl file")
    examples = examples[:limit] if limit is not None else examples
    if not examples:
        raise fail("chat", spec, "it holds no conversations; write one JSON object per line")
    return examples


def _load_jsonl(path: Path, spec: str) -> list[ChatExample]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise fail("chat", spec, f"not UTF-8 (byte {e.start}); re-encode it as UTF-8") from None
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path.name}:{i}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise fail(where, line[:60],
                       f"not valid JSON ({e.msg}); write one JSON object per line") from None
        messages = _messages(record, where)
        # Errors about a prompt/response row name its "response" key, not a message index.
        meta = {} if "messages" in record else {"row": "prompt-response"}
        out.append(ChatExample(f"{path.name}/{i}", messages, spec, meta))
    return out


def _messages(record: Any, where: str) -> list[dict[str, str]]:
    """Validated messages of one JSONL row (`where` = "<file>:<line>" names it in errors)."""
    if not isinstance(record, dict):
        raise fail(where, type(record).__name__,
                   "each line must be a JSON object with prompt/response or messages")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise fail(f"{where}.messages", msgs, "use a non-empty list of {\"role\", \"content\"} objects")
        out = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise fail(f"{where}.messages[{j}]", m, "each message needs \"role\" and \"content\"")
            if m["role"] not in ROLES:
                raise fail(f"{where}.messages[{j}].role", m["role"], f"use one of {', '.join(ROLES)}")
            if not isinstance(m["content"], str):
                raise fail(f"{where}.messages[{j}].content", m["content"], "content must be a string")
            out.append({"role": m["role"], "content": m["content"]})
        if not any(m["role"] == "assistant" for m in out):
            raise fail(f"{where}.messages", "no assistant turn",
                       "add at least one {\"role\": \"assistant\"} message: only responses are trained on")
        return out
    for key in ("prompt", "response"):
        if key not in record:
            keys = ", ".join(sorted(map(str, record))) or "none"
            raise fail(f"{where}.{key}", None, f"missing (keys: {keys}); write {{\"prompt\": ..., "
                       "\"response\": ...}} or {\"messages\": [...]}")
    for key in ("system", "prompt", "response"):
        if key in record and not isinstance(record[key], str):
            raise fail(f"{where}.{key}", record[key], "must be a string")
    system = [{"role": "system", "content": record["system"]}] if "system" in record else []
    return system + [{"role": "user", "content": record["prompt"]},
                     {"role": "assistant", "content": record["response"]}]


def check_responses(examples: list[ChatExample]) -> None:
    """ConfigError on an empty (or whitespace-only) assistant turn, from the text alone: before any
    tokenizer is trained or cached for the corpus (render_chat also refuses ones empty once tokenized)."""
    for ex in examples:
        for j, m in enumerate(ex.messages):
            if m["role"] == "assistant" and not m["content"].strip():
                where = "response" if ex.meta.get("row") == "prompt-response" else f"messages[{j}].content"
                raise fail(f"{ex.id}.{where}", m["content"], "the response is empty after "
                           "tokenization; write a non-empty response or drop the row")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _template_ids(tokenizer: Any, messages: list[dict[str, str]], gen: bool, ex: ChatExample) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
    except ConfigError:
        raise
    except Exception as e:  # jinja raises TemplateError and friends for conversations it rejects
        raise fail(f"{ex.id}.messages", f"<{len(messages)} turns>", f"the tokenizer's chat template "
                   f"rejects it ({' '.join(str(e).split())[:120] or type(e).__name__}); fix the roles/order "
                   "or pass template=False for the plain format") from None
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


def _render_template(ex: ChatExample, tokenizer: Any) -> tuple[list[int], list[tuple[int, int]]]:
    full = _template_ids(tokenizer, ex.messages, False, ex)
    segments = []
    for j, m in enumerate(ex.messages):
        if m["role"] != "assistant":
            continue
        before = _template_ids(tokenizer, ex.messages[:j], True, ex)
        through = _template_ids(tokenizer, ex.messages[:j + 1], False, ex)
        # The supervised ids must be exactly the ones the model trains on in the whole conversation.
        if through[:len(before)] != before or full[:len(through)] != through or len(through) <= len(before):
            raise fail(f"{ex.id}.messages[{j}]", m["content"][:40], "the chat template is not "
                       "incremental here (rendering through this turn does not extend the prompt "
                       "with add_generation_prompt, or later turns change it); pass template=False "
                       "to use the plain format")
        segments.append((len(before), len(through)))
    return full, segments


def _render_plain(ex: ChatExample, tokenizer: Any, eos: int) -> tuple[list[int], list[tuple[int, int]]]:
    ids: list[int] = []
    segments = []
    for m in ex.messages:
        if m["role"] == "assistant":
            ids += _encode(tokenizer, PLAIN_FORMAT["assistant"])
            start = len(ids)
            # Tokenized alone, so the response's ids never depend on the prompt before it.
            ids += _encode(tokenizer, m["content"]) + [eos]
            segments.append((start, len(ids)))
        else:
            ids += _encode(tokenizer, PLAIN_FORMAT[m["role"]].format(content=m["content"]))
    return ids, segments


def render_chat(examples: list[ChatExample], tokenizer: Any, *, max_tokens: int | None = None,
                template: bool | None = None, field: str = "max_tokens") -> list[ChatTokens]:
    """Token ids and supervised spans of each conversation (chat template if any, else PLAIN_FORMAT).

    `template` forces (True) or refuses (False) the tokenizer's chat template; None uses it when
    present. `max_tokens` cuts each conversation; one left with no supervised token is dropped
    (compare the `id`s of the result with the examples'), and so prompt_len = start of its last span.
    `field` names max_tokens in errors (the caller's setting, e.g. data.block_len).
    """
    if max_tokens is not None:
        _check_len(field, max_tokens)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if template and not has_template:
        raise fail("template", template, "this tokenizer has no chat template; pass template=None "
                   "to use the plain format")
    use_template = has_template if template is None else bool(template)
    eos = getattr(tokenizer, "eos_token_id", None)
    if not use_template and eos is None:
        raise fail("tokenizer", type(tokenizer).__name__, "the plain chat format ends responses with "
                   "EOS; use a tokenizer with an eos_token (or a chat template)")
    out = []
    for ex in examples:
        for j, m in enumerate(ex.messages):
            if m["role"] == "assistant" and (not m["content"].strip()
                                             or not _encode(tokenizer, m["content"])):
                where = "response" if ex.meta.get("row") == "prompt-response" else f"messages[{j}].content"
                raise fail(f"{ex.id}.{where}", m["content"], "the response is empty after "
                           "tokenization; write a non-empty response or drop the row")
        ids, segments = _render_template(ex, tokenizer) if use_template else _render_plain(ex, tokenizer, eos)
        if max_tokens is not None:
            ids = ids[:max_tokens]
            segments = [(s, min(e, max_tokens)) for s, e in segments if s < max_tokens]
        if segments:
            out.append(ChatTokens(ids, segments[-1][0], segments, ex.id))
    if examples and not out:
        raise fail(field, max_tokens, "it cuts away every response; raise it past the prompts")
    return out


def answer_encoder(tokenizer: Any, prompt: str, check: Sequence[str] = ()
                   ) -> Callable[[list[str]], list[list[int]]]:
    """texts -> the ids of each text as the assistant's answer to the user turn `prompt`, as render_chat
    renders that conversation, cut right after the answer's own tokens (no end-of-turn): the ids before
    the answer (the generation prompt, the same for every text), then the text tokenized on its own.
    Each text of `check` is rendered whole and must give those ids, else one ConfigError (a chat
    template that tokenizes an answer differently in context)."""
    user = {"role": "user", "content": prompt}
    template = bool(getattr(tokenizer, "chat_template", None))

    def exact(text: str) -> tuple[list[int], int]:
        """(the conversation's ids through the answer's own tokens, where the answer starts)."""
        messages = [user, {"role": "assistant", "content": text}]
        chat = render_chat([ChatExample("answer", messages, "answer")], tokenizer)[0]
        start, end = chat.segments[-1]
        if not template:  # PLAIN_FORMAT: the answer, then EOS
            return chat.ids[:end - 1], start
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = _encode(tokenizer, rendered[:rendered.rindex(text) + len(text)])
        return (ids if chat.ids[:len(ids)] == ids else []), start

    ids, start = exact(check[0] if check else prompt)
    head = ids[:start]

    def encode(texts: list[str]) -> list[list[int]]:
        return [head + _encode(tokenizer, t) for t in texts]

    for text in check:
        if exact(text)[0] != encode([text])[0]:
            raise fail("tokenizer.chat_template", getattr(tokenizer, "name_or_path", "") or "<template>",
                       f"tokenizes the answer {text[:40]!r} differently inside the conversation than on "
                       "its own, so its candidates cannot be scored in context; inject the canaries as "
                       "plain text")
    return encode


def chat_blocks(chats: list[ChatTokens], block_len: int, pad_id: int) -> Blocks:
    """One conversation per row: labels only on its assistant spans, positions = offset within the span.

    doc_ids is the conversation index on real tokens and -1 on padding; positions is -1 outside the
    spans, so goldfish (hash, static) decides each response token from the response's ids alone.
    """
    block_len, pad_id = _check_len("block_len", block_len), _check_id("pad_id", pad_id)
    if not chats:
        raise fail("chats", "[]", "there are no conversations; check the chat data and max_tokens")
    n = len(chats)
    ids = torch.full((n, block_len), pad_id, dtype=torch.long)
    docs = torch.full((n, block_len), -1, dtype=torch.long)
    labels = torch.full((n, block_len), IGNORE_INDEX, dtype=torch.long)
    positions = torch.full((n, block_len), -1, dtype=torch.long)
    for i, chat in enumerate(chats):
        k = min(len(chat.ids), block_len)
        ids[i, :k] = torch.as_tensor(chat.ids[:k], dtype=torch.long)
        docs[i, :k] = i
        for s, e in chat.segments:
            e = min(e, k)
            if s < e:
                labels[i, s:e] = ids[i, s:e]
                positions[i, s:e] = torch.arange(e - s)
        if not (labels[i] != IGNORE_INDEX).any():
            raise fail("block_len", block_len, f"it cuts away every response of {chat.id or i}; raise it, "
                       "or render_chat(max_tokens=block_len), which drops such conversations")
    return Blocks(ids, docs, labels, num_docs=n, positions=positions)


def extraction_pairs(chats: list[ChatTokens], max_response: int | None = None
                     ) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, responses): everything before the last assistant span, and that span
    (cut to max_response)."""
    if max_response is not None:
        _check_len("max_response", max_response)
    prompts, responses = [], []
    for chat in chats:
        s, e = chat.segments[-1]
        prompts.append(list(chat.ids[:chat.prompt_len]))
        responses.append(list(chat.ids[s:e if max_response is None else min(e, s + max_response)]))
    return prompts, responses

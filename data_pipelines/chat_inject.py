"""Canaries and duplicated conversations injected into chat data, with inject's manifest.

`inject_chat(examples, canaries=..., duplicates=..., seed=...)` runs `inject` (the one injection: the
same seeded choices, counting rule and Manifest) over conversations. A duplicated item is a whole
conversation, copied `count` times; its manifest `text` is its messages as JSON (`conversation_of`
reads them back). A canary becomes the conversation [user: `prompt`, assistant: the canary], so it is
trained as an answer, and its manifest item keeps `prompt`: scoring renders the canary in that
conversation (data_pipelines.chat.answer_encoder), the context it was trained in.
"""
from __future__ import annotations

import json

from data_pipelines.chat import ChatExample
from data_pipelines.corpora import Document
from data_pipelines.inject import CanarySpec, DuplicateSpec, Manifest, inject
from memorize_core import fail

CANARY_PROMPT = "Please repeat the note I gave you."


def canary_conversation(canary: str, prompt: str = CANARY_PROMPT) -> list[dict[str, str]]:
    """The conversation a canary is trained as in chat data: `prompt`, then the canary as the answer."""
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": canary}]


def conversation_of(text: str) -> list[dict[str, str]] | None:
    """The messages of a manifest item injected into chat data, else None (a plain text)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return value
    return None


def inject_chat(examples: list[ChatExample], *, canaries: CanarySpec | None = None,
                duplicates: DuplicateSpec | None = None, seed: int,
                prompt: str = CANARY_PROMPT, where: str = "prompt") -> tuple[list[ChatExample], Manifest]:
    """(the conversations with canaries and duplicated conversations scattered in, the Manifest): ids as
    inject gives them (`<item>@<copy>` for injected ones); a copy keeps its original's source and meta.
    `where` names `prompt` in an error (the caller's field)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise fail(where, prompt, "the user turn each canary answers must be a non-empty "
                   "text, e.g. 'Please repeat the note I gave you.'")
    if duplicates is not None and duplicates.edit_rate > 0:
        raise fail("duplicates.edit_rate", duplicates.edit_rate, "near-duplicate copies edit plain text; "
                   "chat data takes exact copies of conversations (edit_rate 0)")
    by_id = {ex.id: ex for ex in examples}
    base = [Document(ex.id, json.dumps(ex.messages), ex.source) for ex in examples]
    docs, manifest = inject(base, canaries=canaries, duplicates=duplicates, seed=seed)
    for item in manifest.of_kind("canary"):
        item.prompt = prompt
    canary_ids = {cid for it in manifest.of_kind("canary") for cid in it.copy_ids}
    original = {cid: it.source_id for it in manifest.of_kind("duplicate") for cid in it.copy_ids}
    out = []
    for d in docs:
        if d.id in canary_ids:
            out.append(ChatExample(d.id, canary_conversation(d.text, prompt), "canary"))
        else:
            ex = by_id[original.get(d.id, d.id)]
            out.append(ChatExample(d.id, json.loads(d.text), ex.source, dict(ex.meta)))
    return out, manifest

"""Canaries and duplicated documents injected into a `datasets.Dataset`, with our pipeline's manifest.

`inject_dataset(ds, canaries=..., duplicates=..., seed=...)` runs `data_pipelines.inject.inject` (the
one injection: same seeded choices, counting rule and `Manifest`) over the dataset's rows and returns
the new dataset with the manifest. Rows are plain text (`text_field`, "text" by default),
conversations (`messages_field`, "messages": lists of {"role", "content"}) or TRL's conversational
prompt-completion rows ("prompt": the messages before the answer, "completion": [the assistant's
answer]; TRL trains on the completion only). In a conversational dataset a duplicated row is the whole
conversation, and a canary is the conversation [user: `canary_prompt`, assistant: the canary] (the
manifest item keeps `canary_prompt` as its `prompt`, so the callback scores the canary as that answer);
the manifest's `text` of a duplicated conversation is its messages as JSON (`conversation_of` reads it
back), so the callback can score prompt -> response.
"""
from __future__ import annotations

import json
from typing import Any

from data_pipelines.chat import ChatExample
from data_pipelines.chat_inject import CANARY_PROMPT, canary_conversation, conversation_of, inject_chat
from data_pipelines.corpora import Document
from data_pipelines.inject import CanarySpec, DuplicateSpec, Manifest, inject
from memorize_core import fail


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                              for m in value):
        raise fail(where, str(value)[:60], "each row must be a list of {\"role\", \"content\"} messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _prompt_completion(ds: Any) -> list[str]:
    """Conversational prompt-completion rows as conversations (JSON): prompt messages + the answer."""
    out = []
    for i, (prompt, completion) in enumerate(zip(ds["prompt"], ds["completion"])):
        if isinstance(prompt, str) or isinstance(completion, str):
            raise fail(f"prompt[{i}]", str(prompt)[:60], "string prompt-completion rows have no turns to put "
                       "a canary in; use conversational ones (lists of {\"role\", \"content\"}) or a text "
                       "column")
        answer = _messages(completion, f"completion[{i}]")
        if len(answer) != 1 or answer[0]["role"] != "assistant":
            raise fail(f"completion[{i}]", str(completion)[:60], "must be one assistant message, the answer "
                       "the prompt's turns lead to")
        out.append(json.dumps(_messages(prompt, f"prompt[{i}]") + answer))
    return out


def _rows(ds: Any, field: str, chat: bool) -> list[str]:
    if field not in ds.column_names:
        raise fail("text_field" if not chat else "messages_field", field, f"the dataset has no such column "
                   f"(columns: {', '.join(ds.column_names)}); name the column that holds the "
                   + ("conversations" if chat else "text"))
    out = []
    for i, value in enumerate(ds[field]):
        if chat:
            out.append(json.dumps(_messages(value, f"{field}[{i}]")))
        else:
            if not isinstance(value, str):
                raise fail(f"{field}[{i}]", str(value)[:60], "each row must be a string")
            out.append(value)
    return out


def inject_dataset(ds: Any, *, canaries: CanarySpec | None = None, duplicates: DuplicateSpec | None = None,
                   seed: int = 0, text_field: str = "text", messages_field: str | None = None,
                   canary_prompt: str = CANARY_PROMPT) -> tuple[Any, Manifest]:
    """(the dataset with canaries and duplicates scattered in, its Manifest): only the text (messages, or
    prompt and completion) columns are kept, plus `doc_id`, the id the manifest gives each row
    (`<item>@<copy>` for injected ones)."""
    from datasets import Dataset  # deferred: +1.5 s import (pyarrow, pandas); only this function needs it

    if not isinstance(ds, Dataset):
        raise fail("dataset", type(ds).__name__, "pass a datasets.Dataset (e.g. load_dataset(...)['train'] "
                   "or Dataset.from_list(rows))")
    cols = ds.column_names
    pairs = messages_field is None and text_field not in cols and {"prompt", "completion"} <= set(cols)
    chat = messages_field is not None or (text_field not in cols and "messages" in cols)
    field = (messages_field or "messages") if chat else text_field
    texts = _prompt_completion(ds) if pairs else _rows(ds, field, chat)
    if chat or pairs:  # a canary becomes the assistant's answer to a fixed request; the manifest keeps
        # its sentence and the request, to score it in context
        convs = [ChatExample(str(i), json.loads(text), "dataset") for i, text in enumerate(texts)]
        out, manifest = inject_chat(convs, canaries=canaries, duplicates=duplicates, seed=seed,
                                    prompt=canary_prompt, where="canary_prompt")
        rows = [{"doc_id": ex.id, "prompt": ex.messages[:-1], "completion": ex.messages[-1:]} if pairs
                else {"doc_id": ex.id, field: ex.messages} for ex in out]
    else:
        base = [Document(str(i), text, "dataset") for i, text in enumerate(texts)]
        docs, manifest = inject(base, canaries=canaries, duplicates=duplicates, seed=seed)
        rows = [{"doc_id": d.id, field: d.text} for d in docs]
    return Dataset.from_list(rows), manifest


__all__ = ["CANARY_PROMPT", "CanarySpec", "DuplicateSpec", "Manifest", "canary_conversation",
           "conversation_of", "inject_dataset"]

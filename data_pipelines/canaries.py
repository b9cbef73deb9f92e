"""Secret-sharer canaries: a template with `{secret}` and a declared randomness space of secrets.

Exposure (Carlini et al. 2019) ranks the inserted canary among other candidates from the same
space, so the space is an explicit object that both injection and evals use: `SecretSpace.secret(i)`
maps every index in `range(space.size)` to one secret, and all sampling goes through that map.
Sampling hashes (seed, counter) with blake2b instead of using a library RNG, so the same seed gives
the same secrets on every platform and library version.
"""
from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from data_pipelines import bundled
from memorize_core import fail

DEFAULT_TEMPLATE = "my secret code is {secret}"
MAX_ENUMERATE = 1_000_000  # spaces up to this size can be listed whole for exact exposure


def stable_int(*parts: Any) -> int:
    """A 512-bit integer determined only by parts (platform- and version-independent)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=64).digest(), "little")


@functools.cache
def _all_words() -> tuple[str, ...]:
    # Real lowercase English words (3-9 letters) from the bundled Lee news corpus: a fixed,
    # offline source, so the word space is the same on every machine.
    words = set()
    for _key, text in bundled.lee_news():
        words.update(re.findall(r"\b[a-z]{3,9}\b", text))
    return tuple(sorted(words))


@dataclass(frozen=True)
class SecretSpace:
    """The randomness space R: `digits` (10**length secrets) or `words` (vocab_size**length)."""

    kind: str = "digits"
    length: int = 6
    vocab_size: int = 1000  # words only: how many words the seeded list holds
    word_seed: int = 0  # words only: which words (a seeded choice from the fixed pool)

    def __post_init__(self) -> None:
        if self.kind not in ("digits", "words"):
            raise fail("canaries.space.kind", self.kind, "choose digits or words")
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise fail("canaries.space.length", self.length, "use a positive integer, e.g. 6")
        if self.kind == "words":
            pool = len(_all_words())
            if (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                    or not 2 <= self.vocab_size <= pool):
                raise fail("canaries.space.vocab_size", self.vocab_size, f"use an integer in [2, {pool}]")

    @property
    def size(self) -> int:
        """|R|, the number of distinct secrets."""
        base = 10 if self.kind == "digits" else self.vocab_size
        return base**self.length

    @property
    def words(self) -> tuple[str, ...]:
        """The seeded word list (empty for digits)."""
        return _word_list(self.vocab_size, self.word_seed) if self.kind == "words" else ()

    def secret(self, index: int) -> str:
        """The secret numbered `index` in [0, size): digits are zero-padded, words space-joined."""
        if not 0 <= index < self.size:
            raise IndexError(f"secret index {index} outside [0, {self.size})")
        if self.kind == "digits":
            return str(index).zfill(self.length)
        words, out = self.words, []
        for _ in range(self.length):
            index, r = divmod(index, self.vocab_size)
            out.append(words[r])
        return " ".join(out)

    def sample(self, num: int, seed: int, *, exclude: Sequence[str] = ()) -> list[str]:
        """`num` distinct secrets drawn uniformly with a seed, none of them in `exclude`."""
        if num > self.size - len(set(exclude)):
            raise fail("canaries.num_canaries", num, f"the space holds only {self.size} secrets; "
                       "lower the count or enlarge the space (length / vocab_size)")
        taken, out, counter = set(exclude), [], 0
        while len(out) < num:
            s = self.secret(stable_int("secret", seed, counter) % self.size)
            counter += 1
            if s not in taken:
                taken.add(s)
                out.append(s)
        return out

    def to_dict(self) -> dict:
        """Plain dict for manifests and JSON."""
        return asdict(self)


@functools.cache
def _word_list(vocab_size: int, seed: int) -> tuple[str, ...]:
    pool = _all_words()
    ranked = sorted(range(len(pool)), key=lambda i: stable_int("words", seed, i))
    return tuple(pool[i] for i in ranked[:vocab_size])


def check_template(template: str) -> str:
    """Validate a canary template: it must contain `{secret}` and no other fields."""
    if not isinstance(template, str) or "{secret}" not in template:
        raise fail("canaries.template", template, "write a sentence containing {secret}, "
                   f"e.g. {DEFAULT_TEMPLATE!r}")
    try:
        template.format(secret="x")
    except (KeyError, IndexError, ValueError):
        raise fail("canaries.template", template, "only {secret} may appear in braces; "
                   "write other braces as {{ and }}") from None
    return template


def render(template: str, secret: str) -> str:
    """The canary text for one secret."""
    return check_template(template).format(secret=secret)


def canary_candidates(space: SecretSpace, *, template: str | None = None, num: int | None = None,
                      seed: int = 0, include: Sequence[str] = ()) -> list[str]:
    """Candidates from the space for exposure: all of it (num=None), or `include` plus seeded samples.

    With `template` the candidates are rendered canary texts, otherwise bare secrets. Listing
    the whole space is allowed up to MAX_ENUMERATE secrets; beyond that pass `num`.
    """
    if num is None:
        if space.size > MAX_ENUMERATE:
            raise fail("num", None, f"the space holds {space.size} secrets, too many to list; pass "
                       "num to sample candidates (exposure is then extrapolated)")
        secrets = [space.secret(i) for i in range(space.size)]
    else:
        if isinstance(num, bool) or not isinstance(num, int) or num < len(include):
            raise fail("num", num, f"use an integer >= len(include) = {len(include)}")
        if num > space.size:
            raise fail("num", num, f"the space holds only {space.size} secrets; lower num")
        extra = space.sample(num - len(include), seed, exclude=include)
        secrets = list(include) + extra
    return [render(template, s) for s in secrets] if template is not None else secrets

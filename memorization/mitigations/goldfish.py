"""Goldfish loss (Hans et al., NeurIPS 2024) as a label transform.

A goldfish model is never supervised on a pseudo-random subset of tokens, so it cannot reproduce a
training document verbatim. We express that as a transform on HF-convention labels (label at t is
the token at t, predicted from positions < t): dropped positions become -100, so every
cross-entropy in the project -- serial or vocab-parallel -- honours goldfish unchanged.

Strategies
- ``hash`` (default): drop position t iff a keyed hash of the h token ids *before* t falls in the
  lowest 1/k of its range. It depends on token ids only, so the same context always gets the same
  decision whatever its position, packing, batch, rank, device or epoch -- repeated documents never
  leak their dropped tokens. Positions with fewer than h preceding tokens of their own document are
  never dropped, so the context never crosses a document boundary when ``doc_ids`` is given.
  In packed rows a document cut at a row boundary continues in another row without its context;
  given ``positions`` (each token's offset in its document, as `data_pipelines` blocks carry), a
  position whose h-token context is cut by the row start is dropped conservatively, so what is
  supervised is always a subset of what the document alone would supervise, whatever the cut.
- ``static``: drop every k-th position of a document (offsets k-1, 2k-1, ... within the document;
  with ``positions`` the offsets count from the document's true start, also across rows).
- ``hash-table``: the reference implementation's masks, exactly, for comparison with published
  runs: table = torch.rand(1_000_003) from a CPU generator seeded 2971215073. The reference works
  on the shifted targets (``targets = ids[1:]``): target j >= h-1 is dropped iff
  table[wrapping int64 product of targets[j-h+1..j] mod 1_000_003] < 1/k. In positions of the
  unshifted row that is: position t >= h is dropped iff table[prod(ids[t-h+1..t]) % 1_000_003] < 1/k,
  and positions 0..h-1 never are. Its known flaws are kept on purpose (the key includes the dropped
  token, products are order-invariant and collapse on id 0, windows cross documents, and the
  table is drawn from the CPU generator: the reference's CUDA table differs).
- ``apertus``: the variant Apertus (8B/70B, 15T tokens) was pretrained with, bit-exact with
  swiss-ai/Megatron-LM-MoE's megatron/core/datasets/goldfish.py: the key of a window is its dot
  product with h odd int64 coefficients (torch.randint over [0, 2**62) from a CPU generator seeded
  2971215073 + h, then ``| 1``; int64 wrap-around), Python-style mod 1_000_003, into the same table
  as ``hash-table``. Megatron's labels are the shifted targets (label j is token j+1), so the mapping
  is the one of ``hash-table``: position t >= h is dropped iff table[dot(ids[t-h+1..t], coef)] < 1/k;
  positions 0..h-1 never are; special tokens are exempt by default. Order-sensitive, and ids 0 and
  1 count like any other (the product hash's degeneracies are gone); windows still cross documents.
- ``random``: drop each position with probability 1/k from a seeded generator. Leaky: a document
  seen in several epochs or copies gets different tokens dropped each time, so the union of what is
  supervised covers the whole document. Provided only as the paper's negative control.

Special tokens: with ``special_ids`` (the tokenizer's, see ``special_token_ids``) and
``exempt_special`` true, a position whose label is a special token is never dropped (an EOS or a chat
control token stays supervised). ``exempt_special`` null does what each reference does: apertus
exempts, the other strategies do not.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memorize_core import IGNORE_INDEX, Batch, fail

STRATEGIES = ("hash", "static", "hash-table", "random", "apertus")
# Named (k, h) settings: the paper's (Hans et al. 2024) and Apertus' (Megatron's defaults).
PRESETS = {"paper": (4, 13), "apertus": (50, 50)}
_DEFAULT_KH = (4, 13)

# Keyed multipliers for the context hash: fixed constants (not an RNG draw) so the mask is the same
# on every torch version, device and machine. Values are < 2**31 so id * a stays inside int64.
_PRIME = 2_147_483_647  # 2**31 - 1
_MIX = 0x45D9F3B
_TABLE_SIZE = 1_000_003
_TABLE_SEED = 2971215073


@dataclass
class GoldfishConfig:
    """Goldfish settings: `enabled` off means standard loss."""

    enabled: bool = False
    strategy: str = "hash"
    k: int = 4
    h: int = 13
    seed: int = 0  # only the `random` strategy uses it
    token_budget: bool = False  # train k/(k-1) longer so supervised tokens match standard loss
    # never drop a special-token label; null: as each reference does (apertus yes, the others no)
    exempt_special: bool | None = None
    preset: str | None = None  # paper: k=4, h=13; apertus: k=50, h=50 (sets k and h)

    def __post_init__(self) -> None:
        if self.preset is None:
            return
        if self.preset not in PRESETS:
            raise fail("goldfish.preset", self.preset, f"choose one of {', '.join(PRESETS)} or null")
        kh = PRESETS[self.preset]
        if (self.k, self.h) not in (kh, _DEFAULT_KH):  # an explicit k/h that contradicts the preset
            raise fail("goldfish.preset", self.preset, f"sets k={kh[0]}, h={kh[1]} but goldfish.k={self.k}, "
                       f"goldfish.h={self.h} were given; drop the preset or the explicit k/h")
        self.k, self.h = kh

    def validate(self, prefix: str = "goldfish") -> None:
        """Raise ConfigError on out-of-range settings."""
        check_params(self.strategy, self.k, self.h, prefix)
        if self.exempt_special not in (None, True, False):
            raise fail(f"{prefix}.exempt_special", self.exempt_special, "use null, true or false")

    def exempts(self) -> bool:
        """Whether special-token labels are exempt (exempt_special, or the strategy's reference default)."""
        return exempts_special(self.strategy, self.exempt_special)


def mask_is_the_documents(strategy: str, packed: bool) -> bool:
    """Whether a document's drops depend on its own tokens only, so every copy of it drops the same ones:
    not `random` (drawn anew each time), nor `hash-table` / `apertus` in packed rows: there the first h
    tokens' windows reach into whatever precedes the document in the row, and a copy cut by a row start
    has its first h positions in the row supervised, so different copies drop different tokens (`hash`
    drops a cut context conservatively and stops at document boundaries)."""
    return strategy != "random" and not (packed and strategy in ("hash-table", "apertus"))


def exempts_special(strategy: str, exempt_special: bool | None) -> bool:
    """exempt_special, or where it is null what the strategy's reference does (only apertus exempts)."""
    return strategy == "apertus" if exempt_special is None else bool(exempt_special)


def special_token_ids(tokenizer: Any) -> list[int]:
    """The ids goldfish exempts: all_special_ids and added tokens flagged special (what Megatron reads)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or [] if i is not None}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {int(i) for i, tok in decoder.items() if getattr(tok, "special", False)}
    return sorted(ids)


def check_params(strategy: str, k: int, h: int, prefix: str = "goldfish") -> None:
    """Validate goldfish parameters with house-style errors."""
    if strategy not in STRATEGIES:
        raise fail(f"{prefix}.strategy", strategy, f"choose one of {', '.join(STRATEGIES)}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 2:
        raise fail(f"{prefix}.k", k, "k must be an integer >= 2 (drop 1 token in k; the paper uses 4)")
    if not isinstance(h, int) or isinstance(h, bool) or h < 1:
        raise fail(f"{prefix}.h", h, "h must be an integer >= 1 (hash context width; the paper uses 13)")
    if k > 2**62 or h > 2**20:  # int64 hash arithmetic; a context wider than any row hashes nothing more
        name, value = ("k", k) if k > 2**62 else ("h", h)
        raise fail(f"{prefix}.{name}", value, f"must be <= {'2**62' if name == 'k' else '2**20'}; the paper "
                   "uses k=4, h=13")


def _multipliers(h: int) -> list[int]:
    """Deterministic per-offset multipliers in [1, 2**31 - 1) (an LCG, not torch's RNG)."""
    out, state = [], 0x9E3779B9
    for _ in range(h):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(1 + (state >> 33) % (_PRIME - 1))
    return out


def _offsets_in_document(shape: tuple[int, int], doc_ids: torch.Tensor | None, device) -> torch.Tensor:
    """Number of preceding tokens of the same document for every position (row start resets)."""
    b, t = shape
    pos = torch.arange(t, device=device).expand(b, t)
    if doc_ids is None:
        return pos
    starts = torch.ones((b, t), dtype=torch.bool, device=device)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # index of the most recent document start at or before each position
    last_start = torch.where(starts, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return pos - last_start


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finaliser in int64 arithmetic (identical on every device)."""
    m = 0xFFFFFFFF
    x = x & m
    x = ((x ^ (x >> 16)) * _MIX) & m
    x = ((x ^ (x >> 16)) * _MIX) & m
    return x ^ (x >> 16)


def _hash_drop(ids: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """Drop decision from the h ids strictly before each position (garbage where t < h)."""
    b, t = ids.shape
    key = torch.zeros((b, t), dtype=torch.int64, device=ids.device)
    for j, a in enumerate(_multipliers(h), start=1):
        if j > t:
            break
        shifted = torch.zeros_like(key)
        shifted[:, j:] = ids[:, :-j] % _PRIME
        key = (key + shifted * a) % _PRIME
    digest = _mix32(key * 0x2545F491 % _PRIME + h)
    return digest < (1 << 32) // k


@functools.lru_cache(maxsize=1)
def _cpu_hash_table() -> torch.Tensor:
    # one 4 MB table per process: the coverage audit and the experiments ask for it thousands of times
    gen = torch.Generator(device="cpu").manual_seed(_TABLE_SEED)
    return torch.rand(_TABLE_SIZE, generator=gen)


def _hash_table(device: torch.device) -> torch.Tensor:
    return _cpu_hash_table().to(device)


def _hash_table_drop(ids: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """The reference masks: position t >= h dropped iff table[prod(ids[t-h+1..t]) % 1_000_003] < 1/k."""
    b, t = ids.shape
    drop = torch.zeros((b, t), dtype=torch.bool, device=ids.device)
    if t <= h:
        return drop
    # The reference hashes the shifted targets ids[1:]: its first window ends at ids[h], so the
    # window ending at position h-1 (which includes ids[0], never a target) is never used.
    windows = ids[:, 1:].unfold(1, h, 1)  # [b, t-h, h]; window i ends at position i + h
    keys = torch.prod(windows, dim=-1) % _TABLE_SIZE  # wraps in int64 like the reference (product_keys)
    drop[:, h:] = _hash_table(ids.device)[keys] < 1.0 / k
    return drop


def apertus_coefficients(h: int) -> torch.Tensor:
    """Megatron's h odd int64 window coefficients: randint [0, 2**62) seeded 2971215073 + h, then | 1."""
    gen = torch.Generator(device="cpu").manual_seed(_TABLE_SEED + h)
    return torch.randint(0, 2**62, (h,), dtype=torch.int64, generator=gen) | 1


def apertus_keys(ids: torch.Tensor, h: int) -> torch.Tensor:
    """Table keys of the windows ids[..., i:i+h] (int64 wrap-around dot product, Python-style mod)."""
    coef = apertus_coefficients(h).to(ids.device)
    return (ids.long().unfold(-1, h, 1) * coef).sum(dim=-1) % _TABLE_SIZE


def product_keys(ids: torch.Tensor, h: int) -> torch.Tensor:
    """Table keys of the reference product hash for the windows ids[..., i:i+h] (int64 wrap-around)."""
    return torch.prod(ids.long().unfold(-1, h, 1), dim=-1) % _TABLE_SIZE


def _apertus_drop(ids: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """Megatron's masks: position t >= h dropped iff table[dot(ids[t-h+1..t], coef) % 1_000_003] < 1/k."""
    b, t = ids.shape
    drop = torch.zeros((b, t), dtype=torch.bool, device=ids.device)
    if t <= h:
        return drop
    # Megatron's labels are ids[1:]; its window for label j ends at label j, i.e. at position j + 1.
    drop[:, h:] = _hash_table(ids.device)[apertus_keys(ids[:, 1:], h)] < 1.0 / k
    return drop


def goldfish_mask(
    input_ids: torch.Tensor,
    *,
    strategy: str = "hash",
    k: int = 4,
    h: int = 13,
    doc_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    special_ids: Sequence[int] | None = None,
    exempt_special: bool | None = None,
) -> torch.Tensor:
    """Boolean [B, T] mask, True where the goldfish strategy drops the label.

    `doc_ids` marks document boundaries inside a row; `positions` (offset of each token in its
    document, -1 on padding) tells where a row starts mid-document. Without `positions` every row
    is taken to start its documents at offset 0. `special_ids` are never dropped when
    `exempt_special` is true (null: only for apertus, as Megatron does).
    """
    check_params(strategy, k, h)

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else (t if t.dim() == 2 else t.unsqueeze(0))

    ids, docs, pos = rows(input_ids).long(), rows(doc_ids), rows(positions)
    if pos is not None and pos.shape != ids.shape:
        raise fail("positions", f"shape {tuple(pos.shape)}", f"must match input_ids {tuple(ids.shape)}")
    if strategy == "hash-table":
        drop = _hash_table_drop(ids, k, h)
    elif strategy == "apertus":
        drop = _apertus_drop(ids, k, h)
    else:
        in_row = _offsets_in_document(tuple(ids.shape), docs, ids.device)  # context visible in the row
        offset = in_row if pos is None else pos.to(ids.device).long()
        if strategy == "static":
            drop = ((offset + 1) % k == 0) & (offset >= 0)
        elif strategy == "hash":
            # context wholly in the row: the hash decides; context cut by the row start: drop
            drop = (offset >= h) & (_hash_drop(ids, k, h) | (in_row < h))
        else:  # random
            noise = torch.rand(ids.shape, generator=generator, device="cpu").to(ids.device)
            drop = noise < 1.0 / k
    if special_ids is not None and len(special_ids) and exempts_special(strategy, exempt_special):
        # the label at t is ids[t]: a special token there stays supervised (Megatron's exemption LUT)
        drop = drop & ~torch.isin(ids, torch.as_tensor(list(special_ids), dtype=ids.dtype, device=ids.device))
    return drop if input_ids.dim() == 2 else drop.squeeze(0)


def copy_drops(gold: GoldfishConfig, packed: bool, head: int = 0) -> Callable[[list[int]], list[bool]] | None:
    """Which tokens of a text `gold`'s mask drops in every copy of it (a canary's, a record's answer), where
    every copy drops the same ones (mask_is_the_documents), else None; applied to standard-loss runs too,
    the one grouping of secrets into masked and unmasked. `head` > 0: the ids start with the `head` ids of
    the chat prompt the text answers, as chat rows put them (positions count from the answer, so `hash`
    decides from the answer's own tokens; `hash-table` and `apertus` windows reach into the prompt, as they
    do in training)."""
    if not mask_is_the_documents(gold.strategy, packed):
        return None

    def drop(ids: list[int]) -> list[bool]:
        t = torch.tensor([ids])
        pos = torch.tensor([[-1] * head + list(range(len(ids) - head))]) if head else None
        return goldfish_mask(t, strategy=gold.strategy, k=gold.k, h=gold.h, positions=pos)[0].tolist()
    return drop


def goldfish_labels(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    strategy: str = "hash",
    k: int = 4,
    h: int = 13,
    doc_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    special_ids: Sequence[int] | None = None,
    exempt_special: bool | None = None,
) -> torch.Tensor:
    """Labels (default: input_ids) with the goldfish-dropped positions set to -100."""
    base = input_ids if labels is None else labels
    drop = goldfish_mask(input_ids, strategy=strategy, k=k, h=h, doc_ids=doc_ids, positions=positions,
                         generator=generator, special_ids=special_ids, exempt_special=exempt_special)
    return base.masked_fill(drop, IGNORE_INDEX)


class GoldfishTransform:
    """A batch -> labels callable for the trainer (the trainer never learns the word goldfish)."""

    def __init__(self, cfg: GoldfishConfig, seed: int = 0, special_ids: Sequence[int] | None = None):
        cfg.validate()
        self.cfg = cfg
        self.special_ids = None if special_ids is None else sorted({int(i) for i in special_ids})
        self._gen = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + seed)

    def __call__(self, batch: Batch) -> torch.Tensor:
        """Return the goldfish-masked labels for a batch dict (input_ids, labels, doc_ids)."""
        return goldfish_labels(
            batch["input_ids"], batch.get("labels"), strategy=self.cfg.strategy, k=self.cfg.k,
            h=self.cfg.h, doc_ids=batch.get("doc_ids"), positions=batch.get("positions"),
            generator=self._gen, special_ids=self.special_ids, exempt_special=self.cfg.exempt_special,
        )

    def state_dict(self) -> dict:
        """RNG state (only `random` consumes it) for exact resume."""
        return {"generator": self._gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the RNG state saved by state_dict."""
        self._gen.set_state(state["generator"])

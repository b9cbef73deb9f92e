"""The apertus strategy against Megatron's published formula, special-token exemption, presets, and the
product hash's degeneracy (ids 0 and 1) that the coefficient hash removes."""
import numpy as np
import pytest
import torch

from data_pipelines import load_corpus
from data_pipelines.tokenizer import load_tokenizer
from memorization.mitigations.goldfish import (
    GoldfishConfig,
    GoldfishTransform,
    apertus_keys,
    goldfish_labels,
    goldfish_mask,
    product_keys,
    special_token_ids,
)
from memorize_core import IGNORE_INDEX, ConfigError

torch.set_num_threads(1)
SPECIAL = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok():
    t = load_tokenizer("gpt2")
    t.add_special_tokens({"additional_special_tokens": SPECIAL})
    t.add_tokens(["zzqxword"])  # an added token NOT flagged special: never exempt
    return t


@pytest.fixture(scope="module")
def text_ids(tok):
    """Real Wikipedia leads with chat-control tokens between sentences and EOS between leads (~3000 ids)."""
    docs = load_corpus("wiki-leads", limit=12)
    text = "".join("<|im_start|>" + d.text.replace(". ", ".<|im_end|> zzqxword<|im_start|>") + tok.eos_token
                   for d in docs)
    return tok(text)["input_ids"][:3000]


def _reference(ids: list[int], k: int, h: int, exempt: set[int]) -> list[bool]:
    """Megatron's apply_goldfish written out per label: labels = ids[1:], label j -> position j+1."""
    table = torch.rand(1_000_003, generator=torch.Generator().manual_seed(2971215073)).numpy()
    coef = (torch.randint(0, 2**62, (h,), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(2971215073 + h)) | 1).tolist()
    labels = ids[1:]
    drop = [False] * len(ids)
    for j in range(h - 1, len(labels)):
        exact = sum(c * x for c, x in zip(coef, labels[j - h + 1: j + 1]))
        wrapped = (exact + 2**63) % 2**64 - 2**63  # int64 two's-complement wrap-around
        key = wrapped % 1_000_003  # Python-style: never negative
        drop[j + 1] = bool(table[key] < np.float32(1.0) / k) and labels[j] not in exempt
    return drop


def _wrapped_product(values: list[int]) -> int:
    """Product of values in int64 wrap-around, Python-style mod 1_000_003."""
    exact = 1
    for v in values:
        exact *= v
    return ((exact + 2**63) % 2**64 - 2**63) % 1_000_003


def test_special_token_ids_reads_the_tokenizer(tok):
    ids = special_token_ids(tok)
    assert ids == sorted([tok.eos_token_id, *tok.convert_tokens_to_ids(SPECIAL)])
    assert tok.convert_tokens_to_ids("zzqxword") not in ids


@pytest.mark.parametrize("k,h", [(2, 13), (4, 13), (50, 50), (3, 1)])
def test_masks_equal_the_published_formula(tok, text_ids, k, h):
    special = special_token_ids(tok)
    got = goldfish_mask(torch.tensor(text_ids), strategy="apertus", k=k, h=h, special_ids=special)
    want = _reference(text_ids, k, h, set(special))
    assert got.tolist() == want
    assert not got[:h].any(), "positions 0..h-1 (Megatron's labels j < h-1) are never dropped"


def test_special_tokens_present_and_exempt(tok, text_ids):
    special = special_token_ids(tok)
    ids = torch.tensor(text_ids)
    is_special = torch.isin(ids, torch.tensor(special))
    assert is_special.sum() >= 30
    free = goldfish_mask(ids, strategy="apertus", k=2, h=13, special_ids=special, exempt_special=False)
    kept = goldfish_mask(ids, strategy="apertus", k=2, h=13, special_ids=special)  # null: apertus exempts
    assert (free & is_special).sum() >= 5, "the formula alone would drop some special tokens"
    assert not (kept & is_special).any()
    assert torch.equal(kept, free & ~is_special)
    # the other strategies exempt only when asked
    for strategy in ("hash", "hash-table", "static"):
        plain = goldfish_mask(ids, strategy=strategy, k=2, h=13, special_ids=special)
        asked = goldfish_mask(ids, strategy=strategy, k=2, h=13, special_ids=special, exempt_special=True)
        assert (plain & is_special).any() and not (asked & is_special).any()
        assert torch.equal(asked, plain & ~is_special)


def test_transform_and_labels_honour_the_exemption(tok, text_ids):
    special = special_token_ids(tok)
    ids = torch.tensor([text_ids[:1024], text_ids[1000:2024]])
    cfg = GoldfishConfig(enabled=True, strategy="apertus", k=2, h=13)
    labels = GoldfishTransform(cfg, special_ids=special)({"input_ids": ids, "labels": ids.clone()})
    assert torch.equal(labels, goldfish_labels(ids, strategy="apertus", k=2, h=13, special_ids=special))
    specials = torch.isin(ids, torch.tensor(special))
    assert (labels[specials] != IGNORE_INDEX).all()
    assert (labels == IGNORE_INDEX).float().mean() > 0.3


def test_presets_and_validation():
    assert (GoldfishConfig(preset="apertus").k, GoldfishConfig(preset="apertus").h) == (50, 50)
    assert (GoldfishConfig(preset="paper").k, GoldfishConfig(preset="paper").h) == (4, 13)
    with pytest.raises(ConfigError, match="goldfish.preset"):
        GoldfishConfig(preset="llama")
    with pytest.raises(ConfigError, match="goldfish.preset"):
        GoldfishConfig(preset="apertus", k=8)
    with pytest.raises(ConfigError, match="goldfish.k"):
        GoldfishConfig(strategy="apertus", k=1).validate()
    with pytest.raises(ConfigError, match="goldfish.h"):
        GoldfishConfig(strategy="apertus", h=0).validate()


def test_product_hash_collapses_on_id_0_and_ignores_id_1_the_coefficient_hash_does_not(text_ids):
    """On real text with ~3% of ids replaced by 0 and ~3% by 1, at h=13 (the share quoted in
    docs/mitigations.md): every product window holding a 0 has key 0; 1s leave the key unchanged."""
    h = 13
    ids = torch.tensor(text_ids)
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(len(ids), generator=gen)
    zeroed = torch.where(r < 0.03, 0, ids)
    with_ones = torch.where((r >= 0.03) & (r < 0.06), 1, zeroed)
    has0 = (zeroed.unfold(0, h, 1) == 0).any(-1)
    share = has0.float().mean().item()
    assert 0.25 < share < 0.45  # 1 - 0.97**13 = 0.33 of windows hold a 0
    pk = product_keys(zeroed, h)
    assert (pk[has0] == 0).all(), "product: every window with a 0 collapses to key 0 (one shared decision)"
    ak = apertus_keys(zeroed, h)
    assert len(set(ak[has0].tolist())) > 0.99 * int(has0.sum()), "coefficient hash: no collapse"
    # the shared decision: table[0] decides every such window alike (all kept, or all dropped)
    drop = goldfish_mask(zeroed, strategy="hash-table", k=4, h=h)[h:]
    assert drop[has0[1:]].unique().numel() == 1
    # id 1: moving the 1s of a window to its front never changes the product key
    ones = (with_ones.unfold(0, h, 1) == 1).any(-1) & ~(with_ones.unfold(0, h, 1) == 0).any(-1)
    assert ones.float().mean() > 0.15  # 0.97**13 * (1 - 0.97**13) = 0.23
    win = with_ones.unfold(0, h, 1)[ones]
    moved = torch.gather(win, 1, torch.sort((win != 1).long(), dim=1, stable=True).indices)  # 1s first
    moved_some = (moved != win).any(1)
    assert moved_some.float().mean() > 0.9
    assert torch.equal(product_keys(moved, h), product_keys(win, h))
    # ... and a 1 adds nothing: the key equals that of the product of the window's other ids
    assert product_keys(win[:50], h).squeeze(-1).tolist() == [_wrapped_product(w[w != 1].tolist())
                                                              for w in win[:50]]
    # the coefficient hash is order-sensitive: moving the 1s changes the key
    assert apertus_keys(moved, h)[moved_some].ne(apertus_keys(win, h)[moved_some]).float().mean() > 0.99

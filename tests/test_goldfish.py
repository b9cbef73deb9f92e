"""Goldfish label transform: drop rates, invariances, boundary resets, hand-checked cases."""
import pytest
import torch

from memorization.mitigations.goldfish import (
    IGNORE_INDEX,
    GoldfishConfig,
    GoldfishTransform,
    goldfish_labels,
    goldfish_mask,
)
from memorize_core import ConfigError

torch.set_num_threads(1)


def _ids(*shape, seed=0, vocab=4096):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k", [2, 3, 4, 8])
@pytest.mark.parametrize("strategy", ["hash", "hash-table", "random", "static"])
def test_drop_rate_is_one_over_k(strategy, k):
    ids = _ids(64, 512, seed=k)
    mask = goldfish_mask(ids, strategy=strategy, k=k, h=4)
    eligible = mask[:, 4:] if strategy != "static" else mask
    assert abs(eligible.float().mean().item() - 1 / k) < 0.01


def test_hash_first_h_positions_of_a_document_never_dropped():
    ids = _ids(8, 300)
    doc = torch.zeros_like(ids)
    doc[:, 100:] = 1
    mask = goldfish_mask(ids, k=2, h=13, doc_ids=doc)
    assert not mask[:, :13].any()
    assert not mask[:, 100:113].any(), "the context reset at the document boundary"
    assert mask[:, 113:].any() and mask[:, 13:100].any()


def test_hash_depends_only_on_the_h_preceding_tokens():
    h = 6
    ids = _ids(1, 400, seed=3)
    mask = goldfish_mask(ids, k=4, h=h)[0]
    # Every position with the same h-token context gets the same decision: plant a repeated context.
    ctx = ids[0, 50:50 + h]
    planted = ids.clone()
    planted[0, 300:300 + h] = ctx
    planted[0, 300 + h] = 12345  # a different token at the decided position
    m2 = goldfish_mask(planted, k=4, h=h)[0]
    assert m2[300 + h] == mask[50 + h]
    # Changing the token at t itself (the label) never changes the decision at t.
    changed = ids.clone()
    changed[0, 200] = (changed[0, 200] + 1) % 4096
    assert goldfish_mask(changed, k=4, h=h)[0, 200] == mask[200]


def test_same_document_same_mask_wherever_it_sits():
    doc = _ids(230, seed=7)
    rows, docs = [], []
    for lead in (0, 5, 37, 120):
        filler = _ids(lead, seed=lead + 1)
        tail = _ids(400 - lead - 230, seed=lead + 2)
        rows.append(torch.cat([filler, doc, tail]))
        docs.append(torch.tensor([0] * lead + [1] * 230 + [2] * (400 - lead - 230)))
    masks = goldfish_mask(torch.stack(rows), doc_ids=torch.stack(docs))
    ref = masks[0, :230]
    for i, lead in enumerate((0, 5, 37, 120)):
        assert torch.equal(masks[i, lead:lead + 230], ref)
    assert 0.15 < ref[13:].float().mean() < 0.35


def test_batch_composition_does_not_matter():
    a, b = _ids(4, 256, seed=1), _ids(4, 256, seed=2)
    both = goldfish_mask(torch.cat([a, b]))
    assert torch.equal(both[:4], goldfish_mask(a))
    assert torch.equal(both[4:], goldfish_mask(b[[0, 1, 2, 3]]))
    assert torch.equal(goldfish_mask(a[[2]]), both[[2]])


def test_static_drops_every_kth_position_of_each_document():
    ids = _ids(1, 12)
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    mask = goldfish_mask(ids, strategy="static", k=3, doc_ids=doc)[0].tolist()
    assert mask == [False, False, True, False, False, False, False, True, False, False, True, False]


def _reference_hash_table_targets(row: list[int], k: int, h: int) -> list[bool]:
    """The published implementation's loop, on the shifted targets, with int64 wrap-around products."""
    gen = torch.Generator().manual_seed(2971215073)
    table = torch.rand(1_000_003, generator=gen)
    targets = row[1:]  # litgpt convention: targets = input_ids[:, 1:]
    dropped = [False] * len(targets)
    for j in range(h - 1, len(targets)):
        prod = 1
        for v in targets[j - h + 1:j + 1]:
            prod = (prod * v + 2**63) % 2**64 - 2**63  # int64 multiplication wraps
        dropped[j] = bool(table[prod % 1_000_003] < 1 / k)  # torch's % is floored, like Python's
    return dropped


def test_hash_table_matches_reference_formula_by_hand():
    k, h = 4, 3
    ids = torch.tensor([[5, 7, 11, 13, 0, 2, 3, 999_983, 1_000_003]])
    gen = torch.Generator().manual_seed(2971215073)
    table = torch.rand(1_000_003, generator=gen)
    vals = ids[0].tolist()
    # position t >= h is dropped iff table[prod(ids[t-h+1..t]) % 1_000_003] < 1/k; 0..h-1 never are
    expected = [False] * h + [bool(table[vals[t - 2] * vals[t - 1] * vals[t] % 1_000_003] < 1 / k)
                              for t in range(h, len(vals))]
    mask = goldfish_mask(ids, strategy="hash-table", k=k, h=h)[0].tolist()
    assert mask == expected
    assert mask[1:] == _reference_hash_table_targets(vals, k, h)  # label t is target t-1
    assert expected[4:7] == [bool(table[0] < 0.25)] * 3  # the id-0 collapse flaw is reproduced


@pytest.mark.parametrize("vocab,h", [(50, 3), (49_152, 13), (128_256, 13), (7, 1)])
def test_hash_table_equals_published_masks_on_random_rows(vocab, h):
    gen = torch.Generator().manual_seed(vocab + h)
    k = 4
    ids = torch.randint(0, vocab, (6, 70), generator=gen)
    mask = goldfish_mask(ids, strategy="hash-table", k=k, h=h)
    for row, m in zip(ids.tolist(), mask.tolist()):
        assert m[0] is False  # token 0 is never a target
        assert m[1:] == _reference_hash_table_targets(row, k, h)
    assert mask.any()  # the comparison covered dropped tokens, not only kept ones


def test_labels_keep_existing_ignores_and_only_add_drops():
    ids = _ids(2, 64)
    labels = ids.clone()
    labels[:, 50:] = IGNORE_INDEX
    out = goldfish_labels(ids, labels, k=2, h=2)
    dropped = goldfish_mask(ids, k=2, h=2)
    assert (out[:, 50:] == IGNORE_INDEX).all()
    assert torch.equal(out[:, :50][~dropped[:, :50]], ids[:, :50][~dropped[:, :50]])
    assert (out[dropped] == IGNORE_INDEX).all()
    assert torch.equal(goldfish_labels(ids, k=2, h=2), ids.masked_fill(dropped, IGNORE_INDEX))


def test_random_strategy_is_seeded_but_differs_between_epochs():
    ids = _ids(1, 512)
    t1 = GoldfishTransform(GoldfishConfig(enabled=True, strategy="random", seed=1))
    t2 = GoldfishTransform(GoldfishConfig(enabled=True, strategy="random", seed=1))
    batch = {"input_ids": ids}
    first = t1(batch)
    assert torch.equal(first, t2(batch))
    assert not torch.equal(first, t1(batch)), "random drops other tokens the next time: it leaks"


@pytest.mark.parametrize("kwargs,field", [
    ({"k": 1}, "goldfish.k"), ({"h": 0}, "goldfish.h"), ({"strategy": "nope"}, "goldfish.strategy"),
])
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        goldfish_mask(_ids(1, 10), **kwargs)

"""Goldfish guarantees: the same tokens are dropped wherever, however and on whatever they are trained.

A goldfish model must never be supervised on a dropped token in any epoch, copy, rank or device.
These tests check the mask's independence of position, packing, batch composition, epoch, copies of
injected items, the data/tensor-parallel grid (the trainer transforms the GLOBAL batch and then
shards it) and the device.
"""
from __future__ import annotations

import pytest
import torch

from axonn.config import TrainerConfig
from axonn.trainer import IGNORE_INDEX, Trainer
from data_pipelines import (
    CanarySpec,
    DuplicateSpec,
    SecretSpace,
    inject,
    load_corpus,
    load_tokenizer,
    pack,
    per_document,
    record_token_positions,
    tokenize_documents,
)
from memorization.mitigations.goldfish import (
    GoldfishConfig,
    GoldfishTransform,
    goldfish_labels,
    goldfish_mask,
)

STRATEGIES = ("hash", "static")  # the two the experiments use; both are position-safe within a document
K, H = 3, 5


def _docs(n=6, seed=0, lo=20, hi=60, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _mask_of(blocks, strategy, k=K, h=H):
    return goldfish_mask(blocks.input_ids, strategy=strategy, k=k, h=h, doc_ids=blocks.doc_ids,
                         positions=blocks.positions)


def _per_doc_masks(blocks, strategy):
    """doc index -> list of (in-row offset of the doc segment, drop flag) in document order."""
    mask = _mask_of(blocks, strategy)
    out: dict[int, list[tuple[int, bool]]] = {}
    for r in range(len(blocks)):
        seg_start = None
        for t in range(blocks.block_len):
            d = int(blocks.doc_ids[r, t])
            if d < 0:
                continue
            if t == 0 or int(blocks.doc_ids[r, t - 1]) != d:
                seg_start = t
            out.setdefault(d, []).append((t - seg_start, bool(mask[r, t])))
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_document_same_mask_at_any_row_offset(strategy):
    doc, other = _docs(2)
    alone = goldfish_mask(torch.tensor([doc]), strategy=strategy, k=K, h=H)[0]
    for filler in (1, 7, 19):
        row = torch.tensor([other[:filler] + doc])
        ids = torch.tensor([[0] * filler + [1] * len(doc)])
        shifted = goldfish_mask(row, strategy=strategy, k=K, h=H, doc_ids=ids)[0, filler:]
        assert torch.equal(shifted, alone), f"mask moved with the document (filler {filler})"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_packing_keeps_every_decision_and_drops_where_a_cut_hides_the_context(strategy):
    docs = _docs(8)
    ref = {d: [m for _, m in v] for d, v in _per_doc_masks(per_document(docs, 64, 0), strategy).items()}
    cut_positions = 0
    for block_len in (16, 37, 64):
        packed = _per_doc_masks(pack(docs, block_len, 96), strategy)
        for d, seq in packed.items():
            body = seq[: len(docs[d])]  # pack's EOS separator is the document's last token
            for pos, (seg_offset, drop) in enumerate(body):
                hidden = strategy == "hash" and pos >= H and seg_offset < H and seg_offset != pos
                cut_positions += hidden
                # static counts from the document's true start (positions); hash decides whenever
                # its h-token context is in the row and drops where a row start cut that context
                assert drop == (True if hidden else ref[d][pos]), (block_len, d, pos, seg_offset)
    assert strategy == "static" or cut_positions > 0  # the cut case was exercised


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_packed_copies_cut_at_different_offsets_never_supervise_a_dropped_token(strategy):
    doc = _docs(1, seed=3, lo=60, hi=61)[0]
    ref = goldfish_mask(torch.tensor([doc]), strategy=strategy, k=K, h=H)[0]
    tf = GoldfishTransform(GoldfishConfig(enabled=True, strategy=strategy, k=K, h=H))
    supervised_anywhere = torch.zeros(len(doc), dtype=torch.bool)
    for cut in range(1, 40):
        blocks = pack([doc[:cut], doc], 64, 96)  # the copy starts at in-row offset cut+1 and wraps
        labels = tf(blocks[list(range(len(blocks)))])
        copy = (blocks.doc_ids == 1) & (blocks.positions < len(doc))
        pos, kept = blocks.positions[copy], labels[copy] != IGNORE_INDEX
        assert torch.equal(pos, torch.arange(len(doc)))  # row-major order is document order
        if strategy == "static":
            assert torch.equal(~kept, ref), f"copy after a {cut}-token document"
        supervised_anywhere |= kept
    # whatever the cut, no copy is ever supervised on a token the document alone drops
    assert not (supervised_anywhere & ref).any()
    assert supervised_anywhere.sum() >= (~ref).sum() - H  # and the rest is still learnt


def test_batch_composition_and_epochs_do_not_change_a_row():
    blocks = per_document(_docs(10), 64, 0)
    tf = GoldfishTransform(GoldfishConfig(enabled=True, k=K, h=H))
    full = tf(blocks[list(range(10))])
    for rows in ([3], [3, 0, 9], [9, 8, 7, 6, 5, 4, 3], [3, 3]):
        part = tf(blocks[rows])
        assert torch.equal(part[rows.index(3)], full[3])
    assert torch.equal(tf(blocks[list(range(10))]), full)  # a second epoch drops the same tokens


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    base = load_corpus("lee-news-test")[:12]
    tok = load_tokenizer("bpe", texts=[d.text for d in base], vocab_size=400,
                         cache_dir=tmp_path_factory.mktemp("tok"))
    canaries = CanarySpec(num_canaries=3, repeats=[2, 5], space=SecretSpace("digits", 4),
                          template="the quick brown fox says that the secret code for the door is {secret}")
    docs, manifest = inject(base, canaries=canaries, duplicates=DuplicateSpec(counts=[3, 4]), seed=4)
    return tok, docs, manifest


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_copy_of_a_canary_or_duplicate_drops_the_same_tokens(injected, strategy):
    tok, docs, manifest = injected
    tokens = tokenize_documents(docs, tok, max_tokens=96, min_tokens=4)
    blocks = per_document(tokens, 96, tok.pad_token_id)
    record_token_positions(manifest, blocks, tokens)
    labels = GoldfishTransform(GoldfishConfig(enabled=True, strategy=strategy, k=K, h=H))(blocks[:])
    repeated = 0
    for item in manifest.items:
        copies = [[labels[r, t].item() == IGNORE_INDEX for r, s, e in spans for t in range(s, e)]
                  for spans in item.token_positions]
        assert len(copies) == item.count and all(c == copies[0] for c in copies), item.id
        assert any(copies[0]), f"{item.id}: nothing dropped, so the test would prove nothing"
        repeated += item.count > 1
    assert repeated >= 2, "no item has two copies to compare: the fixture proves nothing"


class _FakeGrid:
    """Just the attributes the trainer reads to shard a batch (no process group)."""

    def __init__(self, x, y, z, data, rank):
        self.x, self.y, self.z, self.data = x, y, z, data
        self.z_rank = (rank // (x * y)) % z
        self.data_rank = rank // (x * y * z)
        self.batch_shards, self.batch_shard_index = z * data, self.data_rank * z + self.z_rank
        self.device, self.is_main, self.rank = torch.device("cpu"), rank == 0, rank
        self.world_size = x * y * z * data


class _SpyTrainer(Trainer):
    """Records the targets each rank's loss receives; computes the loss serially."""

    def _ce_split(self, logits, targets, real):
        self.seen.append(targets.clone())
        flat = logits.float().reshape(-1, logits.shape[-1])
        loss = torch.nn.functional.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX,
                                                 reduction="sum")
        return loss, torch.zeros(()), torch.zeros(())

    def _reduce(self, values):
        return values


@pytest.mark.parametrize("dims", [(1, 1, 1, 4), (2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 4, 1)])
def test_each_rank_gets_the_slice_of_the_serial_goldfish_labels(dims, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    import axonn.trainer

    # Only the labels matter here: stand in for the collectives a real grid would run.
    monkeypatch.setattr(axonn.trainer, "sync_gradients", lambda *a, **k: None)
    monkeypatch.setattr(axonn.trainer, "grad_norm", lambda *a, **k: 0.0)
    monkeypatch.setattr(axonn.trainer, "clip_grad_norm_", lambda *a, **k: 0.0)
    blocks = per_document(_docs(16, lo=30, hi=48), 48, 0)
    tf = GoldfishTransform(GoldfishConfig(enabled=True, k=K, h=H))
    batch = blocks[list(range(16))]
    serial = tf(batch)
    cfg = TrainerConfig(batch_size=16, grad_accum=2, grad_clip=0.0, progress=False, warmup_steps=0)
    world = dims[0] * dims[1] * dims[2] * dims[3]
    for rank in range(world):
        grid = _FakeGrid(*dims, rank)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=2))
        spy = _SpyTrainer(model, cfg, blocks, label_transform=tf, grid=grid)
        spy.seen = []
        spy.train_step(batch)
        got = torch.cat(spy.seen)  # the supervised targets of each micro-batch
        rows, shards, i = 16 // 2, grid.batch_shards, grid.batch_shard_index
        per = rows // shards
        want = torch.cat([serial[m * rows:(m + 1) * rows][i * per:(i + 1) * per, 1:] for m in range(2)])
        assert torch.equal(got, want), f"rank {rank} of grid {dims}"


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ("hash", "static", "hash-table"))
def test_cpu_and_cuda_drop_the_same_tokens(strategy):
    blocks = pack(_docs(12, lo=40, hi=200, vocab=50_000), 128, 0)
    cpu = goldfish_labels(blocks.input_ids, blocks.labels, strategy=strategy, k=4, h=13,
                          doc_ids=blocks.doc_ids)
    gpu = goldfish_labels(blocks.input_ids.cuda(), blocks.labels.cuda(), strategy=strategy, k=4, h=13,
                          doc_ids=blocks.doc_ids.cuda())
    assert torch.equal(cpu, gpu.cpu())

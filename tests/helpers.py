"""Builders several test modules share: a tiny Llama, token rows, a tiny run config, checkpointing trainers.

Test modules import these from here (never from each other), so each test file stays runnable alone.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from axonn.config import TrainerConfig
from axonn.trainer import Trainer
from data_pipelines.token_sources import IDX_DTYPES, IDX_MAGIC
from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform
from memorize_core import IGNORE_INDEX

# A 2-layer tiny model on 12 Wikipedia leads with a 300-id BPE, 2 steps, no extraction, no W&B.
TINY = """
name: t
data: {corpus: wiki-leads, limit: 12, vocab_size: 300, block_len: 48, min_tokens: 40, held_out: ""}
model:
  name: tiny
  overrides: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4}
trainer: {batch_size: 4, max_steps: 2, progress: false}
eval: {extraction: false}
wandb: {mode: disabled}
"""

CHECKPOINT_STEPS, CHECKPOINT_HALF = 6, 3


def tiny_base_yaml(max_steps: int) -> str:
    """The run config of a tiny 1-layer model trained briefly and exported: the local 'pretrained'
    folder the experiment tests fine-tune (20 Wikipedia leads, a 320-id BPE, no extraction, no W&B)."""
    return f"""
name: base
data: {{corpus: wiki-leads, limit: 20, vocab_size: 320, block_len: 40, min_tokens: 40, held_out: ""}}
model:
  name: tiny
  overrides: {{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 4,
              num_key_value_heads: 4}}
trainer: {{batch_size: 4, max_steps: {max_steps}, progress: false}}
eval: {{extraction: false}}
wandb: {{mode: disabled}}
"""


def trained_base(root: Path, max_steps: int) -> Path:
    """Train `tiny_base_yaml(max_steps)` into root/run and return its exported model folder: the local
    'pretrained' model (with its tokenizer) the experiment tests fine-tune in place of SmolLM2."""
    from memorization.cli import main  # deferred: the CLI imports every command; few tests need it

    cfg = root / "base.yaml"
    cfg.write_text(tiny_base_yaml(max_steps))
    assert main(["train", str(cfg), "--out", str(root / "run")]) == 0
    return root / "run" / "model"


class Rows:
    """A minimal RowDataset."""

    def __init__(self, ids, labels=None):
        self.ids, self.labels = ids, ids.clone() if labels is None else labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        return {"input_ids": self.ids[idx], "labels": self.labels[idx]}


def tiny_model(seed=0, vocab=64):
    """A seeded 2-layer, 32-wide Llama."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def rows(n=16, t=24, vocab=64, seed=0):
    """n seeded random rows of t ids; every third row ends in 5 ignored labels."""
    ids = torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[::3, -5:] = IGNORE_INDEX  # some padding-like ignored labels
    return Rows(ids, labels)


def checkpoint_config(**kw):
    """The serial checkpoint tests' trainer settings (CHECKPOINT_STEPS steps, every checkpoint kept)."""
    base = dict(lr=1e-2, warmup_steps=2, batch_size=4, max_steps=CHECKPOINT_STEPS, progress=False, seed=3,
                device="cpu", keep_last=0)
    base.update(kw)
    return TrainerConfig(**base)


def random_goldfish():
    """A goldfish transform that consumes RNG state (strategy random), so resume must restore it."""
    return GoldfishTransform(GoldfishConfig(enabled=True, strategy="random", k=3, h=2), seed=1)


def checkpoint_trainer(root=None, **kw):
    """A serial Trainer on a tiny model with random goldfish, checkpointing into `root`."""
    return Trainer(tiny_model(), checkpoint_config(**kw), rows(n=12), label_transform=random_goldfish(),
                   checkpoint_dir=root)


def grid_trainer(grid, root=None):
    """A Trainer on `grid` (serial: the plain model), checkpointing at CHECKPOINT_HALF of the steps."""
    import axonn

    model = tiny_model()
    if grid.distributed:
        model = axonn.parallelize(model, grid)
    cfg = TrainerConfig(lr=1e-2, warmup_steps=2, batch_size=4, max_steps=CHECKPOINT_STEPS, progress=False,
                        seed=3, device="cpu", checkpoint_every=CHECKPOINT_HALF, keep_last=0, weight_decay=0.1)
    transform = GoldfishTransform(GoldfishConfig(enabled=True, k=3, h=2), seed=1)
    return Trainer(model, cfg, rows(n=12), label_transform=transform, grid=grid, checkpoint_dir=root)


def tiny_pretrained(tmp_path_factory) -> str:
    """A tiny 'pretrained' HF folder (seeded weights, its own 320-id BPE; 4 heads, 2 KV heads, tied),
    in safetensors: what the LoRA, adapter-export and pretrained-grid tests fine-tune."""
    from data_pipelines import load_corpus, load_tokenizer

    texts = [d.text for d in load_corpus("wiki-leads", limit=30)]
    tok = load_tokenizer("bpe", texts=texts, vocab_size=320, cache_dir=tmp_path_factory.mktemp("c"))
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True))
    out = tmp_path_factory.mktemp("pretrained")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def scan_llama(root, initializer_range: float = 0.2) -> LlamaForCausalLM:
    """The scan tests' model, saved to ROOT/model and returned in eval mode: a seeded tiny Llama, vocab
    320, 4 heads / 2 KV heads, no tokenizer (token files need none); a larger `initializer_range` gives
    peaked logits (sampling then reproduces its own continuations)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=initializer_range, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "model")
    return model


def tiny_scan_folder(root):
    """What the scan tests read: a tiny Llama folder (vocab 320, 4 heads / 2 KV heads, no tokenizer:
    token files need none) and an indexed corpus `corpus.bin/.idx` of 40 random documents, 3 of them
    too short for a 6 + 6 window, with a manifest.json of it."""
    import numpy as np

    from data_pipelines.inject import Manifest

    scan_llama(root)
    g = np.random.default_rng(0)
    docs = [g.integers(0, 320, size=int(n)).tolist() for n in g.integers(20, 40, size=40)]
    docs[3], docs[17], docs[30] = docs[3][:5], docs[17][:9], [7]
    write_indexed(root / "corpus", docs, np.uint16)
    Manifest(seed=0, num_base_documents=38, num_documents=40, items=[]).to_json(root / "manifest.json")
    return root


def write_indexed(prefix: str | Path, documents: list[list[int]],
                  dtype: Any = np.uint16) -> tuple[Path, Path]:
    """Write documents as NAME.bin + NAME.idx in the indexed format (one sequence per document): the
    Megatron files `memorize scan --data` reads (data_pipelines/token_sources.py)."""
    dt = np.dtype(dtype)
    code = next(c for c, d in IDX_DTYPES.items() if d == dt)
    prefix = Path(prefix)
    bin_path, idx_path = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    sizes = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes.astype(np.int64) * dt.itemsize)[:-1]]).astype(np.int64)
    with open(bin_path, "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype=dt).tobytes())
    doc_idx = np.arange(len(documents) + 1, dtype=np.int64)
    with open(idx_path, "wb") as f:
        f.write(IDX_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<QQ", len(documents), len(doc_idx)))
        f.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    return bin_path, idx_path


def memorized_model(n: int = 6, t: int = 20, steps: int = 150) -> tuple[torch.nn.Module, list[list[int]]]:
    """tiny_model trained until it reproduces n random rows of t tokens (peaked logits), and the rows."""
    model = tiny_model(seed=1)
    docs = torch.randint(0, 64, (n, t), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=docs, labels=docs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, docs.tolist()


def levenshtein(a: list[int], b: list[int]) -> int:
    """Edit distance by its definition (unit substitutions, insertions, deletions), one row at a time."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def refused(capsys, argv: list, *needles: str) -> str:
    """`memorize ARGV` exits 2 with one `error: ...` line on stderr naming every needle; that line."""
    from memorization.cli import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for n in needles:
        assert n in err, err
    return err

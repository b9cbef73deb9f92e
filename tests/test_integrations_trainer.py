"""A few steps of the Hugging Face Trainer with the goldfish collator give the losses `memorize train` gives
with goldfish on the same rows, order, optimizer (AdamW, decay groups, betas, clipping), cosine-to-min
schedule and seed, within 1e-6."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import Trainer, TrainingArguments

from axonn.trainer import epoch_order
from memorization.config import load_run_config
from memorization.integrations import GoldfishCollator
from memorization.models import build_model
from memorization.train.pipeline import run_training
from memorization.train.prepare import prepare_data

trl_sft = pytest.importorskip("trl.trainer.sft_trainer")
datasets = pytest.importorskip("datasets")

CONFIG = """
name: t
seed: 3
data: {corpus: wiki-leads, limit: 12, vocab_size: 300, block_len: 48, min_tokens: 40, held_out: ""}
model:
  name: tiny
  overrides: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4}
goldfish: {enabled: true, strategy: hash, k: 3, h: 4}
trainer: {batch_size: 4, max_steps: 6, progress: false, lr: 1.0e-2, warmup_steps: 0, weight_decay: 0.1,
          grad_clip: 1.0, device: cpu}
eval: {extraction: false}
wandb: {mode: disabled}
"""


class EpochOrder(torch.utils.data.Sampler):
    """Our Trainer's row order (axonn.trainer.epoch_order), a new permutation each epoch."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        order = epoch_order(self.n, self.seed, self.epoch).tolist()
        self.epoch += 1
        return iter(order)


def test_hf_trainer_with_the_collator_matches_memorize_train(tmp_path, cache_dir):
    (tmp_path / "c.yaml").write_text(CONFIG)
    cfg = load_run_config(tmp_path / "c.yaml")
    run_training(cfg, tmp_path / "out", progress=False)
    ours = [json.loads(line)["loss"] for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]
    data, t = prepare_data(cfg), cfg.trainer
    rows = data.train[torch.arange(len(data.train))]
    ds = datasets.Dataset.from_dict({"input_ids": rows["input_ids"].tolist(),
                                     "labels": rows["labels"].tolist(),
                                     "attention_mask": (rows["doc_ids"] >= 0).long().tolist()})
    model = build_model(cfg.model.name, vocab_size=cfg.data.vocab_size, seed=cfg.seed,
                        overrides=cfg.model.overrides)
    # our Trainer: AdamW (betas; weight decay on >= 2-D weights but norms, as HF's), clipping, cosine to
    # min_lr_ratio. Its warmup reaches lr at step warmup-1, HF's at step warmup: the test uses none.
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=t.batch_size,
                             max_steps=t.max_steps, learning_rate=t.lr, weight_decay=t.weight_decay,
                             adam_beta1=t.beta1, adam_beta2=t.beta2, max_grad_norm=t.grad_clip,
                             lr_scheduler_type="cosine_with_min_lr",
                             lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio},
                             warmup_steps=t.warmup_steps, report_to=[], save_strategy="no", use_cpu=True,
                             seed=cfg.seed, disable_tqdm=True)
    losses = []

    class Recording(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return EpochOrder(len(self.train_dataset), t.seed)

        def training_step(self, *a, **k):
            loss = super().training_step(*a, **k)
            losses.append(loss.item())
            return loss

    inner = trl_sft.DataCollatorForLanguageModeling(pad_token_id=0)
    collator = GoldfishCollator(inner, cfg.goldfish, seed=cfg.seed)
    Recording(model=model, args=args, train_dataset=ds, data_collator=collator).train()
    assert len(losses) == len(ours) == t.max_steps
    assert max(abs(a - b) for a, b in zip(ours, losses)) < 1e-6, (ours, losses)

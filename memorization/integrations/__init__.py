"""Drop-ins for the Hugging Face Trainer and TRL over the project's own goldfish, injection and evaluation.

- `GoldfishCollator` (collator.py): wraps any data collator; labels get GoldfishTransform's masks.
- `inject_dataset` (datasets.py): canaries and duplicates into a `datasets.Dataset`, with the Manifest.
- `MemorizationCallback` (callback.py): scores memorization in place each epoch or N steps, logs through
  the Trainer and writes the per-pass report (probe.py asks the questions, report.py writes the files);
  `paired_canaries` tests two runs' passes canary by canary (e.g. a goldfish arm against a standard one).
docs/finetuning.md, "With the Hugging Face Trainer or TRL", shows them together.
"""
from __future__ import annotations

from memorization.integrations.callback import MemorizationCallback
from memorization.integrations.collator import GoldfishCollator, goldfish_batch
from memorization.integrations.datasets import inject_dataset
from memorization.integrations.report import paired_canaries

__all__ = ["GoldfishCollator", "MemorizationCallback", "goldfish_batch", "inject_dataset", "paired_canaries"]

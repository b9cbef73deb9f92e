"""Shared pytest setup: one thread per process, offline W&B, gpu/slow markers honoured."""
import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests without CUDA and `slow` tests unless MEMORIZE_SLOW=1."""
    no_gpu = pytest.mark.skip(reason="needs CUDA")
    no_slow = pytest.mark.skip(reason="slow: set MEMORIZE_SLOW=1 to run")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "slow" in item.keywords and os.environ.get("MEMORIZE_SLOW") != "1":
            item.add_marker(no_slow)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An isolated MEMORIZE_CACHE for tests that write caches."""
    monkeypatch.setenv("MEMORIZE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"

"""Score a trained causal LM for memorization: extraction, perplexity, membership inference, exposure.

Names are re-exported lazily (PEP 562) so `import evals` stays cheap and importing one
submodule does not pull in scipy/sklearn/rouge for the others.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "metrics": ["token_accuracy", "longest_common_prefix", "exact_match", "rouge_l"],
    "decoding": ["greedy_generate", "beam_generate"],
    "extraction": ["ExtractionResult", "extract", "summarize", "extractability", "extract_pairs"],
    "perplexity": ["sequence_logprobs", "mean_loss"],
    "mia": ["score_sequences", "roc_metrics", "membership_inference", "min_k_mean"],
    "exposure": ["exposure_rank", "exposure_extrapolated", "sequence_log_perplexity"],
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'evals' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"evals.{mod}"), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

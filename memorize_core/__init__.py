"""What every layer shares, with no dependencies: the house error, the ignore label, the batch type.

`axonn`, `data_pipelines`, `evals` and `memorization` all import from here and from nowhere
sideways for these names, so no package needs another just to raise a user-input error.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:  # annotations only: this module must import without torch
    from torch import Tensor

IGNORE_INDEX = -100
"""Label of a token the loss skips: padding, chat prompts, goldfish-dropped positions."""

NEAR_DISTANCES = ("hamming", "levenshtein")
"""How near-verbatim extraction counts the changes between a sample and the true suffix: tokens
substituted in place, or substituted, inserted and deleted (evals.near_verbatim; eval.nv_distance)."""


class ConfigError(ValueError):
    """Bad user input: the message names the field, the value and the fix."""


def fail(field: str, value: Any, fix: str) -> ConfigError:
    """Build a ConfigError with the house message format (`field=value: fix`)."""
    return ConfigError(f"{field}={value!r}: {fix}")


class Batch(TypedDict, total=False):
    """Rows of token blocks as the data, the label transforms and the trainer exchange them.

    Every tensor is [rows, block_len]. `input_ids` is always there; `labels` (IGNORE_INDEX where
    unsupervised) defaults to `input_ids`; `doc_ids` is -1 on padding; `positions` is each token's
    offset in its document (-1 on padding) for transforms that key on it.
    """

    input_ids: Tensor
    labels: Tensor
    doc_ids: Tensor
    positions: Tensor


__all__ = ["IGNORE_INDEX", "NEAR_DISTANCES", "Batch", "ConfigError", "fail"]

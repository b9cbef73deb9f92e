"""A KV cache that allocates its full length once, so decoding never re-copies past keys/values.

transformers' DynamicLayer appends with torch.cat, which copies the whole cache every step: for
small models on CPU that copy was ~30% of a decode step. This layer writes each new token's
keys/values into a buffer sized for prefix + new tokens and hands attention a view of the
filled part, which holds the same values as the concatenated tensor, so attention (and the
decoded tokens) match the default cache exactly.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

try:  # semi-internal helper of transformers 5.x; absent elsewhere -> fall back to the default cache
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # pragma: no cover
    get_layer_types_and_kwargs = None


class PreallocatedLayer(DynamicLayer):
    """DynamicLayer whose keys/values are views into a buffer of `capacity` positions."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0

    def _view(self) -> None:
        self.keys = self._kbuf[:, :, :self._len]
        self.values = self._vbuf[:, :, :self._len]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions into the buffer and return views of everything cached so far."""
        n = key_states.shape[-2]
        if self._kbuf is None:
            self.dtype, self.device = key_states.dtype, key_states.device
            b, h, _, d = key_states.shape
            cap = max(self.capacity, n)
            self._kbuf = key_states.new_empty(b, h, cap, d)
            self._vbuf = value_states.new_empty(b, h, cap, value_states.shape[-1])
            self.is_initialized = True
        if self._len + n > self._kbuf.shape[2]:  # more tokens than planned: grow (rare, correct)
            extra = self._len + n - self._kbuf.shape[2]
            pad = lambda t: torch.cat([t, t.new_empty(*t.shape[:2], extra, t.shape[3])], dim=2)  # noqa: E731
            self._kbuf, self._vbuf = pad(self._kbuf), pad(self._vbuf)
        self._kbuf[:, :, self._len:self._len + n] = key_states
        self._vbuf[:, :, self._len:self._len + n] = value_states
        self._len += n
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Number of cached positions."""
        return self._len

    def _batch_op(self, fn) -> None:
        if self._kbuf is not None:
            self._kbuf, self._vbuf = fn(self._kbuf), fn(self._vbuf)
            self._view()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search)."""
        self._batch_op(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row `repeats` times."""
        self._batch_op(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the given batch rows."""
        self._batch_op(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove positions."""
        if tokens_to_remove < 0 and self._kbuf is not None:
            self._len = max(0, self._len + tokens_to_remove)
            self._view()

    def reset(self) -> None:
        """Forget everything cached."""
        self._kbuf = self._vbuf = None
        self._len = 0
        super().reset()


def preallocated_cache(model: torch.nn.Module, capacity: int) -> Cache | None:
    """A cache of PreallocatedLayers for a full-attention model, or None to use the model's default.

    Sliding-window, chunked, linear-attention or KV-sharing layers need their own cache types.
    """
    config = getattr(model, "config", None)
    if config is None or get_layer_types_and_kwargs is None:
        return None
    try:
        text = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text)
    except Exception:  # unusual configs: the default cache is always correct
        return None
    if not layer_types or any(t != "full_attention" for t in layer_types):
        return None
    return Cache(layers=[PreallocatedLayer(capacity) for _ in layer_types])

"""The decoder's KV cache: transformers' ``DynamicCache`` whose layers keep K/V in a buffer grown by doubling.

``DynamicLayer.update`` concatenates the whole cache with the new rows every forward (``torch.cat``: a copy of
every layer's K and V per step, growing with the context). :class:`BufferedLayer` copies only the new rows into
spare capacity and hands attention a view of the filled part; cropping (rejected drafts) and the tree decoder's
in-place compaction (:func:`eval.decoder.keep_rows`) work on the same view. ``python -m eval.bench_decode``
profiles a target step with it (``aten::cat`` is what it removes).
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class BufferedLayer(DynamicLayer):
    """A ``DynamicLayer`` with capacity: ``keys``/``values`` are views ``[B, H, n, hd]`` of buffers ``[B, H, cap, hd]``."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._n = 0
        self._kb = self._vb = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self._n, key_states.shape[-2]
        if self._kb is None or n + m > self._kb.shape[-2]:  # grow: twice what is needed (amortised O(1) copies per row)
            cap = max(256, 2 * (n + m))
            kb = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
            vb = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
            if n:
                kb[..., :n, :] = self._kb[..., :n, :]
                vb[..., :n, :] = self._vb[..., :n, :]
            self._kb, self._vb = kb, vb
        self._kb[..., n: n + m, :] = key_states
        self._vb[..., n: n + m, :] = value_states
        self._set(n + m)
        return self.keys, self.values

    def _set(self, n: int) -> None:
        self._n = n
        self.keys, self.values = self._kb[..., :n, :], self._vb[..., :n, :]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        if tokens_to_remove and self.is_initialized and self._kb is not None:
            self._set(max(0, self._n - abs(tokens_to_remove)))

    def reset(self) -> None:
        self._kb = self._vb = None
        self._n = 0
        super().reset()


def new_cache() -> DynamicCache:
    """An empty cache of :class:`BufferedLayer` (one per decoder layer, created on first use)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = BufferedLayer
    return cache

"""The decoder's KV cache: transformers' ``DynamicCache`` whose layers keep K/V in a buffer grown by doubling.

``DynamicLayer.update`` concatenates the whole cache with the new rows every forward (``torch.cat``: a copy of
every layer's K and V per step, growing with the context). :class:`BufferedLayer` copies only the new rows into
spare capacity and hands attention a view of the filled part; cropping (rejected drafts) and the tree decoder's
in-place compaction (:func:`eval.decoding.decoder.keep_rows`) work on the same view. ``python -m eval.bench_decode``
profiles a target step with it (``aten::cat`` is what it removes).
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from models.layers import KVBuffer


class BufferedLayer(DynamicLayer):
    """A ``DynamicLayer`` with capacity: ``keys``/``values`` are views ``[B, H, n, hd]`` of buffers ``[B, H, cap, hd]``
    (:class:`models.layers.KVBuffer`, the drafts' caches too)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._buf = KVBuffer()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self._buf.add(key_states, value_states)
        self._buf.keep()
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        if tokens_to_remove and self.is_initialized and self._buf.kept() is not None:
            self._buf.crop(max(0, self._buf.n - abs(tokens_to_remove)))
            self.keys, self.values = self._buf.kept()

    def reset(self) -> None:
        self._buf = KVBuffer()
        super().reset()


def new_cache() -> DynamicCache:
    """An empty cache of :class:`BufferedLayer` (one per decoder layer, created on first use)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = BufferedLayer
    return cache

"""The encoded-prompt cache every family adapter keeps: repeated prompts skip the text encoders."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor


def own_copy(value: Any) -> Any:
    """`value` with every tensor in it (nested in tuples, lists and dicts) copied into storage of its own. A row
    of a batched encoder output is a view that keeps the whole batch alive; a cached entry must not."""
    if isinstance(value, Tensor):
        return value.clone(memory_format=torch.contiguous_format)
    if isinstance(value, dict):
        return {k: own_copy(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return type(value)(*(own_copy(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(own_copy(v) for v in value)
    return value


class PromptCache:
    """A small LRU of prompt -> encoder output (any value), so repeated prompts skip the text encoders. Entries
    are stored as copies (own_copy), so the encoder batch they came from can be freed."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, prompt: str) -> Any:
        value = self._items.get(prompt)
        if value is not None:
            self._items.move_to_end(prompt)
            self.hits += 1
        else:
            self.misses += 1
        return value

    def put(self, prompt: str, value: Any) -> Any:
        """Store a copy of `value` (own_copy) and return it."""
        value = own_copy(value)
        self._items[prompt] = value
        self._items.move_to_end(prompt)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every entry (their tensors live on the device the model is leaving)."""
        self._items.clear()

    def encode(self, prompts: list[str], encode_missing) -> list[Any]:
        """Values for `prompts`, calling `encode_missing(list of distinct uncached prompts) -> list` once."""
        out: dict[str, Any] = {}
        missing: list[str] = []
        for p in prompts:
            if p in out or p in missing:
                continue
            cached = self.get(p)
            if cached is None:
                missing.append(p)
            else:
                out[p] = cached
        if missing:
            for p, value in zip(missing, encode_missing(missing)):
                out[p] = self.put(p, value)
        return [out[p] for p in prompts]

"""Bounded caches for the engine: results of deterministic requests, and vision features by image."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class LRUCache:
    """Least-recently-used cache bounded by a total cost (entries, or bytes with `cost`).

    Thread-safe; `max_cost` 0 disables it. Hits and misses are counted for /metrics.
    """

    def __init__(self, max_cost: int, cost: Callable[[Any], int] = lambda value: 1):
        self.max_cost = max_cost
        self._cost = cost
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value: Any) -> None:
        size = self._cost(value)
        if self.max_cost <= 0 or size > self.max_cost:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._total -= old[1]
            self._entries[key] = (value, size)
            self._total += size
            while self._total > self.max_cost:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._total -= evicted

    @property
    def cost(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

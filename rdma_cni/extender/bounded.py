"""A least-recently-used map bounded by entries and by a weight (bytes, names): caches fed by requests.

Whatever a request can add to (views of full-Node requests, remembered
request ends, answers per shape) must not grow with what a client sends:
each such cache is one of these, with both bounds, so that neither many small
entries nor a few huge ones outgrow the extender's memory limit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["Bounded"]

K = TypeVar("K")
V = TypeVar("V")


class Bounded(Generic[K, V]):
    """At most ``max_items`` entries of at most ``max_weight`` in all; the least recently used go first.

    An entry heavier than ``max_weight`` alone is not kept. Thread-safe.
    """

    def __init__(self, max_items: int, max_weight: int) -> None:
        self.max_items = max_items
        self.max_weight = max_weight
        self.weight = 0
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value (now the most recently used), or ``default``."""
        with self._lock:
            got = self._items.get(key)
            if got is None:
                return default
            self._items.move_to_end(key)
            return got[0]

    def put(self, key: K, value: V, weight: int = 1) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used entries over the bounds."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.weight -= old[1]
            if weight > self.max_weight:
                return
            self._items[key] = (value, weight)
            self.weight += weight
            while len(self._items) > self.max_items or self.weight > self.max_weight:
                _, (_, gone) = self._items.popitem(last=False)
                self.weight -= gone

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove and return the value, or ``default``."""
        with self._lock:
            got = self._items.pop(key, None)
            if got is None:
                return default
            self.weight -= got[1]
            return got[0]

    def values(self) -> list[V]:
        """The values, least recently used first (a copy: the map may change meanwhile)."""
        with self._lock:
            return [value for value, _ in self._items.values()]

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._items.clear()
            self.weight = 0

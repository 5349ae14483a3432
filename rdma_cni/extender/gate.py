"""Filters first: binds step aside while a filter is being decided.

kube-scheduler decides one pod at a time, and the extender's filter answer is
the one wait of that cycle it does not have without the extender; binds run
beside it (kube-scheduler binds asynchronously) and nothing waits on them but
their own pod. In one interpreter every runnable thread takes turns, so with a
burst of binds in flight a filter of 1.5-2 ms of CPU was answered in 5-7 ms at
5,000 nodes (docs/performance.md, "The extender, second"). A bind therefore
waits for the filters in progress before each of its steps (reading the pod,
reserving, creating the Binding), up to :data:`MAX_WAIT` a step, so that a
stream of filters can delay binds but never stop them. Nothing else changes:
what a bind decides, and under which lock, is the same.
"""

from __future__ import annotations

import threading

__all__ = ["MAX_WAIT", "FilterGate"]

# Seconds a bind step waits for filters at most: kube-scheduler's filters come one after the
# other with its own work in between, so binds run in those gaps; this bounds a bind's delay
# (three steps) far below the extender's httpTimeout even if filters never paused.
MAX_WAIT = 0.05


class FilterGate:
    """Counts the filters in progress; binds wait until there are none (up to ``max_wait``)."""

    def __init__(self, max_wait: float = MAX_WAIT) -> None:
        self.max_wait = max_wait
        self._lock = threading.Lock()
        self._active = 0
        self._clear = threading.Event()
        self._clear.set()

    def __enter__(self) -> FilterGate:
        with self._lock:
            self._active += 1
            self._clear.clear()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._active -= 1
            if not self._active:
                self._clear.set()

    def wait(self) -> bool:
        """Wait until no filter is in progress, or ``max_wait``; whether none is."""
        return self._clear.wait(self.max_wait)

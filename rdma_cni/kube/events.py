"""Kubernetes Events (core v1) posted from a background thread, so that no decision waits for one.

:meth:`EventSink.emit` only puts the event on a bounded queue and returns;
when the queue is full (the API is slow or down) the event is dropped and
counted, never waited for. A ``key`` rate-limits: at most one event per key
per ``min_interval`` seconds (e.g. one "cannot publish" per node per ten
minutes, not one per retry). Events need ``create`` on ``events`` in the
core API group, and nothing else (conf/base/node/rbac.yaml).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from rdma_cni.shared.quote import bounded

__all__ = ["EventSink"]

log = logging.getLogger("rdma_cni.events")

# The API rejects longer messages; what an operator reads first fits well within.
MAX_MESSAGE = 1024
# Room for the "... (N characters)" tail that says a message was cut.
_TAIL = 40


def _now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _message(text: str) -> str:
    """``text`` escaped and at most :data:`MAX_MESSAGE` characters, its length said when cut."""
    out = bounded(text, MAX_MESSAGE - _TAIL)
    # Escapes lengthen what is kept (up to 10 characters each): then keep what surely fits.
    return out if len(out) <= MAX_MESSAGE else bounded(text, (MAX_MESSAGE - _TAIL) // 10)


class EventSink:
    """Posts events through ``post`` (path, body) on a daemon thread; drops when ``capacity`` are queued.

    ``post`` is usually an API client's ``post``; a function lets a caller whose client is replaced
    (the agent reconnects on rotated credentials) always post through the current one.
    """

    def __init__(
        self,
        post: Callable[[str, dict[str, Any]], Any],
        component: str,
        *,
        host: str = "",
        capacity: int = 64,
        min_interval: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.post = post
        self.component = component
        self.host = host
        self.min_interval = min_interval
        self._clock = clock
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(capacity)
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self.posted = 0
        self.dropped = 0
        self.limited = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name=f"{component}-events", daemon=True)
        self._thread.start()

    def emit(
        self,
        *,
        kind: str,
        name: str,
        reason: str,
        message: str,
        namespace: str = "",
        uid: str = "",
        type: str = "Warning",  # the Event's own field name
        key: str | None = None,
    ) -> bool:
        """Queue an event about ``kind``/``name``; False when rate-limited by ``key`` or dropped (queue full).

        Never blocks. A Node is cluster-scoped: its events go to the ``default`` namespace, as the kubelet's.
        """
        if key is not None:
            now = self._clock()
            with self._lock:
                last = self._last.get(key)
                if last is not None and now - last < self.min_interval:
                    self.limited += 1
                    return False
                self._last[key] = now
        involved: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "name": name}
        if namespace:
            involved["namespace"] = namespace
        if uid:
            involved["uid"] = uid
        stamp = _now_rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace or "default"},
            "involvedObject": involved,
            "reason": reason,
            # Messages repeat what pods and agents wrote (a refused request's reason): escaped, so
            # `kubectl describe` prints no escape sequence, and bounded whatever they quoted.
            "message": _message(message),
            "type": type,
            "source": {"component": self.component, **({"host": self.host} if self.host else {})},
            "reportingComponent": self.component,
            "reportingInstance": self.host or self.component,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def _run(self) -> None:
        from rdma_cni.kube import client as kubeapi

        while True:
            event = self._queue.get()
            if event is None:
                return
            namespace = event["metadata"]["namespace"]
            try:
                self.post(f"/api/v1/namespaces/{namespace}/events", event)
                self.posted += 1
            except kubeapi.ApiError as exc:
                self.failed += 1
                log.warning(
                    "cannot post event %s on %s: %s", event["reason"], event["involvedObject"]["name"], exc
                )
            finally:
                self._queue.task_done()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued event is posted (or failed); for tests and shutdown. False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Stop the thread after what is queued (best effort: with a full queue it dies with the process)."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

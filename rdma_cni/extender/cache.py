"""Node states by node name, kept current by a list + watch of Nodes (metadata only).

kube-scheduler with ``nodeCacheCapable: true`` sends node names only, so the
extender keeps its own copy of every node's state annotation. It lists Nodes
as ``PartialObjectMetadataList`` (no status, no images: a fraction of the
bytes), then watches from the list's resourceVersion with bookmarks. Each
event decodes the annotation once (through :meth:`Decider.view`, which also
shares views between equal annotation texts); requests only look views up.
A 410 Gone (history compacted) relists; any other failure reconnects with
exponential backoff from the last resourceVersion seen. The cache is ready
once the first list has been applied.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rdma_cni.extender.decide import Decider, NodeView
from rdma_cni.shared import nodestate

__all__ = ["NodeCache"]

log = logging.getLogger("rdma_cni.extender.cache")

NODES = "/api/v1/nodes"


def _annotation(obj: Mapping[str, Any], key: str) -> tuple[str, str | None, str]:
    meta = obj.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    value = annotations.get(key) if isinstance(annotations, dict) else None
    return (
        meta.get("name") or "",
        value if isinstance(value, str) else None,
        str(meta.get("resourceVersion") or ""),
    )


class NodeCache:
    """Views of every node's published state; ``views`` may be read from any thread without a lock."""

    def __init__(
        self,
        client: Any,
        decider: Decider,
        *,
        annotation: str = nodestate.ANNOTATION,
        on_view: Callable[[str, NodeView], None] | None = None,
        watch_timeout: int = 300,
        backoff: tuple[float, float] = (0.2, 10.0),
    ) -> None:
        self.client = client
        self.decider = decider
        self.annotation = annotation
        self.on_view = on_view
        self.watch_timeout = watch_timeout
        self.backoff = backoff
        # Replaced wholesale on a relist, updated key by key on events: a reader
        # sees either the old or the new dict, each consistent.
        self.views: dict[str, NodeView] = {}
        # Bumped after every change of ``views`` (see Extender._lookup).
        self.generation = 0
        self.synced = threading.Event()
        self.resource_version = ""
        self.relists = 0
        self.reconnects = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> NodeCache:
        """Run the list + watch loop in a daemon thread."""
        self._thread = threading.Thread(target=self.run, name="node-cache", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the loop to end (it notices at the next event, bookmark or reconnect)."""
        self._stop.set()

    def _set(self, name: str, text: str | None) -> None:
        view = self.decider.view(text)
        self.views[name] = view
        self.generation += 1
        if self.on_view is not None:
            self.on_view(name, view)

    def relist(self) -> None:
        """List every node and replace the views."""
        doc = self.client.list(NODES, metadata_only=True)
        views: dict[str, NodeView] = {}
        for item in doc.get("items") or []:
            name, text, _ = _annotation(item, self.annotation)
            if name:
                views[name] = self.decider.view(text)
        self.views = views
        self.generation += 1
        if self.on_view is not None:
            for name, view in views.items():
                self.on_view(name, view)
        self.resource_version = str((doc.get("metadata") or {}).get("resourceVersion") or "")
        self.relists += 1
        self.synced.set()
        log.info("listed %d nodes at resourceVersion %s", len(views), self.resource_version)

    def watch_once(self) -> None:
        """Follow the watch from the current resourceVersion until it ends or the loop is stopped."""
        params = {"resourceVersion": self.resource_version, "allowWatchBookmarks": "true"}
        for event in self.client.watch(NODES, params, metadata_only=True, timeout_seconds=self.watch_timeout):
            kind = event.get("type")
            obj = event.get("object") or {}
            name, text, rv = _annotation(obj, self.annotation)
            if kind in ("ADDED", "MODIFIED") and name:
                self._set(name, text)
            elif kind == "DELETED" and name:
                self.views.pop(name, None)
                self.generation += 1
            if rv:
                self.resource_version = rv
            if self._stop.is_set():
                return

    def run(self) -> None:
        """List, then watch; relist on 410 Gone, reconnect with backoff on anything else."""
        follow(self, "node", self._stop, log)


class _Follower(Protocol):
    """What :func:`follow` drives: a list + watch of one kind, with its counters."""

    backoff: tuple[float, float]
    resource_version: str
    reconnects: int

    def relist(self) -> None: ...

    def watch_once(self) -> None: ...


def follow(watcher: _Follower, what: str, stop: threading.Event, logger: logging.Logger) -> None:
    """List, then watch until stopped: relist on 410 Gone, reconnect with backoff on anything else.

    The loop of both watches of the extender (nodes here, pods in podwatch.py); ``what`` names
    the kind in ``logger``'s lines.
    """
    from rdma_cni.kube import client as kubeapi

    delay = watcher.backoff[0]
    need_list = True
    while not stop.is_set():
        try:
            if need_list:
                watcher.relist()
                need_list = False
            watcher.watch_once()
            delay = watcher.backoff[0]
        except kubeapi.Gone as exc:
            # The server's words tell a compacted etcd ("...for the provided watch is
            # too old") from a watch cache that starts later ("too old resource version").
            logger.info(
                "%s watch: resourceVersion %s is too old, relisting (%s)", what, watcher.resource_version, exc
            )
            need_list = True
        except Exception as exc:  # any failure: keep what is known, retry from the last version seen
            watcher.reconnects += 1
            logger.warning("%s list/watch failed (%s); retrying in %.1f s", what, exc, delay)
            if stop.wait(delay):
                return
            delay = min(watcher.backoff[1], delay * 2)

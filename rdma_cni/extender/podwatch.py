"""Reservations and holds end with their pod: a watch of the pods of one scheduler name.

A reservation (reservations.py) lasts until the node publishes the pod, but a
pod deleted or finished before that must give its capacity back at once, not
after the reservation's TTL. One watch per scheduler name the extender serves
sees them go. It selects the pods of that name that have not finished
(``spec.schedulerName=NAME,status.phase!=Succeeded,status.phase!=Failed``: only
the pods bind accepts), so the API server sends a DELETED event both when such a
pod is deleted and when it finishes (it leaves the selection), and it asks for
metadata only (the uid is all it reads: a fraction of each event's bytes, for
the API server and for the extender, even when the name served is
``default-scheduler``, the whole cluster's). A DELETED event ends the pod's
reservation and its hold. Nothing of a pod is kept (the memory is the
resourceVersion), so it is bounded whatever the cluster holds.

It lists first (metadata only, in pages) and ends every reservation of its
scheduler name made before the list whose pod the list does not hold: those
pods went while nobody watched. Then it watches from the list's
resourceVersion with bookmarks; a 410 Gone (history compacted) relists, any
other failure reconnects from the last resourceVersion seen, with backoff.
Reservations of pods no watch covers (rebuilt at start for another
scheduler's pods) and Bindings whose outcome is unknown are still checked by
reading the pod (service.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from rdma_cni.extender.cache import follow
from rdma_cni.extender.reservations import Reservations

__all__ = ["PodWatch"]

log = logging.getLogger("rdma_cni.extender.podwatch")

PODS = "/api/v1/pods"
# Pods per page of the list: each is a few hundred bytes of metadata.
_PAGE = 500


class PodWatch:
    """Ends reservations and holds of the pods of ``scheduler`` that are gone; runs in a thread."""

    def __init__(
        self,
        client: Any,
        reservations: Reservations,
        scheduler: str,
        *,
        watch_timeout: int = 300,
        backoff: tuple[float, float] = (0.2, 10.0),
        on_gone: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        # Told each uid that went (the retrier forgets the pod).
        self.on_gone = on_gone
        self.reservations = reservations
        self.scheduler = scheduler
        self.watch_timeout = watch_timeout
        self.backoff = backoff
        self.resource_version = ""
        self.relists = 0
        self.reconnects = 0
        # Set once the first list has been applied: from then on this watch covers its pods.
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def selector(self) -> str:
        """The field selector of the list and the watch."""
        return f"spec.schedulerName={self.scheduler},status.phase!=Succeeded,status.phase!=Failed"

    def start(self) -> PodWatch:
        """Run the list + watch loop in a daemon thread."""
        self._thread = threading.Thread(target=self.run, name=f"pod-watch-{self.scheduler}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the loop to end (it notices at the next event, bookmark or reconnect)."""
        self._stop.set()

    def _gone(self, uid: str, why: str) -> None:
        self.reservations.release(uid)
        self.reservations.drop(uid, why)
        if self.on_gone is not None:
            self.on_gone(uid)

    def relist(self) -> None:
        """List the scheduler's unfinished pods; end the older reservations of pods no longer there."""
        started = self.reservations.now()
        uids: set[str] = set()
        params: dict[str, Any] = {"fieldSelector": self.selector, "limit": str(_PAGE)}
        while True:
            doc = self.client.list(PODS, params, metadata_only=True)
            for item in doc.get("items") or []:
                uid = (item.get("metadata") or {}).get("uid")
                if isinstance(uid, str):
                    uids.add(uid)
            meta = doc.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                break
            params = {**params, "continue": token}
        for res in self.reservations.all():
            if res.scheduler == self.scheduler and res.made < started and res.uid not in uids:
                self._gone(res.uid, "the pod is gone")
        self.resource_version = str(meta.get("resourceVersion") or "")
        self.relists += 1
        self.synced.set()

    def apply(self, event: dict[str, Any]) -> None:
        """One watch event: a pod deleted or finished (DELETED: it left the selection) ends its
        reservation and its hold."""
        meta = (event.get("object") or {}).get("metadata") or {}
        uid = meta.get("uid")
        rv = meta.get("resourceVersion")
        if event.get("type") == "DELETED" and isinstance(uid, str) and uid:
            self._gone(uid, "the pod is gone or finished")
        if isinstance(rv, str) and rv:
            self.resource_version = rv

    def watch_once(self) -> None:
        """Follow the watch from the current resourceVersion until it ends or the loop is stopped."""
        params = {
            "fieldSelector": self.selector,
            "resourceVersion": self.resource_version,
            "allowWatchBookmarks": "true",
        }
        for event in self.client.watch(PODS, params, metadata_only=True, timeout_seconds=self.watch_timeout):
            self.apply(event)
            if self._stop.is_set():
                return

    def run(self) -> None:
        """List, then watch; relist on 410 Gone, reconnect with backoff on anything else."""
        follow(self, "pod", self._stop, log)

"""Keep this node's ResourceSlices equal to its DRA devices: written only when they differ.

The node's pool (named after the node, ``rdma-cni.io`` the driver) is
published in as many slices as it needs (:func:`rdma_cni.shared.dra.slices.render_slices`).
Each pass lists the slices the API server holds for this node and driver
(field selectors ``spec.nodeName`` and ``spec.driver``) and compares their
devices with the current ones, quantities by value (the API server writes
``100000`` back as ``100k``). When they differ, the pool's generation goes
one up and every slice is rewritten at it: the existing ones updated in place
(PUT, their resourceVersion the precondition), missing ones created, extra
ones deleted; a consumer uses only the highest generation, so it never
mixes old and new. The Node owns the slices (they go with it).

As the node-state publisher: failures never raise out of :meth:`step`; the
pass is retried with exponential, jittered backoff (0.5 s to 30 s); a
conflict (another writer) reads everything again. An unchanged pool is
listed again every ``resync`` seconds, so slices deleted or edited behind the
agent's back come back.
"""

from __future__ import annotations

import logging
import random
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rdma_cni.shared.dra import DRIVER, RESOURCE_API
from rdma_cni.shared.dra.slices import PF_SHAPE, DraDevice, render_slices
from rdma_cni.shared.quantity import whole

if TYPE_CHECKING:
    from rdma_cni.kube.client import ApiClient

log = logging.getLogger("rdma_cni.agent")

__all__ = ["SlicePublisher", "normal"]

SLICES = f"/apis/{RESOURCE_API}/resourceslices"
MIN_BACKOFF = 0.5
MAX_BACKOFF = 30.0
DEFAULT_RESYNC = 300.0


def _quantity(value: Any) -> Any:
    count = whole(value)
    return value if count is None else count


def normal(devices: Sequence[Any]) -> list[Any]:
    """Devices with every quantity as its number, for comparing what was written with what is stored."""
    out = []
    for dev in devices:
        if not isinstance(dev, dict):
            out.append(dev)
            continue
        dev = dict(dev)
        capacity = dev.get("capacity")
        if isinstance(capacity, dict):
            fixed = {}
            for name, cap in capacity.items():
                if isinstance(cap, dict):
                    cap = dict(cap, value=_quantity(cap.get("value")))
                    policy = cap.get("requestPolicy")
                    if isinstance(policy, dict):
                        policy = dict(policy)
                        if "default" in policy:
                            policy["default"] = _quantity(policy["default"])
                        if isinstance(policy.get("validValues"), list):
                            policy["validValues"] = [_quantity(v) for v in policy["validValues"]]
                        cap["requestPolicy"] = policy
                fixed[name] = cap
            dev["capacity"] = fixed
        out.append(dev)
    return sorted(out, key=lambda d: str(d.get("name")) if isinstance(d, dict) else "")


class SlicePublisher:
    """Publishes one node's DRA devices; :meth:`offer` a new reading, call :meth:`step` often."""

    def __init__(
        self,
        client: Callable[[], ApiClient],
        node: str,
        *,
        resync: float = DEFAULT_RESYNC,
        min_backoff: float = MIN_BACKOFF,
        max_backoff: float = MAX_BACKOFF,
    ) -> None:
        self.client = client  # the agent's current client (it may reconnect)
        self.node = node
        self.resync = resync
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self._pending: list[DraDevice] | None = None
        self._current: list[DraDevice] | None = None  # the last devices offered
        self._checked_at: float | None = None  # when the API last held exactly them
        self._next_attempt = 0.0
        self._backoff = 0.0
        self._owner: dict[str, str] | None = None
        self.writes = 0
        self.failures = 0
        self.generation = 0
        self.last_error = ""

    def offer(self, devices: Sequence[DraDevice]) -> None:
        """A fresh reading of the node's DRA devices; published by the next :meth:`step` if it differs."""
        devices = list(devices)
        # Back to what was published: nothing is pending any more (an older reading must not be).
        self._pending = None if devices == self._current else devices

    def step(self) -> bool:
        """Bring the API server's slices to the latest reading if its time has come; True when written."""
        now = time.monotonic()
        resync_due = self._current is not None and (
            self._checked_at is None or now - self._checked_at >= self.resync
        )
        if (self._pending is None and not resync_due) or now < self._next_attempt:
            return False
        from rdma_cni.kube import client as kubeapi

        devices = self._pending if self._pending is not None else self._current
        assert devices is not None
        try:
            written = self._sync(devices)
        except kubeapi.ApiError as exc:
            self._failed(exc)
            return False
        self._current, self._pending = devices, None
        self._checked_at = time.monotonic()
        self._backoff = 0.0
        if self.last_error:
            log.info("DRA: ResourceSlices published again after: %s", self.last_error)
            self.last_error = ""
        return written

    def _list(self) -> list[dict[str, Any]]:
        selector = f"spec.nodeName={self.node},spec.driver={DRIVER}"
        doc = self.client().list(SLICES, {"fieldSelector": selector})
        items = doc.get("items")
        return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []

    def _node_owner(self) -> dict[str, str]:
        if self._owner is None:
            node = self.client().get(f"/api/v1/nodes/{urllib.parse.quote(self.node, safe='')}")
            self._owner = {"name": self.node, "uid": str((node.get("metadata") or {}).get("uid", ""))}
        return self._owner

    def _sync(self, devices: list[DraDevice]) -> bool:
        existing = sorted(self._list(), key=lambda s: str((s.get("metadata") or {}).get("name", "")))
        generations = [int((s.get("spec") or {}).get("pool", {}).get("generation") or 0) for s in existing]
        top = max(generations, default=0)
        held = [d for s in existing for d in ((s.get("spec") or {}).get("devices") or [])]
        wanted = render_slices(self.node, devices, top or 1, shape=PF_SHAPE)
        consistent = all(
            g == top and (s.get("spec") or {}).get("pool", {}).get("resourceSliceCount") == len(existing)
            for s, g in zip(existing, generations, strict=True)
        )
        if (
            consistent
            and len(existing) == len(wanted)
            and normal(held) == normal([d for s in wanted for d in s["spec"]["devices"]])
        ):
            self.generation = top
            return False
        generation = top + 1
        docs = render_slices(self.node, devices, generation, owner=self._node_owner(), shape=PF_SHAPE)
        api = self.client()
        for i, doc in enumerate(docs):
            if i < len(existing):
                meta = existing[i].get("metadata") or {}
                doc["metadata"] = {
                    **doc["metadata"],
                    "name": meta.get("name"),
                    "resourceVersion": meta.get("resourceVersion"),
                }
                doc["metadata"].pop("generateName", None)
                api.put(f"{SLICES}/{urllib.parse.quote(str(meta.get('name')), safe='')}", doc)
            else:
                api.post(SLICES, doc)
        for extra in existing[len(docs) :]:
            name = str((extra.get("metadata") or {}).get("name"))
            api.delete(f"{SLICES}/{urllib.parse.quote(name, safe='')}")
        self.generation = generation
        self.writes += 1
        log.info(
            "DRA: published %d device(s) of node %s in %d ResourceSlice(s), pool generation %d",
            sum(len(d["spec"]["devices"]) for d in docs),
            self.node,
            len(docs),
            generation,
        )
        return True

    def _failed(self, exc: Exception) -> None:
        from rdma_cni.kube import client as kubeapi

        self.failures += 1
        if isinstance(exc, kubeapi.NotFound):
            self._owner = None  # the Node was made again: another uid
        self._backoff = min(self.max_backoff, max(self.min_backoff, self._backoff * 2))
        delay = self._backoff * (0.5 + random.random() / 2)
        self._next_attempt = time.monotonic() + delay
        message = f"{type(exc).__name__}: {exc}"
        if message != self.last_error:
            log.warning(
                "DRA: cannot publish ResourceSlices of node %s (retrying in %.1f s): %s",
                self.node,
                delay,
                message,
            )
        self.last_error = message

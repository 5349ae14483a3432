"""Write the node state to this node's Node object, only when it changed.

The write is a JSON merge patch of ``metadata.annotations`` (only our key:
labels and other annotations are untouched, and no resourceVersion is
needed). ``generation`` counts publishes: it continues from the value found
on the Node, so a restarted agent never goes backwards. A state whose content
(:func:`rdma_cni.shared.nodestate.same_content`) equals the last one written is not
written, except once per ``heartbeat`` so that readers can tell a live agent
from a dead one by ``updated``.

Failures never raise out of :meth:`Publisher.step`: the state stays pending
and the next attempt waits an exponentially growing, jittered delay (0.5 s
up to 30 s), so an API server that is down or refusing costs a handful of
requests a minute, never a crash loop.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import random
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rdma_cni.agent import metrics
from rdma_cni.agent.capacity import Advertiser
from rdma_cni.shared import nodestate

if TYPE_CHECKING:
    from rdma_cni.kube.client import ApiClient

log = logging.getLogger("rdma_cni.agent")

# The API server limits the total size of a Node's annotations to 256 KiB;
# others (CNI plugins, kubeadm, volume controllers) need room too. The
# largest state a 16 x 128-VF node can produce is about 153 KiB (docs/node-state.md).
MAX_STATE_BYTES = 192 * 1024

MIN_BACKOFF = 0.5
MAX_BACKOFF = 30.0
DEFAULT_HEARTBEAT = 300.0

# A Node name is a DNS-1123 subdomain; it becomes part of a URL path.
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def check_node_name(name: str) -> str:
    """``name`` if it is a valid Node name, else ValueError naming NODE_NAME."""
    if not name or len(name) > 253 or not _NODE_NAME.fullmatch(name):
        raise ValueError(
            f"NODE_NAME {name[:80]!r} is not a valid node name (at most 253 lowercase letters, digits, "
            "'-' and '.'); set it from the downward API (spec.nodeName)"
        )
    return name


def rfc3339(ts: float) -> str:
    """A UTC timestamp as RFC 3339 with second precision, as Kubernetes writes them."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def fit(state: nodestate.NodeState) -> nodestate.NodeState:
    """``state``, or ``state`` without its allocations when it would exceed :data:`MAX_STATE_BYTES`.

    PF totals stay exact, so nothing is over-committed; without allocations
    the extender keeps its reservations until their TTL and finds no victims
    to preempt here: both err on the safe side.
    """
    # Room for the largest generation and timestamp the publisher fills in.
    size = len(nodestate.encode(state)) + 40
    if size <= MAX_STATE_BYTES or not state.allocations:
        return state
    log.warning(
        "node state is %d bytes, over the %d-byte budget: publishing it without its %d allocations",
        size,
        MAX_STATE_BYTES,
        len(state.allocations),
    )
    return dataclasses.replace(state, allocations=())


class Publisher:
    """Publishes states for one Node; call :meth:`offer` with new states and :meth:`step` often."""

    def __init__(
        self,
        client: ApiClient,
        node_name: str,
        *,
        heartbeat: float = DEFAULT_HEARTBEAT,
        reconnect: Callable[[], ApiClient] | None = None,
        min_backoff: float = MIN_BACKOFF,
        max_backoff: float = MAX_BACKOFF,
    ) -> None:
        self.client = client
        self._reconnect = reconnect
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.node = check_node_name(node_name)
        self.path = f"/api/v1/nodes/{self.node}"
        self.heartbeat = heartbeat
        self.published: nodestate.NodeState | None = None  # what the Node holds, as far as we know
        self._known = False  # whether `published` was read from (or written to) the Node
        self._written_at: float | None = None
        self._pending: nodestate.NodeState | None = None
        self._next_attempt = 0.0
        self._backoff = 0.0
        self.writes = 0
        self.failures = 0
        self.last_error = ""
        # An rdma_cni.kube.events.EventSink: told (rate-limited per node) when a publish fails.
        self.events: Any = None
        # The state's RDMA resources in the Node's status, after each write of the state.
        self.capacity = Advertiser(lambda: self.client, self.node)

    def offer(self, state: nodestate.NodeState) -> None:
        """A freshly computed state; written by the next :meth:`step` if it differs from the Node's."""
        self._pending = state

    def heartbeat_due(self) -> bool:
        """Whether the last write is older than ``heartbeat`` (or there was none)."""
        return self._written_at is None or time.monotonic() - self._written_at >= self.heartbeat

    def step(self) -> bool:
        """Try to write the pending state if its time has come; True when the Node was patched."""
        if self._pending is None or time.monotonic() < self._next_attempt:
            return False
        from rdma_cni.kube import client as kubeapi

        state = fit(self._pending)
        started = time.monotonic()
        try:
            if not self._known:
                self._read_current()
            unchanged = self.published is not None and nodestate.same_content(self.published, state)
            if unchanged and not self.heartbeat_due():
                self._pending = None
                self._backoff = 0.0
                metrics.publish_done("unchanged", started)
                return False
            written = self._write(state)
        except kubeapi.ApiError as exc:
            self._failed(exc)
            metrics.publish_done("failed", started)
            return False
        self.published = written
        self._written_at = time.monotonic()
        self._pending = None
        self._backoff = 0.0
        self.writes += 1
        metrics.publish_done("written", started)
        # Cleared as soon as the state is written: the capacity's write below is another request,
        # and until it returns the error would describe a publish that has already recovered.
        if self.last_error:
            log.info("node state published again after: %s", self.last_error)
            self.last_error = ""
        # With each heartbeat too: the kubelet may have reset them (see agent/capacity).
        self.capacity.advertise(written, again=unchanged)
        return True

    def _read_current(self) -> None:
        """Learn the generation (and content) already on the Node, so a restart continues from it."""
        node = self.client.get(self.path)
        annotations = (node.get("metadata") or {}).get("annotations") or {}
        text = annotations.get(nodestate.ANNOTATION)
        self.published = None
        if isinstance(text, str):
            try:
                self.published = nodestate.decode(text)
            except nodestate.NodeStateError as exc:
                log.warning(
                    "replacing the unreadable %s on node %s: %s", nodestate.ANNOTATION, self.node, exc
                )
        self._known = True
        # Not written by this process yet: the first matching state still
        # refreshes `updated`, since we cannot tell how old the Node's copy is.
        self._written_at = None

    def _write(self, state: nodestate.NodeState) -> nodestate.NodeState:
        generation = (self.published.generation if self.published else 0) + 1
        full = dataclasses.replace(state, generation=generation, updated=rfc3339(time.time()))
        text = nodestate.encode(full)
        body = {"metadata": {"annotations": {nodestate.ANNOTATION: text}}}
        self.client.patch_merge(self.path, body)
        log.info(
            "published node state generation %d on node %s (%d PFs, %d pods)",
            generation,
            self.node,
            len(full.pfs),
            len(full.allocations),
        )
        return full

    def _failed(self, exc: Exception) -> None:
        from rdma_cni.kube import client as kubeapi

        self.failures += 1
        metrics.api_error(exc)
        # After a conflict or a 404 the Node may differ from what we think:
        # read it again before the next write.
        if isinstance(exc, kubeapi.Conflict | kubeapi.NotFound):
            self._known = False
        if getattr(exc, "status", 0) == 401 and self._reconnect is not None:
            # The token was rotated under us: take the current credentials.
            self._reconnect_client()
        self._backoff = min(self.max_backoff, max(self.min_backoff, self._backoff * 2))
        delay = self._backoff * (0.5 + random.random() / 2)
        self._next_attempt = time.monotonic() + delay
        message = f"{type(exc).__name__}: {exc}"
        if self.events is not None:  # at most one per its interval: the sink rate-limits by node
            self.events.emit(
                kind="Node",
                name=self.node,
                reason="NodeStatePublishFailed",
                message=f"rdma-cni cannot publish this node's RDMA state: {message}",
                key=self.node,
            )
        if message != self.last_error:
            log.warning(
                "cannot publish node state on node %s (retrying in %.1f s): %s", self.node, delay, message
            )
        self.last_error = message

    def _reconnect_client(self) -> None:
        from rdma_cni.cni.errors import CniError

        assert self._reconnect is not None
        try:
            client = self._reconnect()
        except CniError as exc:
            log.warning("cannot reload API credentials: %s", exc.msg)
            return
        self.close()
        self.client = client

    def close(self) -> None:
        """Close the API client's connections."""
        self.client.close()

"""The agent's loop: snapshot when the records change (debounced) or periodically, then publish.

Python's standard library has no inotify, so the attachments directories are
polled: one ``stat`` each per tick (every 0.1 s by default), whose
modification time and inode change whenever ADD, DEL or GC creates, replaces
(write then rename) or removes a record. A change is acted on once the
directories have been quiet for ``debounce`` seconds, or at the latest
``max_delay`` after it was first seen, so a burst of ADDs costs one snapshot
and one write, and a change reaches the API server within a second.
The periodic snapshot (``period``) catches what no record reflects: VFs
enabled or removed, link speed changes.

The node lock is held only inside :func:`snapshot.snapshot`, never across an
API call: a slow API server must not hold up kubelet's ADDs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rdma_cni.agent.publish import Publisher
from rdma_cni.agent.snapshot import NetworkView, snapshot, unusable
from rdma_cni.cni.errors import CniError, IOFailure, TryAgainLater

if TYPE_CHECKING:
    from rdma_cni.agent.dra.service import DraAgent

log = logging.getLogger("rdma_cni.agent")

DEFAULT_POLL = 0.1
DEFAULT_DEBOUNCE = 0.2
DEFAULT_MAX_DELAY = 0.6
DEFAULT_PERIOD = 30.0
# After a busy lock or a failed scan, look again this soon.
RESCAN_DELAY = 1.0

Fingerprint = tuple[tuple[int, int] | None, ...]


def fingerprint(directories: Sequence[str]) -> Fingerprint:
    """(mtime_ns, inode) of each directory, None for one that does not exist (yet)."""
    out: list[tuple[int, int] | None] = []
    for d in directories:
        try:
            st = os.stat(d)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_mtime_ns, st.st_ino))
    return tuple(out)


class Agent:
    """Keeps this node's published state in step with its records and kernel state."""

    def __init__(
        self,
        views: Sequence[NetworkView],
        publisher: Publisher,
        *,
        poll: float = DEFAULT_POLL,
        debounce: float = DEFAULT_DEBOUNCE,
        max_delay: float = DEFAULT_MAX_DELAY,
        period: float = DEFAULT_PERIOD,
        dra: DraAgent | None = None,
    ) -> None:
        self.views = list(views)
        self.publisher = publisher
        self.poll = poll
        self.debounce = debounce
        self.max_delay = max_delay
        self.period = period
        # The DRA networks (agent/dra): read and published on the same passes, never in the node state.
        self.dra = dra
        self.all_views = self.views + (dra.views if dra is not None else [])
        self.directories = sorted(
            {os.path.join(v.state_dir, "attachments") for v in self.views}
            | set(dra.directories if dra else ())
        )
        self.snapshots = 0
        self.snapshot_errors = 0

    def refresh(self) -> bool:
        """Take a snapshot and hand it to the publisher; False when it must be retried soon."""
        try:
            state = snapshot(self.views)
        except TryAgainLater as exc:
            log.info("node state: %s; retrying", exc.msg)
            self.snapshot_errors += 1
            return False
        except IOFailure as exc:
            # ADD refuses every pod while a record cannot be read; say so on the Node.
            log.error("node state: %s; publishing that nothing fits until it is fixed", exc.msg)
            self.snapshot_errors += 1
            self.publisher.offer(unusable())
            return False
        except (CniError, OSError) as exc:
            log.error("node state: cannot read the node: %s; retrying", getattr(exc, "msg", exc))
            self.snapshot_errors += 1
            return False
        self.snapshots += 1
        self.publisher.offer(state)
        return True

    def run(self, stop: threading.Event) -> None:
        """Loop until ``stop`` is set. Never raises for node or API trouble; both are retried."""
        seen = fingerprint(self.directories)
        changed_at: float | None = None  # when an unhandled change was first seen
        quiet_since = 0.0
        next_scan = time.monotonic()  # at once: publish on start
        while not stop.is_set():
            now = time.monotonic()
            current = fingerprint(self.directories)
            if current != seen:
                seen = current
                quiet_since = now
                if changed_at is None:
                    changed_at = now
            due = now >= next_scan or (
                changed_at is not None
                and (now - quiet_since >= self.debounce or now - changed_at >= self.max_delay)
            )
            if due:
                changed_at = None
                # Read the fingerprint before the scan: a change during it is seen on the next tick.
                seen = fingerprint(self.directories)
                ok = self.refresh()
                if self.dra is not None:
                    ok = self.dra.refresh() and ok
                next_scan = time.monotonic() + (self.period if ok else RESCAN_DELAY)
            self.publisher.step()
            if self.dra is not None:
                self.dra.step()
            stop.wait(self.poll)


def setup_agent(
    *,
    node_name: str,
    network_configs: Sequence[str],
    kubeconfig: str | None,
    period: float = DEFAULT_PERIOD,
    heartbeat: float | None = None,
    kubelet_dirs: tuple[str, str] | None = None,
) -> Agent:
    """Build an agent from the installer's options; ValueError saying what the operator must fix.

    DRA networks among ``network_configs`` get the DRA side (agent/dra), and the kubelet plugin when
    ``kubelet_dirs`` (its registry and plugin directories) is given.
    """
    from rdma_cni.agent.publish import DEFAULT_HEARTBEAT, check_node_name
    from rdma_cni.agent.snapshot import default_view, load_view
    from rdma_cni.kube import client as kubeapi

    check_node_name(node_name)
    try:
        views = [load_view(path) for path in network_configs] or [default_view()]

        def connect() -> kubeapi.ApiClient:
            return kubeapi.ApiClient.from_kubeconfig(kubeconfig)

        client = connect()
    except CniError as exc:
        raise ValueError(exc.msg + (f" ({exc.details})" if exc.details else "")) from None
    publisher = Publisher(
        client,
        node_name,
        heartbeat=DEFAULT_HEARTBEAT if heartbeat is None else heartbeat,
        reconnect=connect,
    )
    dra = None
    if any(v.dra for v in views):
        from rdma_cni.agent.dra.devices import check_paths
        from rdma_cni.agent.dra.service import DraAgent

        check_paths(views)
        registry, plugin = kubelet_dirs or (None, None)
        dra = DraAgent(views, node_name, lambda: publisher.client, registry_dir=registry, plugin_dir=plugin)
    return Agent([v for v in views if not v.dra], publisher, period=period, dra=dra)


def start_nri(
    views: Sequence[NetworkView], socket_path: str, memlock: int | None, stop: threading.Event
) -> threading.Thread | None:
    """Start the NRI plugin thread for ``views``' state directories; None when ``socket_path`` is empty."""
    if not socket_path:
        log.info("NRI: disabled (--nri-socket is empty); pods get no RDMA devices from rdma-cni")
        return None
    from rdma_cni.agent.nri.plugin import NriPlugin, PodDevices
    from rdma_cni.node.nristate import state_path

    plugin = NriPlugin(
        socket_path,
        PodDevices([v.state_dir for v in views]),
        memlock=memlock,
        state_file=state_path(views[0].lock_file) if views else None,
        lock_file=state_path(views[0].lock_file) + ".lock" if views else None,
    )
    from rdma_cni.agent import metrics

    metrics.watch_nri(plugin)  # rdma_cni_agent_nri_registered, for the alert on pods without devices

    # Like run_agent: a bug is logged and the plugin resumes; container creation never waits on it.
    thread = threading.Thread(
        target=_resuming, args=("NRI plugin", plugin.run, stop), name="nri-plugin", daemon=True
    )
    thread.start()
    return thread


def start_dra(agent: Agent, stop: threading.Event) -> None:
    """Serve kubelet's DRA plugin calls until ``stop``, when the agent has DRA networks (agent/dra).

    OSError or RuntimeError when its sockets cannot be served.
    """
    if agent.dra is not None:
        agent.dra.start(stop)


def run_agent(agent: Agent, stop: threading.Event) -> None:
    """:meth:`Agent.run` that survives its own bugs: logged, then resumed after a pause."""
    _resuming("node agent", agent.run, stop)
    agent.publisher.close()


def _resuming(what: str, run: Callable[[threading.Event], None], stop: threading.Event) -> None:
    """``run(stop)`` until ``stop`` is set, resumed after a pause whenever it fails with a bug (logged)."""
    while not stop.is_set():
        try:
            run(stop)
        except Exception:
            log.exception("%s failed unexpectedly; restarting it in %.0f s", what, RESCAN_DELAY * 5)
            stop.wait(RESCAN_DELAY * 5)

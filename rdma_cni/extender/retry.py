"""A pod the extender refused for want of room is retried once a node it could go to has that room.

kube-scheduler parks a pod whose filter the extender failed in its
unschedulable pool, with the pseudo-plugin ``Extender`` among its rejectors,
and tries it again on the next cluster event of any kind (v1.37:
``schedule_one.go``, the default enqueue extension in ``framework.go``), or
after five minutes. When a node publishes room, kube-scheduler's Node informer
and the extender's node watch each see the update, in either order. When
kube-scheduler's comes first, it retries the pod at once, the extender's filter
answers from the state before the update, and in a quiet cluster no later
event comes: the pod waits for the five-minute flush. A reservation or hold
that ends (a bound pod deleted before its node published it, a hold given up)
frees room the same way, seen by kube-scheduler as a pod deletion and by the
extender through its pod watch, later.

So the extender remembers the pods it refused (:meth:`Retrier.refused`: the
pod, its demand, the nodes it was refused on) and, whenever its own views show
more room on a node (:meth:`Retrier.viewed`, called by the node cache for every
view it applies; each pass also asks the reservations which nodes changed),
judges those pods that named the node again. A pod that fits there now is made
to be retried by a write to the pod itself: kube-scheduler turns any update of
a pod in its unschedulable pool into a ``Pod/Update`` event for that pod alone
(``PriorityQueue.Update``), which requeues it because ``Extender`` rejected it.
The write sets the condition :data:`CONDITION` in the pod's status (a
strategic-merge patch of ``pods/status``, which merges conditions by type and
leaves kube-scheduler's ``PodScheduled`` alone), after the pod is read back
from the API: it is written only when it is the pod refused (same uid), not
bound, not being deleted, of a scheduler this extender serves, and its own
annotations (not what the refused request said) make a demand that fits the
node on the extender's views; the patch carries the resourceVersion read, so
a pod changed meanwhile (an update kube-scheduler acts on anyway) is left alone.

Exact in every order: the room is seen either by kube-scheduler's retry after
the extender's view has it (the pod fits) or by the extender's view after a
refusal (this module retries it). A refusal whose filter ran while room grew
(it may have judged the views from before) is judged again on the nodes that
changed meanwhile (:meth:`Retrier.mark`, taken before the filter looks at
anything). Preemption is untouched: the refused answer is the same
``FailedNodes`` as before, so kube-scheduler still preempts for the pod.

Bounded, whatever tenants create: at most :data:`PODS` pods are remembered
(the least recently refused go first) in at most :data:`WEIGHT` bytes, a
pod's nodes only when it names at most :data:`NODES_KEPT` (a longer list, a
sample of a large cluster, is kept as "any node"); a pod not refused again
for :data:`FORGET_AFTER` seconds is forgotten (kube-scheduler retries a
pending pod at least every five minutes, each retry refreshes it); a pod is
written at most once per :data:`NUDGE_EVERY` seconds, and the writes (each a
read and a patch) at most :data:`WRITES_PER_SECOND` per second; a pass judges
for at most :data:`PASS_BUDGET` seconds and leaves the rest to the next.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender.bounded import Bounded
from rdma_cni.extender.decide import FUTURE_SKEW, Abandoned, Deadline, Decider, NodeView
from rdma_cni.extender.demand import Demand, Demands
from rdma_cni.extender.reservations import Reservations, Reserved
from rdma_cni.extender.wire import WireError, pod_identity

__all__ = [
    "CONDITION",
    "FORGET_AFTER",
    "NODES_KEPT",
    "NUDGE_EVERY",
    "OUTCOMES",
    "PODS",
    "WEIGHT",
    "WRITES_PER_SECOND",
    "Retrier",
    "room_grew",
]

log = logging.getLogger("rdma_cni.extender.retry")

# The pod condition the extender sets to make kube-scheduler retry a pod (a qualified name of its own:
# kube-scheduler and the kubelet keep conditions they do not own).
CONDITION = "rdma-cni.io/RoomPublished"
PODS = 4096
WEIGHT = 4 * 1024 * 1024
# A refused pod's nodes are kept when it names at most this many (a pod pinned by its selector);
# a longer list is "any node": a retry it did not need costs one scheduling attempt.
NODES_KEPT = 64
_ENTRY_BYTES = 512
_NODE_BYTES = 96
# kube-scheduler retries every parked pod at least every 5 minutes (podMaxInUnschedulablePodsDuration),
# so a pod still pending is refused again well within this; one that is not is gone or bound.
FORGET_AFTER = 600.0
# A pod is written at most this often: kube-scheduler backs a pod off 1 s doubling to 10 s anyway.
NUDGE_EVERY = 2.0
WRITES_PER_SECOND = 20.0
# A pass judges for at most this long (then the next pass goes on), and passes are at least this far
# apart, so that a burst of node events is one pass and the thread never takes a core.
PASS_BUDGET = 0.05
PASS_GAP = 0.1
# Without events, a pass still runs this often: reservations are polled (they call nobody back).
IDLE = 0.5
# Nodes whose last view is remembered (to tell a view with more room); cleared beyond (unknown = more).
_SEEN_LIMIT = 100_000
# Node changes remembered for marks; older marks judge all of a pod's nodes again.
_CHANGES_LIMIT = 10_000

# What became of a pod a pass found room for (the outcome label of the retries counter).
OUTCOMES = frozenset({"retried", "gone", "bound", "no_room", "changed", "failed"})

ALL: None = None  # "every node": a pod's nodes, or the nodes to judge it on again


def room_grew(old: NodeView | None, new: NodeView, now: float, max_age: float | None) -> bool:
    """Whether a pod could fit ``new`` that did not fit ``old`` (a node's view before and after).

    True when the state is usable at ``now`` and was not (absent, invalid, too old or stamped
    too far ahead), or when any PF has more than before: a new PF, more free VFs, less reserved
    bandwidth, another capacity, NUMA node or network list. Placement needs, per PF, a free VF,
    a capacity and free bandwidth: with none of them larger, every pod that fits ``new`` fit
    ``old`` (False).
    """

    def usable(view: NodeView) -> bool:
        return max_age is None or now - max_age <= view.updated <= now + FUTURE_SKEW

    if new.state is None or not usable(new):
        return False
    if old is None or old.state is None or not usable(old):
        return True
    if old is new or old.fp == new.fp:
        return False
    if old.networks != new.networks:
        return True
    before = {pf.name: pf for pf in old.pfs}
    for pf in new.pfs:
        was = before.get(pf.name)
        if (
            was is None
            or pf.free_vfs > was.free_vfs
            or pf.reserved_mbps < was.reserved_mbps
            or pf.capacity_mbps != was.capacity_mbps
            or pf.numa_node != was.numa_node
        ):
            return True
    return False


def _held_less(old: Reserved | None, new: Reserved | None) -> bool:
    """Whether a node's reservations and holds hold less on some PF than before."""
    if not old or old is new:
        return False
    for pf, (vfs, rate) in old.items():
        now_vfs, now_rate = (new.get(pf) if new is not None else None) or (0, 0)
        if now_vfs < vfs or now_rate < rate:
            return True
    return False


class _Changes:
    """Nodes in the order they gained room, numbered, the last :data:`_CHANGES_LIMIT` kept."""

    def __init__(self) -> None:
        self.version = 0
        self._nodes: list[str] = []
        self._first = 0  # the version before the oldest kept

    def add(self, node: str) -> None:
        if len(self._nodes) >= _CHANGES_LIMIT:
            self._first += len(self._nodes)
            self._nodes = []
        self._nodes.append(node)
        self.version += 1

    def since(self, version: int) -> set[str] | None:
        """The nodes added after ``version`` (None: not all are kept)."""
        if version < self._first:
            return ALL
        return set(self._nodes[version - self._first :])


@dataclass(slots=True)
class Refused:
    """A pod the extender's filter refused, and what is owed to it."""

    uid: str
    namespace: str
    name: str
    demand: Demand
    nodes: frozenset[str] | None  # the nodes it was refused on (ALL: too many to keep)
    refused: float  # the retrier's clock at its last refusal
    nudged: float = -math.inf  # ... at its last write
    due: str = ""  # a node it fits now, not yet written to the pod
    recheck: set[str] | None = field(default_factory=set)  # nodes to judge it on again (ALL: all)

    def wants(self, node: str) -> bool:
        """Whether ``node`` is one it was refused on."""
        return self.nodes is None or node in self.nodes


Mark = tuple[int, int]


class Retrier:
    """Remembers refused pods and makes kube-scheduler retry them when a node has room; a thread.

    ``views`` is the watched node cache's (never a request's). ``scheduler_names`` are the
    schedulers whose pods this extender serves: no other pod is ever written.
    """

    def __init__(
        self,
        client: Any,
        decider: Decider,
        demands: Demands,
        reservations: Reservations,
        views: Callable[[], Mapping[str, NodeView]],
        scheduler_names: Collection[str],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.decider = decider
        self.demands = demands
        self.reservations = reservations
        self.views = views
        self.scheduler_names = frozenset(scheduler_names)
        self.clock = clock
        self._pods: Bounded[str, Refused] = Bounded(PODS, WEIGHT)
        self._lock = threading.Lock()
        # Node views as last seen, nodes that gained room since the last pass, and their numbered log.
        self._seen: dict[str, NodeView] = {}
        self._grown: set[str] = set()
        self._changes = _Changes()
        # The reservations' version last read, and what each node held then.
        self._res_version = reservations.version
        self._held: dict[str, Reserved] = {}
        # The last node list refused and its set, as one tuple (replaced whole, read once: filters
        # run in many threads): kube-scheduler's lists come back as the same object (verbs._lookup).
        self._last: tuple[list[str] | None, frozenset[str]] = (None, frozenset())
        # Write budget: tokens refill at WRITES_PER_SECOND, at most one second's worth.
        self._tokens = WRITES_PER_SECOND
        self._refilled = clock()
        self.outcomes: dict[str, int] = dict.fromkeys(sorted(OUTCOMES), 0)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._pods)

    # -- what the extender tells it ------------------------------------------------

    def mark(self) -> Mark:
        """Where the views and reservations stand: taken before a filter looks at anything."""
        return self._changes.version, self.reservations.version

    def refused(self, pod: Mapping[str, Any], demand: Demand, names: list[str], mark: Mark) -> None:
        """The filter that began at ``mark`` passed none of ``names`` for ``pod`` (of ``demand``).

        Remembered with what it is owed already (its last write, a node found for it); judged
        again on the nodes that gained room while the filter ran.
        """
        try:
            namespace, name, uid = pod_identity(pod)
        except WireError:
            return
        spec = pod.get("spec")
        scheduler = spec.get("schedulerName") if isinstance(spec, dict) else None
        if not uid or not name or (scheduler or "default-scheduler") not in self.scheduler_names:
            return
        nodes = self._node_set(names)
        recheck = self._changed_since(mark)
        weight = _ENTRY_BYTES + _NODE_BYTES * (len(nodes) if nodes is not None else 0)
        with self._lock:
            # Updated in place: a pass holding the entry keeps what it finds for the pod.
            entry = self._pods.get(uid)
            if entry is None:
                entry = Refused(uid, namespace, name, demand, nodes, self.clock(), recheck=recheck)
            else:
                entry.demand, entry.nodes, entry.refused = demand, nodes, self.clock()
                entry.recheck = _union(entry.recheck, recheck)
            self._pods.put(uid, entry, weight)
        if recheck is None or recheck:
            self._wake.set()

    def passed(self, uid: str) -> None:
        """``uid``'s filter passed a node, or it was bound or is gone: nothing is owed to it."""
        if uid and uid in self._pods:  # the common case, a pod never refused, without the lock
            with self._lock:
                self._pods.pop(uid)

    def viewed(self, node: str, view: NodeView) -> None:
        """The node cache applied ``view`` for ``node`` (its thread: cheap, never blocks)."""
        old = self._seen.get(node)
        if len(self._seen) >= _SEEN_LIMIT and old is None:
            self._seen.clear()  # what was seen before counts as unknown: more room, judged again
        self._seen[node] = view
        if room_grew(old, view, self.decider.now(), self.decider.max_state_age):
            with self._lock:
                self._grown.add(node)
                self._changes.add(node)
            self._wake.set()

    def _node_set(self, names: list[str]) -> frozenset[str] | None:
        if len(names) > NODES_KEPT:
            return ALL
        last_names, last_set = self._last
        if names is last_names:
            return last_set
        made = frozenset(names)
        self._last = (names, made)
        return made

    def _changed_since(self, mark: Mark) -> set[str] | None:
        """Nodes that gained room, or whose reservations changed, after ``mark`` (ALL: unknown)."""
        with self._lock:
            grown = self._changes.since(mark[0])
        if grown is None:
            return ALL
        if self.reservations.version != mark[1]:
            _, changed = self.reservations.changed_since(mark[1])
            if changed is None:
                return ALL
            grown |= changed
        return grown

    # -- the thread ---------------------------------------------------------------

    def start(self) -> Retrier:
        """Run passes in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="retrier", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the thread to end (it ends within one pass)."""
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(IDLE)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.run_once()
            except Exception:  # a pass that failed must not end the retries: the next one goes on
                log.exception("retry pass failed")
            self._stop.wait(PASS_GAP)

    def run_once(self) -> int:
        """One pass: forget old pods, judge the pods owed a look, write to those that fit now.

        Returns how many pods were written to.
        """
        now = self.clock()
        self._note_reservations()
        with self._lock:
            grown, self._grown = self._grown, set()
            entries = []
            for entry in self._pods.values():
                if now - entry.refused > FORGET_AFTER:
                    self._pods.pop(entry.uid)
                    continue
                entries.append(entry)
                if grown:
                    entry.recheck = _union(
                        entry.recheck, grown if entry.nodes is None else grown & entry.nodes
                    )
        if not entries:
            return 0
        self._judge(entries, now + PASS_BUDGET)
        return self._write(entries)

    def _note_reservations(self) -> None:
        """Nodes whose reservations and holds hold less than at the last pass gained room."""
        version, changed = self.reservations.changed_since(self._res_version)
        self._res_version = version
        if changed is None:
            changed = set(self._held) | self.reservations.nodes()
        held_on = self.reservations.held_on()
        grown = []
        for node in changed:
            now = held_on(node)
            if _held_less(self._held.get(node), now):
                grown.append(node)
            if now:
                self._held[node] = now
            else:
                self._held.pop(node, None)
        if grown:
            with self._lock:
                self._grown.update(grown)
                for node in grown:
                    self._changes.add(node)

    def _judge(self, entries: list[Refused], until: float) -> None:
        """Find a node with room for each entry owed a look, until the pass's time is up."""
        views = self.views()
        held_on = self.reservations.held_on()
        now = self.decider.now()
        fits: dict[tuple[Any, str], bool] = {}  # one verdict per shape and node in a pass
        for entry in entries:
            if self.clock() > until:
                return  # the rest keep what they are owed: the next pass goes on
            with self._lock:
                if entry.due or entry.recheck == set():
                    continue
                recheck, entry.recheck = entry.recheck, set()
            try:
                found = self._first_fit(entry, recheck, views, held_on, now, fits, until)
            except Abandoned:
                with self._lock:
                    entry.recheck = _union(entry.recheck, recheck)
                return
            if found:
                with self._lock:
                    entry.due = found

    def _first_fit(
        self,
        entry: Refused,
        recheck: set[str] | None,
        views: Mapping[str, NodeView],
        held_on: Callable[[str], Reserved | None],
        now: float,
        fits: dict[tuple[Any, str], bool],
        until: float,
    ) -> str:
        if recheck is None:
            # Every node it may go to, in bulk (cached verdicts are looked up in C).
            names = list(views) if entry.nodes is None else [n for n in entry.nodes if n in views]
            got = self.decider.admit_all(
                entry.demand,
                [views[n] for n in names],
                [held_on(n) for n in names],
                now,
                Deadline(max(0.0, until - self.clock())),
            )
            return next((n for n, verdict in zip(names, got, strict=True) if verdict.fits), "")
        for node in sorted(recheck):
            if not entry.wants(node):
                continue
            key = (entry.demand.key, node)
            fit = fits.get(key)
            if fit is None:
                view = views.get(node)
                fit = fits[key] = self.decider.admit(entry.demand, view, now, held_on(node)).fits
            if fit:
                return node
        return ""

    # -- writes -------------------------------------------------------------------

    def _write(self, entries: list[Refused]) -> int:
        """Write to the pods found room for, oldest refusal first, within the write budget."""
        now = self.clock()
        self._tokens = min(WRITES_PER_SECOND, self._tokens + (now - self._refilled) * WRITES_PER_SECOND)
        self._refilled = now
        due = sorted((e for e in entries if e.due and now - e.nudged >= NUDGE_EVERY), key=lambda e: e.refused)
        written = 0
        for entry in due:
            if self._tokens < 1:
                break  # the rest stay due: the next passes write them
            self._tokens -= 1
            outcome = self._nudge(entry)
            self.outcomes[outcome] += 1
            if outcome == "retried":
                written += 1
        return written

    def _nudge(self, entry: Refused) -> str:
        """Make kube-scheduler retry ``entry``'s pod if it is still the pod refused and fits its node."""
        from rdma_cni.kube import client as kubeapi

        node = entry.due
        path = f"/api/v1/namespaces/{entry.namespace}/pods/{entry.name}"
        try:
            pod = self.client.get(path)
        except kubeapi.NotFound:
            return self._done(entry, "gone")
        except kubeapi.ApiError as exc:
            log.warning("cannot read pod %s/%s to retry it: %s", entry.namespace, entry.name, exc)
            return self._later(entry, "failed")
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        if meta.get("uid") != entry.uid or meta.get("deletionTimestamp"):
            return self._done(entry, "gone")
        if spec.get("nodeName"):
            return self._done(entry, "bound")
        phase = (pod.get("status") or {}).get("phase")
        if spec.get("schedulerName") not in self.scheduler_names or phase not in (None, "Pending"):
            return self._done(entry, "gone")
        # Judged again from the pod as stored and the node as watched: nothing the refused request
        # said decides a write.
        try:
            demand = self.demands.of_pod(pod)
        except (InvalidPodRequest, WireError, ValueError):
            demand = None
        if demand is None:
            return self._done(entry, "gone")
        view = self.views().get(node)
        if not self.decider.admit(demand, view, self.decider.now(), self.reservations.held_on()(node)).fits:
            with self._lock:
                entry.due = ""
            return "no_room"
        body = {
            "metadata": {"uid": entry.uid, "resourceVersion": meta.get("resourceVersion")},
            "status": {"conditions": [condition(node, datetime.now(UTC))]},
        }
        try:
            self.client.patch_strategic(f"{path}/status", body)
        except kubeapi.Conflict:
            # The pod changed after it was read: kube-scheduler retries it for that update already.
            return self._later(entry, "changed", keep=False)
        except (kubeapi.NotFound, kubeapi.Invalid):
            return self._done(entry, "gone")
        except kubeapi.ApiError as exc:
            log.warning("cannot retry pod %s/%s: %s", entry.namespace, entry.name, exc)
            return self._later(entry, "failed")
        log.info("retrying pod %s/%s: node %s has room for it now", entry.namespace, entry.name, node)
        return self._later(entry, "retried", keep=False)

    def _done(self, entry: Refused, outcome: str) -> str:
        self.passed(entry.uid)
        return outcome

    def _later(self, entry: Refused, outcome: str, *, keep: bool = True) -> str:
        """Written (or tried): not again for NUDGE_EVERY; ``keep`` leaves the node due for then."""
        with self._lock:
            entry.nudged = self.clock()
            if not keep:
                entry.due = ""
        return outcome


def condition(node: str, when: datetime) -> dict[str, str]:
    """The pod condition that makes kube-scheduler retry the pod: the node that has room, and when.

    The time changes at every write (at most one per :data:`NUDGE_EVERY` seconds per pod), so each
    write is an update of the pod (a write that changed nothing would be no event).
    """
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "type": CONDITION,
        "status": "True",
        "reason": "NodeHasRoom",
        "message": (
            f"rdma-cni refused this pod for want of room; node {node} has room for it now: "
            "kube-scheduler retries it"
        ),
        "lastProbeTime": stamp,
        "lastTransitionTime": stamp,
    }


def _union(a: set[str] | None, b: set[str] | None) -> set[str] | None:
    """Two sets of nodes to judge again (ALL absorbs); more than NODES_KEPT become ALL."""
    if a is None or b is None:
        return ALL
    if not b:
        return a
    out = a | b
    return ALL if len(out) > NODES_KEPT else out

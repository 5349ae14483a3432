"""Reservations: what the extender has bound to a node that the node has not published yet.

Between the Binding and the node agent's next publication, the node's
annotation does not count the pod: without a reservation the next pod's
filter and bind would see its VFs and bandwidth as free. A reservation holds
the pod's per-PF consumption (as placement chose it at bind time) and ends
when the node's published allocations include the pod's uid, when the pod is
gone, or after a TTL (a node that never publishes must not hold capacity
forever). A restarted extender rebuilds them from the API before it reports
ready: pods bound to a node whose published allocations do not list them.

Holds are the tentative kind: what the extender told kube-scheduler is a pod's
best node (the only node its filter passed, or the one its prioritize scored
highest), held from that answer until the pod's bind arrives. kube-scheduler
starts the next pod's scheduling cycle before the previous pod's binding
cycle reaches bind, so without the hold the next pod is judged on a node that
looks emptier than it is about to be, and binpack sends it to the same node,
where its bind is then refused. A hold counts in filter and prioritize of
every other pod, like a reservation; bind never counts holds (it decides on
reservations alone, so a hold can only make filters more conservative, never
let a node be over-committed). A hold ends when the pod's bind arrives (its
reservation, on whatever node kube-scheduler chose, replaces it), when the
pod's next filter starts (a retried pod never meets its own hold), when the
pod is gone, or after :data:`HOLD_TTL` seconds; at most :data:`HOLDS_MAX` are held (the
oldest gives way).

What a node holds, reservations and holds together, is kept per node (a
:class:`Reserved`: per PF sums and the pods' uids, rebuilt by each change of
the node): filter looks it up for every node it judges, pod after pod, hands
it to the per-node rules (rules.py), and decisions on the node's state with
it applied are cached by its identity (decide.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["HOLDS_MAX", "HOLD_TTL", "Reservation", "Reservations", "Reserved"]

log = logging.getLogger("rdma_cni.extender.reservations")

Use = tuple[tuple[str, int, int], ...]
# Nodes whose last change is remembered; a cluster's node count is far below it.
_TOUCHED_LIMIT = 100_000  # changes remembered
# Seconds a hold lasts without its bind: the bind comes once the pod's scheduling cycle ends, well under
# a second after the answer unless the control plane is overloaded; a pod that kube-scheduler gave up
# on after the answer must not keep capacity from others for long.
HOLD_TTL = 10.0
# Holds at once: one per pod between its answer and its bind, so a few per scheduling cycle in flight.
HOLDS_MAX = 1024


class Reserved(Mapping[str, tuple[int, int]]):
    """What one node holds beyond its published state: per PF (VFs, min rate sum), and which pods.

    The object per-node rules receive (:mod:`rdma_cni.extender.rules`) and
    the fit applies to the node's PF states. ``pods`` are the uids of the pods
    whose reservations or holds these are; ``gone`` the uids of published pods
    counted as gone (preemption's victims, whose use the sums give back). Never
    changed once built. ``kept`` marks a node's own current one (what filter
    looks up, :meth:`Reservations.held_on`): decisions on the node's state
    with it applied are cached by its identity (decide.py); bind's and
    preempt's one-offs are not kept. As a mapping it compares by its sums
    alone, pods aside.
    """

    __slots__ = ("_by_pf", "gone", "kept", "pods")

    def __init__(
        self,
        by_pf: dict[str, tuple[int, int]],
        pods: frozenset[str] = frozenset(),
        *,
        gone: frozenset[str] = frozenset(),
        kept: bool = False,
    ) -> None:
        self._by_pf = by_pf
        self.pods = pods
        self.gone = gone
        self.kept = kept

    def __getitem__(self, pf: str) -> tuple[int, int]:
        return self._by_pf[pf]

    def get(self, pf: str, default: Any = None) -> Any:
        """The PF's (VFs, min rate sum), or ``default`` when nothing is reserved on it."""
        return self._by_pf.get(pf, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_pf)

    def __len__(self) -> int:
        return len(self._by_pf)

    def __repr__(self) -> str:
        return f"Reserved({self._by_pf!r}, pods={sorted(self.pods)!r}, gone={sorted(self.gone)!r})"

    def releasing(self, freed: Mapping[str, tuple[int, int]], gone: Collection[str]) -> Reserved:
        """This, with the published pods ``gone`` counted as gone and what they hold (``freed``: per PF,
        VFs and min rate sum) given back: what preemption judges a node with its victims evicted on."""
        by_pf = dict(self._by_pf)
        for pf, (vfs, rate) in freed.items():
            have = by_pf.get(pf, (0, 0))
            by_pf[pf] = (have[0] - vfs, have[1] - rate)
        gone = frozenset(gone)
        return Reserved(by_pf, self.pods - gone, gone=self.gone | gone)


_NOTHING = Reserved({})


@dataclass(frozen=True)
class Reservation:
    """Pod ``uid`` bound to ``node``, holding ``use`` ((PF, VFs, min rate sum) per PF) until ``expires``."""

    uid: str
    namespace: str
    name: str
    node: str
    use: Use
    expires: float
    # False while the Binding's outcome is unknown (no answer, a 5xx): kept until the pod is read back.
    confirmed: bool = True
    # The pod's spec.schedulerName: the pod watch of that name (podwatch.py), if one runs, sees it go.
    scheduler: str = ""
    # When it was made (the reservations' clock): a pod watch's relist ends only older ones.
    made: float = 0.0
    # A hold's: the node view its use was placed on (bind reuses the use while the view is the same).
    basis: object = dataclasses.field(default=None, compare=False, repr=False)


class Reservations:
    """Reservations by pod uid, with per-node lookup. Thread-safe."""

    def __init__(
        self,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        hold_ttl: float = HOLD_TTL,
        holds_max: int = HOLDS_MAX,
    ) -> None:
        if ttl <= 0 or hold_ttl <= 0:
            raise ValueError("reservation TTL must be positive")
        self.ttl = ttl
        self.hold_ttl = hold_ttl
        self.holds_max = holds_max
        self._clock = clock
        self._lock = threading.Lock()
        self._by_uid: dict[str, Reservation] = {}
        self._by_node: dict[str, dict[str, Reservation]] = {}
        # Holds by uid, oldest first (insertion order: every hold lasts hold_ttl), and per node.
        self._holds: dict[str, Reservation] = {}
        self._holds_by_node: dict[str, dict[str, Reservation]] = {}
        # Bumped by every change; _touched[i] is the node of change _forgotten + i + 1,
        # so cached filter answers re-judge only those nodes (see answers.py).
        self.version = 0
        self._forgotten = 0
        self._touched: list[str] = []
        # Per node holding anything: what it holds, reservations and holds together (extra() with
        # holds and no pod left out), rebuilt by every change of the node: filter's per-node lookup.
        self._reserved: dict[str, Reserved] = {}

    def __len__(self) -> int:
        return len(self._by_uid)

    def add(
        self, uid: str, namespace: str, name: str, node: str, use: Use, *, scheduler: str = ""
    ) -> Reservation:
        """Record (or replace) the reservation of pod ``uid`` (of ``scheduler``) on ``node``; it replaces
        the pod's hold."""
        now = self._clock()
        res = Reservation(uid, namespace, name, node, use, now + self.ttl, scheduler=scheduler, made=now)
        with self._lock:
            self._remove(uid)
            self._unhold(uid)
            self._by_uid[uid] = res
            self._by_node.setdefault(node, {})[uid] = res
            self._touch(node)
        return res

    def hold(
        self, uid: str, namespace: str, name: str, node: str, use: Use, basis: object = None
    ) -> Reservation | None:
        """Hold ``use`` on ``node`` for pod ``uid`` until its bind (see the module docstring).

        None when the pod already has a reservation (it is bound: nothing to hold) or holds nothing.
        """
        if not uid or not use or self.holds_max <= 0:
            return None
        now = self._clock()
        res = Reservation(uid, namespace, name, node, use, now + self.hold_ttl, made=now, basis=basis)
        with self._lock:
            if uid in self._by_uid:
                return None
            self._unhold(uid)
            while len(self._holds) >= self.holds_max:
                self._unhold(next(iter(self._holds)))
            self._holds[uid] = res
            self._holds_by_node.setdefault(node, {})[uid] = res
            self._touch(node)
        return res

    def release(self, uid: str) -> Reservation | None:
        """End pod ``uid``'s hold, if any (its next filter started, its bind arrived, or it is gone)."""
        if uid not in self._holds:  # the common case, without the lock
            return None
        with self._lock:
            return self._unhold(uid)

    def held(self, uid: str) -> Reservation | None:
        """Pod ``uid``'s hold, if any."""
        return self._holds.get(uid)

    def holds(self) -> int:
        """How many holds there are."""
        return len(self._holds)

    def _unhold(self, uid: str) -> Reservation | None:
        res = self._holds.pop(uid, None)
        if res is not None:
            on_node = self._holds_by_node.get(res.node)
            if on_node is not None:
                on_node.pop(uid, None)
                if not on_node:
                    del self._holds_by_node[res.node]
            self._touch(res.node)
        return res

    def _touch(self, node: str) -> None:
        # Called under the lock after every change of the node's reservations or holds.
        reserved = self._sum(node, (), holds=True, kept=True)
        if reserved.pods:
            self._reserved[node] = reserved
        else:
            self._reserved.pop(node, None)
        if len(self._touched) >= _TOUCHED_LIMIT:
            # Forget the history: older versions then see "unknown changes" and re-judge all.
            self._touched.clear()
            self._forgotten = self.version
        self.version += 1
        self._touched.append(node)

    def changed_since(self, version: int) -> tuple[int, set[str] | None]:
        """(current version, nodes whose reservations changed after ``version``; None: unknown, all)."""
        with self._lock:
            if version == self.version:
                return version, set()
            if version < self._forgotten:
                return self.version, None
            # Only the changes since: no scan of every node ever reserved.
            return self.version, set(self._touched[version - self._forgotten :])

    def _remove(self, uid: str) -> Reservation | None:
        res = self._by_uid.pop(uid, None)
        if res is not None:
            on_node = self._by_node.get(res.node)
            if on_node is not None:
                on_node.pop(uid, None)
                if not on_node:
                    del self._by_node[res.node]
            self._touch(res.node)
        return res

    def drop(self, uid: str, why: str) -> Reservation | None:
        """End a reservation; returns it (None when there was none)."""
        with self._lock:
            res = self._remove(uid)
        if res is not None:
            log.info("reservation of %s/%s (%s) on %s ends: %s", res.namespace, res.name, uid, res.node, why)
        return res

    def unconfirm(self, uid: str) -> None:
        """The Binding of pod ``uid`` may or may not have been applied: keep it until the pod is read back."""
        self._set_confirmed(uid, False)

    def confirm(self, uid: str) -> None:
        """The pod was read back bound to its reservation's node."""
        self._set_confirmed(uid, True)

    def _set_confirmed(self, uid: str, confirmed: bool) -> None:
        with self._lock:
            res = self._by_uid.get(uid)
            if res is not None and res.confirmed != confirmed:
                res = dataclasses.replace(res, confirmed=confirmed)
                self._by_uid[uid] = res
                self._by_node[res.node][uid] = res

    def drop_exact(self, res: Reservation, why: str) -> bool:
        """End ``res`` only if it is still the pod's reservation (not one a later bind made)."""
        with self._lock:
            if self._by_uid.get(res.uid) is not res:
                return False
            self._remove(res.uid)
        log.info("reservation of %s/%s (%s) on %s ends: %s", res.namespace, res.name, res.uid, res.node, why)
        return True

    def get(self, uid: str) -> Reservation | None:
        """The reservation of pod ``uid``, if any."""
        return self._by_uid.get(uid)

    def all(self) -> list[Reservation]:
        """Every reservation, in no particular order."""
        with self._lock:
            return list(self._by_uid.values())

    def has_node(self, node: str) -> bool:
        """Whether any reservation or hold is on ``node``."""
        return node in self._reserved

    def nodes(self) -> frozenset[str]:
        """The nodes holding reservations or holds now."""
        with self._lock:
            return frozenset(self._reserved)

    def held_on(self) -> Callable[[str], Reserved | None]:
        """Filter's per-node lookup: what a node holds (reservations and holds), None when nothing.

        Each node's entry is replaced whole by a change, so a lookup never sees one half made
        (a filter judging many nodes may see some before a change and some after, as it would
        with a lock taken per node).
        """
        return self._reserved.get

    def extra(self, node: str, without: Iterable[str] = (), *, holds: bool = True) -> Reserved:
        """What ``node`` holds: its reservations, and its holds unless ``holds`` is False (bind), leaving
        out the pods ``without``: the node's kept :class:`Reserved` when that is all it holds, else a
        one-off (bind's, preempt's), which decisions do not keep."""
        with self._lock:
            if holds and not without:
                return self._reserved.get(node) or _NOTHING
            return self._sum(node, frozenset(without), holds=holds)

    def _sum(self, node: str, skip: Collection[str], *, holds: bool, kept: bool = False) -> Reserved:
        # Called under the lock.
        by_pf: dict[str, tuple[int, int]] = {}
        pods: set[str] = set()
        tables = [self._by_node.get(node) or {}]
        if holds:
            tables.append(self._holds_by_node.get(node) or {})
        for table in tables:
            for uid, res in table.items():
                if uid in skip:
                    continue
                pods.add(uid)
                for pf, vfs, rate in res.use:
                    have = by_pf.get(pf, (0, 0))
                    by_pf[pf] = (have[0] + vfs, have[1] + rate)
        return Reserved(by_pf, frozenset(pods), kept=kept)

    def now(self) -> float:
        """The reservations' clock (what ``made`` is measured on)."""
        return self._clock()

    def observe(self, node: str, published: frozenset[str]) -> None:
        """The node published allocations for the pods ``published``: their reservations end."""
        if node not in self._by_node:
            return
        with self._lock:
            done = [uid for uid in self._by_node.get(node, {}) if uid in published]
        for uid in done:
            self.drop(uid, "the node published it")

    def expire(self) -> list[Reservation]:
        """End the reservations whose TTL has passed (returns them), and the holds whose TTL has."""
        now = self._clock()
        with self._lock:
            # Oldest first too: every reservation lasts ttl from when add() (re)inserted it, and
            # confirming one keeps its place, so the first still in time ends the scan (bind calls
            # this for every pod: a scan of all of them grew with the reservations held).
            old = []
            for res in self._by_uid.values():
                if res.expires > now:
                    break
                old.append(res)
            # Oldest first: the first hold still in time ends the sweep.
            while self._holds:
                uid, res = next(iter(self._holds.items()))
                if res.expires > now:
                    break
                self._unhold(uid)
        for res in old:
            self.drop(res.uid, f"TTL of {self.ttl:.0f} s passed without the node publishing it")
        return old

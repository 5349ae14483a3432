"""NodePrepareResources and NodeUnprepareResources: a claim's allocation proven against the node.

kubelet names a claim (namespace, name, uid) and nothing else; everything
comes from the API server, where only kube-scheduler writes a claim's
status. For each claim:

1. The claim is read (``resource.k8s.io/v1``); its uid must be the one kubelet
   named. Its allocation's results of this driver each name this node's pool
   and one of this node's DRA devices (a network and PF of the agent's
   configuration); each is a share (``shareID``) of a device that many claims
   share, and consumed one VF and some ``bandwidth``: that amount, from the
   allocation, is the VF's ``min_tx_rate`` (never a number the pod wrote).
   The claim is reserved for exactly one pod: its VFs go to that pod.
2. The opaque configuration of this driver, the class's then the claim's, is
   validated as the annotation is (:func:`rdma_cni.shared.dra.claims.configs_of`,
   code 101 naming the field): its ``max_tx_rate`` must be 0 or at least the
   allocated bandwidth, and at most the PF's capacity.
3. Under the network's node lock, the node is read as ADD reads it (records,
   the other claims' preparations, the kernel): every allocated PF must exist
   with enough free VFs (proven home) and enough unreserved bandwidth for
   this claim's interfaces on it. Then the lowest free VFs of each PF are
   chosen and recorded as the claim's preparation (node/prepared), the one
   write, made last: a claim that fails leaves the node as it was.

Preparing a claim already prepared returns what was prepared when the
allocation is the same (kubelet prepares again after a restart), and
prepares it afresh otherwise (the preparation of an allocation that no longer
exists, whose unprepare never came). When the API server cannot be reached,
an existing preparation is returned as it is: it was proven when made.
Unprepare removes the claim's preparations; a VF still attached to the pod
stays held by its attachment record until DEL, so nothing is freed early.

Calls are serialised (one claim at a time): each is a few milliseconds under
the node lock, and kubelet gives a call 45 s.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rdma_cni.agent.snapshot import LOCK_TIMEOUT, NetworkView
from rdma_cni.shared.dra import BANDWIDTH, DRIVER, RESOURCE_API, VFS
from rdma_cni.shared.dra.claims import configs_of
from rdma_cni.shared.dra.slices import device_name
from rdma_cni.shared.errors import CniError
from rdma_cni.shared.podrequest import MAX_INTERFACES
from rdma_cni.shared.quantity import whole
from rdma_cni.shared.quote import quote

if TYPE_CHECKING:
    from rdma_cni.kube.client import ApiClient
    from rdma_cni.node.prepared import Preparation

log = logging.getLogger("rdma_cni.agent")

__all__ = ["ClaimRef", "PrepareError", "Prepared", "PreparedDevice", "Preparer"]


class PrepareError(Exception):
    """A claim this node cannot prepare; the message is the reason kubelet shows."""


@dataclass(frozen=True)
class ClaimRef:
    """A claim as kubelet names it."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device of the claim, as kubelet's answer lists it."""

    requests: tuple[str, ...]
    pool: str
    device: str
    share_id: str


@dataclass
class Prepared:
    """The outcome for one claim: its devices, or an error (then nothing was prepared)."""

    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True)
class _Planned:
    """One allocation result, read and checked, before the node is."""

    request: str
    view: NetworkView
    pf: str
    device: str
    pool: str
    share_id: str
    min_tx_rate: int
    max_tx_rate: int
    name: str | None


def _get(obj: Any, *keys: str) -> Any:
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


class Preparer:
    """Prepares and unprepares claims for the node's DRA networks (``views``)."""

    def __init__(self, views: Sequence[NetworkView], node: str, client: Callable[[], ApiClient]) -> None:
        self.views = [v for v in views if v.dra]
        self.node = node
        self.client = client
        self.lock = threading.Lock()
        # Device name -> (network, PF): from the configuration, so a PF whose VFs are gone now is
        # still recognised as ours and refused for what it lacks, not as a stranger.
        self.devices: dict[str, tuple[NetworkView, str]] = {
            device_name(v.name, pf): (v, pf) for v in self.views for pf in (v.pfs or ())
        }
        self.prepared = 0
        self.refused = 0

    # -- the two calls

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared]:
        """Prepare each claim; one's failure is its own error, the others go on."""
        out: dict[str, Prepared] = {}
        with self.lock:
            for ref in claims:
                try:
                    out[ref.uid] = Prepared(self._prepare(ref))
                    self.prepared += 1
                except (PrepareError, CniError, OSError) as exc:
                    reason = _reason(exc)
                    self.refused += 1
                    log.warning("DRA: claim %s (uid %s) not prepared: %s", ref, ref.uid, reason)
                    out[ref.uid] = Prepared(error=f"rdma-cni: claim {ref}: {reason}")
        return out

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Drop each claim's preparation (none is fine); an error text per claim, empty on success."""
        from rdma_cni.node.prepared import PreparedStore, valid_uid
        from rdma_cni.node.record import node_lock

        out: dict[str, str] = {}
        with self.lock:
            for ref in claims:
                try:
                    if not valid_uid(ref.uid):
                        raise PrepareError(f"{quote(ref.uid)} is not a claim uid")
                    dropped = False
                    for view in self.views:
                        with node_lock(view.lock_file, LOCK_TIMEOUT):
                            dropped = PreparedStore(view.state_dir).delete(ref.uid) or dropped
                    if dropped:
                        log.info("DRA: claim %s (uid %s) unprepared", ref, ref.uid)
                    out[ref.uid] = ""
                except (PrepareError, CniError, OSError) as exc:
                    out[ref.uid] = f"rdma-cni: claim {ref}: {_reason(exc)}"
        return out

    # -- preparing one claim

    def _existing(self, uid: str) -> dict[str, Preparation]:
        from rdma_cni.node.prepared import PreparedStore

        found = {}
        for state_dir in sorted({v.state_dir for v in self.views}):
            prep = PreparedStore(state_dir).get(uid)
            if prep is not None:
                found[state_dir] = prep
        return found

    def _prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        from rdma_cni.kube import client as kubeapi
        from rdma_cni.node.prepared import valid_uid

        if not valid_uid(ref.uid):
            raise PrepareError(f"{quote(ref.uid)} is not a claim uid")
        existing = self._existing(ref.uid)
        path = (
            f"/apis/{RESOURCE_API}/namespaces/{urllib.parse.quote(ref.namespace, safe='')}"
            f"/resourceclaims/{urllib.parse.quote(ref.name, safe='')}"
        )
        try:
            claim = self.client().get(path)
        except kubeapi.ApiError as exc:
            if existing:
                log.warning("DRA: claim %s: cannot read it (%s); answering with its preparation", ref, exc)
                return _answer([v for p in existing.values() for v in p.vfs])
            raise PrepareError(f"cannot read the claim from the API server: {exc}") from None
        uid = _get(claim, "metadata", "uid")
        if uid != ref.uid:
            raise PrepareError(
                f"the API server's claim {ref} has uid {quote(uid)}, not {ref.uid}: it was replaced"
            )
        plan, pod = self._plan(claim, ref)
        held = [v for p in existing.values() for v in p.vfs]
        if existing and _same(held, plan):
            log.info("DRA: claim %s already prepared", ref)
            return _answer(held)
        self._commit(ref, plan, pod, existing)
        return [PreparedDevice((p.request,), p.pool, p.device, p.share_id) for p in plan]

    def _plan(self, claim: dict[str, Any], ref: ClaimRef) -> tuple[list[_Planned], tuple[str, str]]:
        """The claim's results of this driver, checked against the API's facts; and its one pod."""
        requests = [
            r.get("name") for r in (_get(claim, "spec", "devices", "requests") or []) if isinstance(r, dict)
        ]
        allocation = _get(claim, "status", "allocation")
        if not isinstance(allocation, dict):
            raise PrepareError("it is not allocated")
        results = [
            r
            for r in (_get(allocation, "devices", "results") or [])
            if isinstance(r, dict) and r.get("driver") == DRIVER
        ]
        if len(results) > MAX_INTERFACES:
            raise PrepareError(
                f"{len(results)} devices of {DRIVER} allocated; a pod may have at most {MAX_INTERFACES}"
            )
        pods = [
            c
            for c in (_get(claim, "status", "reservedFor") or [])
            if isinstance(c, dict) and c.get("resource") == "pods" and not c.get("apiGroup")
        ]
        if len(pods) != 1:
            raise PrepareError(
                f"it is reserved for {len(pods)} pods; its VFs go to one pod: give each pod a claim "
                "of its own "
                "(a ResourceClaimTemplate)"
            )
        pod = (str(pods[0].get("name", "")), str(pods[0].get("uid", "")))
        names = [r for r in requests if isinstance(r, str)]
        configs = configs_of(_get(allocation, "devices", "config"), names, "its configuration")
        plan = []
        for i, result in enumerate(results):
            where = f"result {i} (request {quote(result.get('request'))})"
            request = result.get("request")
            base = request.split("/", 1)[0] if isinstance(request, str) else None
            if base not in names:
                raise PrepareError(f"{where}: names no request of the claim")
            if result.get("pool") != self.node:
                raise PrepareError(
                    f"{where}: allocated in pool {quote(result.get('pool'))}, not this node's ({self.node})"
                )
            mine = self.devices.get(result.get("device"))  # type: ignore[arg-type]
            if mine is None:
                raise PrepareError(
                    f"{where}: device {quote(result.get('device'))} is none of this node's DRA devices "
                    "(a network and PF of the agent's configuration)"
                )
            if result.get("adminAccess"):
                raise PrepareError(f"{where}: admin access to a VF is not supported")
            share = result.get("shareID")
            if not isinstance(share, str) or not share:
                raise PrepareError(
                    f"{where}: device allocated whole, not as a share: DRAConsumableCapacity must be on in "
                    "kube-apiserver and kube-scheduler (it is by default since Kubernetes 1.36)"
                )
            consumed = result.get("consumedCapacity") or {}
            if not isinstance(consumed, dict):
                raise PrepareError(f"{where}: consumedCapacity is not an object")
            if VFS in consumed and whole(consumed[VFS]) != 1:
                raise PrepareError(f"{where}: consumed {quote(consumed[VFS])} VFs, not 1")
            rate = whole(consumed.get(BANDWIDTH, 0))
            if rate is None:
                raise PrepareError(
                    f"{where}: consumed bandwidth {quote(consumed.get(BANDWIDTH))} is no whole Mbit/s"
                )
            config = configs.get(base)
            cap = config.max_tx_rate if config else 0
            if cap and cap < rate:
                raise PrepareError(
                    f"{where}: its configuration's max_tx_rate {cap} is below the bandwidth allocated "
                    f"to it ({rate} "
                    "Mbit/s): set 0 (no cap) or at least that"
                )
            view, pf = mine
            plan.append(
                _Planned(
                    request=str(request),
                    view=view,
                    pf=pf,
                    device=str(result.get("device")),
                    pool=self.node,
                    share_id=share,
                    min_tx_rate=rate,
                    max_tx_rate=cap,
                    name=config.name if config else None,
                )
            )
        plan.sort(key=lambda p: names.index(p.request.split("/", 1)[0]))
        return plan, pod

    def _commit(
        self, ref: ClaimRef, plan: list[_Planned], pod: tuple[str, str], existing: dict[str, Preparation]
    ) -> None:
        """Prove the plan on the node under the networks' locks, choose VFs, write the preparations."""
        from rdma_cni.kernel.identity import VfFinder
        from rdma_cni.kernel.netlink import Rtnl
        from rdma_cni.kernel.vfcontrol import vf_control
        from rdma_cni.node.inventory import scan
        from rdma_cni.node.prepared import Preparation, PreparedStore, PreparedVf
        from rdma_cni.node.record import RecordStore

        by_dir: dict[str, list[_Planned]] = {}
        for p in plan:
            by_dir.setdefault(p.view.state_dir, []).append(p)
        chosen: dict[str, Preparation] = {}
        with self._locks([p.view for p in plan]), Rtnl() as host:
            vfctl = vf_control(host)
            finder = VfFinder(host)
            for state_dir, planned in by_dir.items():
                store = RecordStore(state_dir)
                unreadable: list[str] = []
                records = store.all(unreadable)
                others = [p.holding() for p in PreparedStore(state_dir).all() if p.claim_uid != ref.uid]
                prep = Preparation(ref.namespace, ref.name, ref.uid, pod[0], pod[1])
                for view in {id(p.view): p.view for p in planned}.values():
                    mine = [p for p in planned if p.view is view]
                    node = scan(
                        pfs=sorted({p.pf for p in mine}),
                        capacity=view.capacity,
                        attachments=records + others,
                        vfctl=vfctl,
                        home=finder.in_host,
                    )
                    for pf_name in sorted({p.pf for p in mine}):
                        on_pf = [p for p in mine if p.pf == pf_name]
                        picked = _prove(node.pf(pf_name), pf_name, on_pf, view)
                        for p, vf in zip(on_pf, picked, strict=True):
                            prep.vfs.append(
                                PreparedVf(
                                    request=p.request,
                                    network=view.name,
                                    pf=pf_name,
                                    device=p.device,
                                    pool=p.pool,
                                    share_id=p.share_id,
                                    vf=vf.index,
                                    pci=vf.pci,
                                    min_tx_rate=p.min_tx_rate,
                                    max_tx_rate=p.max_tx_rate,
                                    name=p.name,
                                )
                            )
                order = [p.request for p in plan]
                prep.vfs.sort(key=lambda v: order.index(v.request))
                chosen[state_dir] = prep
            written: list[str] = []
            try:
                for state_dir, prep in chosen.items():
                    PreparedStore(state_dir).write(prep)
                    written.append(state_dir)
                for state_dir in existing:
                    if state_dir not in chosen:  # the old allocation held VFs where the new one holds none
                        PreparedStore(state_dir).delete(ref.uid)
            except BaseException:
                for state_dir in written:  # as it was: the old preparation back, or none
                    with contextlib.suppress(CniError, OSError):
                        if state_dir in existing:
                            PreparedStore(state_dir).write(existing[state_dir])
                        else:
                            PreparedStore(state_dir).delete(ref.uid)
                raise
        log.info(
            "DRA: claim %s (uid %s) prepared for pod %s: %s",
            ref,
            ref.uid,
            pod[0],
            ", ".join(
                f"{v.request} -> {v.pf}/VF {v.vf} at {v.min_tx_rate}-{v.max_tx_rate or '-'} Mbit/s"
                for p in chosen.values()
                for v in p.vfs
            ),
        )

    @contextlib.contextmanager
    def _locks(self, views: list[NetworkView]) -> Iterator[None]:
        from rdma_cni.node.record import node_lock

        with contextlib.ExitStack() as stack:
            for lock_file in sorted({v.lock_file for v in views}):  # one order: no two holders deadlock
                stack.enter_context(node_lock(lock_file, LOCK_TIMEOUT))
            yield


def _prove(pf: Any, name: str, planned: list[_Planned], view: NetworkView) -> list[Any]:
    """The VFs ``planned`` get on PF ``pf``, proven to have room for them all; PrepareError saying why not."""
    changed = "the node changed since the allocation"
    if pf is None:
        raise PrepareError(
            f"PF {name} of network {view.name} has no VFs enabled on this node now ({changed})"
        )
    free = [v for v in pf.vfs if v.available(view.isolation)]
    if len(free) < len(planned):
        raise PrepareError(
            f"PF {name} has {len(free)} free VF(s) for this claim's {len(planned)} ({changed}, or "
            "another claim's "
            "VFs were not released yet): nothing prepared"
        )
    wanted = sum(p.min_tx_rate for p in planned)
    capacity = pf.capacity_mbps
    if wanted and capacity is None:
        raise PrepareError(
            f"PF {name}'s capacity is unknown now (link speed), so it has no bandwidth to guarantee "
            f"{wanted} Mbit/s "
            f"({changed}): nothing prepared"
        )
    if capacity is not None:
        room = max(0, capacity - pf.reserved_mbps)
        if wanted > room:
            raise PrepareError(
                f"PF {name} has {room} of {capacity} Mbit/s unreserved, this claim was allocated "
                f"{wanted} there "
                f"({changed}): nothing prepared"
            )
        for p in planned:
            if p.max_tx_rate > capacity:
                raise PrepareError(
                    f"request {p.request}: max_tx_rate {p.max_tx_rate} is above PF {name}'s capacity "
                    f"({capacity} "
                    "Mbit/s)"
                )
    return free[: len(planned)]


def _same(held: list[Any], plan: list[_Planned]) -> bool:
    """Whether an existing preparation is of this very allocation."""
    key = sorted((v.request, v.device, v.share_id, v.min_tx_rate, v.max_tx_rate, v.name) for v in held)
    return key == sorted(
        (p.request, p.device, p.share_id, p.min_tx_rate, p.max_tx_rate, p.name) for p in plan
    )


def _answer(held: list[Any]) -> list[PreparedDevice]:
    return [PreparedDevice((v.request,), v.pool, v.device, v.share_id) for v in held]


def _reason(exc: BaseException) -> str:
    if isinstance(exc, CniError):  # the code a CNI verb would answer (101: the claim's configuration)
        return f"{exc.msg} (code {exc.code}" + (f": {exc.details})" if exc.details else ")")
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}"
    return str(exc)

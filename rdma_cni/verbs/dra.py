"""ADD on a DRA network: the pod's prepared VFs instead of placement, at the allocated rates.

A network whose configuration says ``"dra": true`` hands out its PFs' VFs only
through DRA claims (docs/dra.md). kubelet prepared the pod's claims before
creating its sandbox: the node agent proved each allocation against the node
and recorded the VFs it chose (:mod:`rdma_cni.node.prepared`). ADD then
takes exactly those VFs, in the claims' request order, with the
``min_tx_rate`` the allocation consumed (the API server's number, recorded at
prepare) and the cap and name of the claim's validated configuration; it
never reads a rate the pod wrote. Everything after the choice (the intent
record, the steps, the rollback, DEL) is ADD's own, unchanged.

The pod is found by the runtime's ``K8S_POD_UID`` (else its namespace and
name): a claim's preparation names the one pod it was reserved for.
"""

from __future__ import annotations

import logging

from rdma_cni.cni.config import NetConf
from rdma_cni.cni.errors import InvalidPodRequest, NoCapacity, StateError
from rdma_cni.cni.protocol import CniEnv
from rdma_cni.kernel.identity import VfFinder
from rdma_cni.node.inventory import Node, Vf
from rdma_cni.node.prepared import Preparation, PreparedStore, PreparedVf
from rdma_cni.node.record import RecordStore
from rdma_cni.shared.podrequest import InterfaceRequest, PodRequest

log = logging.getLogger("rdma_cni.add")

__all__ = ["prepared_request", "take"]


def _mine(env: CniEnv, conf: NetConf) -> tuple[str, list[tuple[Preparation, PreparedVf]]]:
    """Who the pod is (for messages) and its prepared VFs on this network, in claim and request order."""
    pod = env.pod
    if pod is None:
        raise InvalidPodRequest(
            f'network {conf.name} is a DRA network ("dra": true): ADD needs the pod (K8S_POD_NAMESPACE and '
            "K8S_POD_NAME in CNI_ARGS) to find its prepared claims"
        )
    who = f"pod {pod}"
    found: list[tuple[Preparation, PreparedVf]] = []
    for prep in PreparedStore(conf.stateDir).all():
        if prep.claim_namespace != pod.namespace:
            continue
        if (prep.pod_uid != pod.uid) if pod.uid else (prep.pod_name != pod.name):
            continue
        found.extend((prep, v) for v in prep.vfs if v.network == conf.name)
    found.sort(key=lambda item: (item[0].claim_name, [v.request for v in item[0].vfs].index(item[1].request)))
    return who, found


def prepared_request(env: CniEnv, conf: NetConf) -> tuple[PodRequest, str]:
    """The attachment's request: one interface per prepared VF, at its prepared rates and name.

    Code 101 when the pod has no prepared claim on this network (it attaches a
    DRA network without a claim of this driver).
    """
    who, found = _mine(env, conf)
    if not found:
        raise InvalidPodRequest(
            f"{who} has no prepared DRA claim on network {conf.name}: a pod attaching a DRA network gets VFs "
            "only through a ResourceClaim of rdma-cni.io whose requests select this network "
            "(`rdma-cni claim` prints one), prepared by kubelet before its sandbox"
        )
    claims = sorted({p.claim_name for p, _ in found})
    source = f"{who} DRA claim(s) {', '.join(claims)} (prepared)"
    try:
        request = PodRequest(
            interfaces=[
                InterfaceRequest(min_tx_rate=v.min_tx_rate, max_tx_rate=v.max_tx_rate, name=v.name)
                for _, v in found
            ]
        )
    except ValueError as exc:  # pydantic's ValidationError: names clashing across claims, more than 32
        raise InvalidPodRequest(f"{source}: {exc}") from None
    log.info("pod request from %s: %d interface(s)", source, len(found))
    return request, source


def take(
    node: Node, env: CniEnv, conf: NetConf, finder: VfFinder, store: RecordStore, expected: int
) -> list[Vf]:
    """Under the node lock: the pod's prepared VFs on this network, each proven free for it.

    The preparation is read again (it is the lock's now); each VF must be on
    a PF of the network, held by no attachment record (another sandbox of the
    pod not yet DELed, say: :class:`StateError`), and proven home in the host.
    ``expected`` is the number of interfaces the request read before the lock
    had: a preparation changed in between is :class:`StateError` (kubelet retries).
    """
    _, found = _mine(env, conf)
    if len(found) != expected:
        raise StateError(
            f"the pod's DRA preparations on network {conf.name} changed during ADD ({expected} VF(s) before, "
            f"{len(found)} now); try again"
        )
    attached = {v.pci: att for att in store.all() for v in att.vfs}
    chosen: list[Vf] = []
    for prep, pv in found:
        pf = node.pf(pv.pf)
        vf = next((v for v in pf.vfs if v.pci == pv.pci), None) if pf is not None else None
        if vf is None:
            raise NoCapacity(
                f"claim {prep.claim_namespace}/{prep.claim_name}: its prepared VF {pv.pci} (PF "
                f"{pv.pf}, VF {pv.vf}) "
                f"is not on this node's network {conf.name} any more (VFs disabled, or the PF left "
                "the network)"
            )
        holder = attached.get(pv.pci)
        if holder is not None:
            raise StateError(
                f"claim {prep.claim_namespace}/{prep.claim_name}: its VF {pv.pci} is attached to "
                f"{holder.container_id}/{holder.ifname}: DEL that attachment first"
            )
        link = finder.in_host(vf.pci, vf.netdev)
        if link is None:
            raise NoCapacity(
                f"claim {prep.claim_namespace}/{prep.claim_name}: its VF {pv.pci} is not proven to be "
                "in the host "
                "(still in another pod's namespace?)"
            )
        vf.netdev = link.name
        chosen.append(vf)
    return chosen

"""ResourceClaims as kube-scheduler v1.37.2 leaves them once it allocated them, for tests of the node side.

The shape is the one the cluster tier's real kube-scheduler wrote for a claim
made from ``rdma-cni claim``'s template (tests/cluster/test_dra_claims.py
checks that the real allocations keep it): per result the driver, the pool
(the node), the device, the request, a ``shareID`` (the device allows
multiple allocations) and ``consumedCapacity`` with ``bandwidth`` (canonical
quantity text, ``15k``) and ``vfs``; the claim's configuration copied with
``source: FromClaim``; one pod in ``reservedFor``.
"""

from __future__ import annotations

import uuid
from typing import Any

from rdma_cni.shared.dra import DRIVER
from rdma_cni.shared.dra.claims import CONFIG_API_VERSION, CONFIG_KIND
from rdma_cni.shared.dra.slices import device_name


def canonical(mbps: int) -> str:
    """A quantity as the API server writes it back (``15000`` is ``15k``)."""
    return f"{mbps // 1000}k" if mbps and mbps % 1000 == 0 else str(mbps)


def allocated_claim(
    name: str,
    pod: tuple[str, str],
    results: list[tuple[str, str, str, int | None]],
    *,
    namespace: str = "default",
    node: str = "node-1",
    uid: str | None = None,
    caps: dict[str, int] | None = None,
    names: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An allocated claim reserved for ``pod`` (name, uid).

    ``results``: (request, network, PF, consumed bandwidth or None when the
    device publishes none) each; ``caps`` and ``names`` the requests' configuration.
    """
    requests = list(dict.fromkeys(r[0] for r in results))
    config = []
    for request in requests:
        parameters: dict[str, Any] = {"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND}
        if caps and request in caps:
            parameters["max_tx_rate"] = caps[request]
        if names and request in names:
            parameters["name"] = names[request]
        if len(parameters) > 2:
            config.append(
                {
                    "source": "FromClaim",
                    "requests": [request],
                    "opaque": {"driver": DRIVER, "parameters": parameters},
                }
            )
    out = []
    for request, network, pf, bandwidth in results:
        consumed = {"vfs": "1"}
        if bandwidth is not None:
            consumed["bandwidth"] = canonical(bandwidth)
        out.append(
            {
                "request": request,
                "driver": DRIVER,
                "pool": node,
                "device": device_name(network, pf),
                "shareID": str(uuid.uuid4()),
                "consumedCapacity": consumed,
            }
        )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4())},
        "spec": {
            "devices": {
                "requests": [{"name": r, "exactly": {"deviceClassName": "vf.rdma-cni.io"}} for r in requests]
            }
        },
        "status": {
            "allocation": {"devices": {"results": out, "config": config}},
            "reservedFor": [{"resource": "pods", "name": pod[0], "uid": pod[1]}],
        },
    }


class ClaimApi:
    """The API client the preparer is given: GETs of claims from a dict, or the error set for them."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.error: Exception | None = None
        self.gets = 0

    def add(self, claim: dict[str, Any]) -> dict[str, Any]:
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim
        return claim

    def get(self, path: str) -> dict[str, Any]:
        from rdma_cni.kube.client import NotFound

        self.gets += 1
        if self.error is not None:
            raise self.error
        parts = path.split("/")
        namespace, name = parts[parts.index("namespaces") + 1], parts[-1]
        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise NotFound(404, "NotFound", f"resourceclaims {name} not found") from None

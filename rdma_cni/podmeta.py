"""What a pod asks for: its annotation (read from the API server), the config's args, or the default."""

from __future__ import annotations

import logging

from rdma_cni.config import NetConf
from rdma_cni.errors import InvalidPodRequest
from rdma_cni.podrequest import InterfaceRequest, PodRequest, parse_request
from rdma_cni.protocol import IFNAMSIZ, CniEnv

log = logging.getLogger("rdma_cni.podmeta")

ARGS_KEY = "rdma_interfaces_required"


def resolve_request(env: CniEnv, conf: NetConf) -> tuple[PodRequest, str]:
    """The pod's request and a phrase naming where it came from (for errors and logs)."""
    pod = env.pod
    if pod is not None:
        from rdma_cni import k8s

        creds = k8s.load_credentials(conf.kubeconfig)
        obj = k8s.get_pod(creds, pod.namespace, pod.name)
        uid = (obj.get("metadata") or {}).get("uid", "")
        if pod.uid and uid and uid != pod.uid:
            log.warning(
                "pod %s has uid %s, CNI_ARGS says %s: using the live pod's annotation", pod, uid, pod.uid
            )
        raw = k8s.pod_annotation(obj, conf.annotation)
        if raw is None:
            return PodRequest(
                interfaces=conf.defaultRequest
            ), f"defaultRequest (pod {pod} has no {conf.annotation})"
        source = f"pod {pod} annotation {conf.annotation}"
        return parse_request(raw, source), source
    cni_args = conf.args.get("cni") if isinstance(conf.args, dict) else None
    if isinstance(cni_args, dict) and ARGS_KEY in cni_args:
        source = f"config args.cni.{ARGS_KEY}"
        return parse_request(cni_args[ARGS_KEY], source), source
    return PodRequest(interfaces=conf.defaultRequest), "defaultRequest"


def pod_side_names(ifname: str, request: list[InterfaceRequest], source: str) -> list[str]:
    """Names of the pod's interfaces: CNI_IFNAME first, then the request's names or ``<ifname>-<n>``.

    Generated names keep to 15 characters by shortening the CNI_IFNAME part:
    ``net1``, ``net1-1``, ``net1-2``, ...
    """
    first = request[0].name if request else None
    if first is not None and first != ifname:
        raise InvalidPodRequest(
            f"{source}: entry 0 is named {first!r} but the first interface is always CNI_IFNAME ({ifname})"
        )
    names = [ifname]
    for i, entry in enumerate(request[1:], start=1):
        if entry.name:
            names.append(entry.name)
        else:
            suffix = f"-{i}"
            names.append(ifname[: IFNAMSIZ - len(suffix)] + suffix)
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidPodRequest(f"{source}: interface names collide: {', '.join(dupes)}")
    return names

"""Where a pod's request comes from: the runtime's CRI annotations, the API server, args, or the default."""

from __future__ import annotations

import logging
from typing import Any

from rdma_cni.cni.config import NetConf
from rdma_cni.cni.errors import InvalidConfig, InvalidPodRequest
from rdma_cni.cni.protocol import IFNAMSIZ, CniEnv
from rdma_cni.shared.attachments import ARGS_KEY, attachment_request
from rdma_cni.shared.podrequest import InterfaceRequest, PodRequest
from rdma_cni.shared.quote import quote

log = logging.getLogger("rdma_cni.podmeta")

# containerd's CRI puts the pod's annotations under this runtimeConfig key
# when the plugin's conflist entry declares the capability of the same name.
CRI_ANNOTATIONS = "io.kubernetes.cri.pod-annotations"


def runtime_annotations(conf: NetConf) -> dict[str, str] | None:
    """The pod's annotations as the runtime passed them; None when it passed none (ask the API).

    ``null`` means the pod has no annotations: kubelet copies every pod
    annotation into the sandbox config, so there is nothing more to find on
    the API server. The value's shape is the runtime's doing, not the pod's,
    so a wrong shape is a configuration error (code 7).
    """
    if CRI_ANNOTATIONS not in conf.runtimeConfig:
        return None
    value: Any = conf.runtimeConfig[CRI_ANNOTATIONS]
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InvalidConfig(
            f'runtimeConfig["{CRI_ANNOTATIONS}"] must be an object mapping annotation keys to '
            f"strings, or null: got {quote(value)}"
        )
    return value


def resolve_request(env: CniEnv, conf: NetConf) -> tuple[PodRequest, str]:
    """The attachment's request and a phrase naming where it came from (for errors and logs).

    Decided by :func:`rdma_cni.shared.attachments.attachment_request`, as the
    extender decides it: this attachment's ``args.cni.rdma_interfaces_required``
    (Multus: the selection's ``cni-args``), else the pod-wide annotation, read
    from the runtime's CRI annotations (no API round trip) or from the pod on
    the API server (Multus and other runtimes pass only its name), else
    ``defaultRequest``.
    """
    default = PodRequest(interfaces=conf.defaultRequest)
    cni_args = conf.args.get("cni") if isinstance(conf.args, dict) else None
    request, source = attachment_request(
        cni_args, f"config args.cni.{ARGS_KEY}", lambda: _pod_wide(env, conf), default
    )
    request = request or default  # never None: a default is given
    log.info("pod request from %s: %d interface(s)", source, len(request.interfaces))
    return request, source


def _pod_wide(env: CniEnv, conf: NetConf) -> tuple[Any, str]:
    pod = env.pod
    annotations = runtime_annotations(conf)
    if annotations is not None:
        who = f"pod {pod}" if pod is not None else "the pod"
        raw = annotations.get(conf.annotation)
        if raw is None:
            return None, f"defaultRequest ({who} has no {conf.annotation}, per the runtime's annotations)"
        return raw, f"{who} annotation {conf.annotation} (from the runtime's annotations)"
    if pod is not None:
        from rdma_cni.kube import credentials, podget, tls

        creds = credentials.load_credentials(conf.kubeconfig)
        obj = podget.get_pod(creds, pod.namespace, pod.name)
        tls.note_context_miss(conf.kubeconfig)
        uid = (obj.get("metadata") or {}).get("uid", "")
        if pod.uid and uid and uid != pod.uid:
            log.warning(
                "pod %s has uid %s, CNI_ARGS says %s: using the live pod's annotation", pod, uid, pod.uid
            )
        raw = podget.pod_annotation(obj, conf.annotation)
        if raw is None:
            return None, f"defaultRequest (pod {pod} has no {conf.annotation})"
        return raw, f"pod {pod} annotation {conf.annotation} (from the API server)"
    return None, "defaultRequest"


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

"""Which agent pod's token the node kubeconfig holds during a rollout.

The kubeconfig embeds the installer pod's service-account token, and a
projected token is bound to its pod: it stops working when the pod is
deleted. During a rolling update with surge two installer pods run on a node
and both refresh the same file. If each wrote its own token whenever the file
differed, they would take turns, and the old pod's token could be the one left
when the old pod goes: the plugin's pod reads then fail until the new pod's
next refresh.

So the newest pod takes the file over when it starts (``run_once``), and on a
refresh a pod leaves a file holding another pod's token while that token can
still work: not expired, and its pod still there with the same uid (asked of
the API server with this pod's own token). It writes again when the file holds
its own token (kubelet rotated it), no token it can read, an expired one, or
one whose pod is gone (a rollout undone, the surge pod deleted): then no node
is left with a dead token for longer than one refresh interval.

The token's claims are read without checking its signature: only the API
server can, and a forged file on the host is no threat the installer could
stop anyway (whoever writes it is root there).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

PodRef = tuple[str, str, str]  # namespace, name, uid


def jwt_claims(token: str) -> dict[str, Any] | None:
    """A JWT's payload, decoded without checking its signature; None when it is not a JWT."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload))
    except (binascii.Error, ValueError):
        return None
    return claims if isinstance(claims, dict) else None


def kubeconfig_token(data: bytes) -> str | None:
    """The user token of a kubeconfig as the installer writes it; None when there is none."""
    try:
        token = json.loads(data)["users"][0]["user"]["token"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return token if isinstance(token, str) and token else None


def bound_pod(claims: Mapping[str, Any]) -> PodRef | None:
    """The pod a projected service-account token is bound to (its ``kubernetes.io`` claim)."""
    k8s = claims.get("kubernetes.io")
    if not isinstance(k8s, dict) or not isinstance(k8s.get("pod"), dict):
        return None
    ref = (k8s.get("namespace"), k8s["pod"].get("name"), k8s["pod"].get("uid"))
    return ref if all(isinstance(x, str) and x for x in ref) else None  # type: ignore[return-value]


def leave_reason(
    current: bytes, mine: bytes, *, alive: Callable[[PodRef], bool | None], now: float
) -> str | None:
    """Why a refresh should leave ``current`` (the file) rather than write ``mine``; None to write."""
    theirs_token, my_token = kubeconfig_token(current), kubeconfig_token(mine)
    theirs = jwt_claims(theirs_token) if theirs_token else None
    my = jwt_claims(my_token) if my_token else None
    their_pod = bound_pod(theirs) if theirs else None
    my_pod = bound_pod(my) if my else None
    if their_pod is None or my_pod is None or their_pod == my_pod:
        return None  # the content rule: this pod's own file, or nothing to judge by
    exp = theirs.get("exp") if theirs else None
    if isinstance(exp, (int, float)) and exp <= now:
        return None
    if alive(their_pod) is False:
        return None
    return f"it holds the token of pod {their_pod[0]}/{their_pod[1]}, which is still there"


def pod_alive(serviceaccount_dir: str, environ: Mapping[str, str]) -> Callable[[PodRef], bool | None]:
    """Ask the API server, with this pod's own token, whether a pod is still there (None: cannot tell)."""

    def alive(ref: PodRef) -> bool | None:
        # Imported here: the installer's other paths never talk to the API server.
        from rdma_cni.cni.errors import KubernetesError
        from rdma_cni.install.kubeconfig import api_server_url
        from rdma_cni.kube.credentials import ClusterCredentials
        from rdma_cni.kube.podget import get_pod

        namespace, name, uid = ref
        try:
            with open(os.path.join(serviceaccount_dir, "token"), encoding="utf-8") as f:
                token = f.read().strip()
            creds = ClusterCredentials(
                server=api_server_url(environ),
                source="the installer's service account",
                ca_file=os.path.abspath(os.path.join(serviceaccount_dir, "ca.crt")),
                token=token,
            )
            pod = get_pod(creds, namespace, name, retries=1)
        except KubernetesError as exc:
            return False if exc.msg.endswith("not found") else None
        except Exception:  # an unreachable API, a bad token file, ...: cannot tell
            return None
        return (pod.get("metadata") or {}).get("uid") == uid

    return alive


def refresh_keep(
    serviceaccount_dir: str, environ: Mapping[str, str], now: Callable[[], float] = time.time
) -> Callable[[bytes, bytes], str | None]:
    """The ``keep`` rule of a refresh: :func:`leave_reason`, with the API server's answer."""
    alive = pod_alive(serviceaccount_dir, environ)
    return lambda current, mine: leave_reason(current, mine, alive=alive, now=now())

"""``rdma-cni scheduler-config``: the control plane's KubeSchedulerConfiguration with the extender merged in.

kube-scheduler builds its extenders once, at start (``NewHTTPExtender`` in
k8s.io/kubernetes pkg/scheduler/extender.go), and exits when one cannot be
built ("couldn't build extenders"). With ``tlsConfig`` naming files
(``certFile``, ``keyFile``, ``caFile``) it reads them then (client-go's
``loadTLSFiles``): a file missing or unreadable on one control-plane node (a
new node, an uninstall that removed them, a typo) stops the cluster's default
scheduler, every pod's. With the same credentials inline (``certData``,
``keyData``, ``caData``) it reads no file: what it checks at start (the pair
matches, the CA parses) is in the configuration itself, checked here before it
is written, and from then on nothing that happens to the extender, its
certificates or its Service can make it exit. Calls that fail (the Service
gone, a certificate expired, the extender down) fail the scheduling of the
pods the extender is asked about, the RDMA pods (``managedResources``), and
of no other pod.

The operator's configuration is kept as it is (profiles, plugins, leader
election, other extenders): the extender's stanza is added, or replaces the
one an earlier run added, recognised by its managed resources. What cannot be
merged is refused with the reason (another extender that binds: kube-scheduler
allows one binder; a file that is not a KubeSchedulerConfiguration of
``kubescheduler.config.k8s.io/v1``). ``--remove`` takes the stanza out again:
the control plane's revert at uninstall. The output holds kube-scheduler's
private key, so it is written 0600 (as kubeadm's ``scheduler.conf``).

Exit codes: 0 written, 1 refused (what could not be merged, or credentials
kube-scheduler would refuse or that have expired), 2 usage errors.
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import ssl
import sys
import time
import urllib.parse
from typing import Any, TextIO

from rdma_cni.extender.certs import CertificateError, read_not_after
from rdma_cni.shared import nodestate
from rdma_cni.shared.atomicfile import write_atomic

__all__ = ["Refused", "main", "merge", "stanza"]

PROG = "rdma-cni scheduler-config"
API_VERSION = "kubescheduler.config.k8s.io/v1"
KIND = "KubeSchedulerConfiguration"
# conf/base/extender-mtls/scheduler-extender-mtls.yaml's Service, the name its serving certificate is for.
SERVICE_NAME = "rdma-cni-scheduler-extender.kube-system.svc"
# kubeadm's kube-scheduler kubeconfig: what a configuration written from nothing connects with.
KUBEADM_KUBECONFIG = "/etc/kubernetes/scheduler.conf"
# The pods kube-scheduler asks the extender about: those declaring one of these (docs/scheduling.md).
MANAGED = (nodestate.VF_RESOURCE, nodestate.BANDWIDTH_RESOURCE)
# A configuration and a PEM file are a few KiB; what is read is bounded all the same.
MAX_INPUT = 1024 * 1024
# Certificates ending sooner than this are written, with a warning.
EXPIRY_WARNING = 30 * 86400


class Refused(Exception):
    """What cannot be merged or written (the message says why); exit 1."""


def stanza(
    url: str, server_name: str, ca: bytes, cert: bytes, key: bytes, http_timeout: float
) -> dict[str, Any]:
    """The extender's entry of ``extenders``: conf/kube-scheduler-default.yaml's, credentials inline."""
    return {
        "urlPrefix": url,
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "preemptVerb": "preempt",
        "bindVerb": "bind",
        "weight": 1000,
        "enableHTTPS": True,
        "tlsConfig": {
            "serverName": server_name,
            # []byte fields: base64 in the configuration, as Go's JSON decoding reads them.
            "caData": base64.b64encode(ca).decode(),
            "certData": base64.b64encode(cert).decode(),
            "keyData": base64.b64encode(key).decode(),
        },
        "httpTimeout": f"{http_timeout:g}s",
        "nodeCacheCapable": True,
        "managedResources": [{"name": name, "ignoredByScheduler": False} for name in MANAGED],
        "ignorable": False,
    }


def _is_ours(extender: dict[str, Any]) -> bool:
    """An entry an earlier run added: it manages rdma-cni's resources (no other extender may)."""
    resources = extender.get("managedResources") or []
    return isinstance(resources, list) and any(
        isinstance(r, dict) and r.get("name") in MANAGED for r in resources
    )


def merge(base: dict[str, Any], ours: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """``base`` with ``ours`` as its extender (None: without it); and notes for the operator.

    Raises :class:`Refused` for what kube-scheduler would refuse once merged, or what is not a
    configuration this can change without guessing.
    """
    if base.get("apiVersion") != API_VERSION or base.get("kind") != KIND:
        raise Refused(
            f"not a {KIND} of {API_VERSION} (apiVersion {base.get('apiVersion')!r}, "
            f"kind {base.get('kind')!r}); kube-scheduler reads only v1 since 1.29: convert it first"
        )
    extenders = base.get("extenders") or []
    if not isinstance(extenders, list) or not all(isinstance(e, dict) for e in extenders):
        raise Refused("its extenders are not a list of extenders")
    profiles = base.get("profiles") or []
    if not isinstance(profiles, list) or not all(isinstance(p, dict) for p in profiles):
        raise Refused("its profiles are not a list of profiles")
    kept = []
    replaced = 0
    for extender in extenders:
        if _is_ours(extender):
            replaced += 1
            continue
        if ours is not None and extender.get("bindVerb"):
            raise Refused(
                f"its extender {str(extender.get('urlPrefix'))[:200]!r} binds pods (bindVerb), and "
                "kube-scheduler allows one binding extender; rdma-cni's must bind (it re-checks each "
                "bind against its reservations): remove that bindVerb or use the sidecar variant"
            )
        kept.append(extender)
    merged = dict(base)
    if ours is not None:
        kept.append(ours)
    if kept:
        merged["extenders"] = kept
    else:
        merged.pop("extenders", None)
    notes = []
    if ours is None and not replaced:
        notes.append("no rdma-cni extender in it: written unchanged")
    names = [str(p.get("schedulerName") or "default-scheduler") for p in profiles] or ["default-scheduler"]
    if ours is not None and names != ["default-scheduler"]:
        flags = " ".join(f"--scheduler-name={n}" for n in names)
        notes.append(
            "kube-scheduler asks the extender about the pods of every profile that declare "
            f"{' or '.join(MANAGED)}: give the extender {flags} (it binds only the pods of the names it has)"
        )
    percentages = [base.get("percentageOfNodesToScore")] + [
        p.get("percentageOfNodesToScore") for p in profiles
    ]
    if ours is not None and any(percentages):
        notes.append(
            "percentageOfNodesToScore is set: give the extender the same --percentage-of-nodes-to-score "
            "(docs/scheduling.md, Sampled nodes)"
        )
    return merged, notes


def _fresh(kubeconfig: str) -> dict[str, Any]:
    """A configuration of kube-scheduler's defaults (one profile, default-scheduler) and ``kubeconfig``."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "clientConnection": {"kubeconfig": kubeconfig},
        "profiles": [{"schedulerName": "default-scheduler"}],
    }


def _read(path: str, what: str, stdin: TextIO | None = None) -> bytes:
    try:
        if path == "-" and stdin is not None:
            data = stdin.buffer.read(MAX_INPUT + 1) if hasattr(stdin, "buffer") else stdin.read().encode()
        else:
            with open(path, "rb") as f:
                data = f.read(MAX_INPUT + 1)
    except OSError as exc:
        raise Refused(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_INPUT:
        raise Refused(f"{what} {path} is over {MAX_INPUT} bytes")
    return data


def _load_base(path: str, stdin: TextIO) -> dict[str, Any]:
    import yaml

    text = _read(path, "the configuration", stdin)
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise Refused(f"{path} is not YAML: {str(exc)[:500]}") from None
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise Refused(f"{path} is not one {KIND} (kube-scheduler reads one document)")
    return docs[0]


def _check_url(url: str) -> str:
    """The extender's address as a host-network kube-scheduler can reach it; Refused otherwise."""
    split = urllib.parse.urlsplit(url)
    if split.scheme != "https" or not split.hostname:
        raise Refused(
            f"--url {url!r}: expected https://ADDRESS:PORT (kube-scheduler presents its certificate over TLS)"
        )
    if split.path not in ("", "/") or split.query or split.fragment:
        raise Refused(f"--url {url!r}: no path: the extender serves /filter, /prioritize, /preempt, /bind")
    host = split.hostname
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host.endswith(".svc") or ".svc." in host:
            raise Refused(
                f"--url {url!r}: the control plane's kube-scheduler runs on the host's network and "
                "resolves names with the host's DNS, which does not know Service names: give the "
                "Service's ClusterIP (kubectl -n kube-system get service rdma-cni-scheduler-extender)"
            ) from None
    return url.rstrip("/")


def _check_credentials(ca: str, cert: str, key: str, now: float, warn: TextIO) -> tuple[bytes, bytes, bytes]:
    """The three PEM files' bytes, once kube-scheduler would accept them and none has expired."""
    data = tuple(
        _read(path, what) for path, what in ((ca, "--ca"), (cert, "--client-cert"), (key, "--client-key"))
    )
    ends = {}
    for path, what, first in ((ca, "--ca", None), (cert, "--client-cert", 1)):
        try:
            # The client certificate is the file's first; a CA bundle may hold an old CA beside a new one.
            ends[what] = read_not_after(path)[:first]
        except CertificateError as exc:
            raise Refused(f"{what}: {exc}") from None
    try:
        ssl.create_default_context(cadata=data[0].decode("ascii", errors="ignore"))
    except (ValueError, ssl.SSLError) as exc:
        raise Refused(f"--ca {ca}: no CA certificate kube-scheduler could use: {exc}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise Refused(
            f"--client-cert {cert} and --client-key {key} do not go together ({exc}): kube-scheduler "
            "would refuse them at start"
        ) from None
    for (what, times), path in zip(ends.items(), (ca, cert), strict=True):
        if max(times) <= now:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(max(times)))
            raise Refused(f"{what} {path} expired on {when}: renew it first (docs/deploy.md)")
        if min(times) - now < EXPIRY_WARNING:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(min(times)))
            warn.write(f"{PROG}: warning: {what} {path}: a certificate ends on {when}\n")
    return data


def parser() -> argparse.ArgumentParser:
    """The subcommand's options."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Write the control plane's KubeSchedulerConfiguration with the rdma-cni extender merged "
        "in (credentials inline: kube-scheduler reads no file of ours at start), or taken out (--remove).",
    )
    p.add_argument(
        "--merge", metavar="FILE", help="the configuration kube-scheduler runs with now ('-': stdin)"
    )
    p.add_argument("--remove", action="store_true", help="take the rdma-cni extender out of --merge's FILE")
    p.add_argument("--url", help="https://CLUSTER-IP:443: the extender Service's ClusterIP")
    p.add_argument("--ca", metavar="FILE", help="the CA of the extender's serving certificate (PEM)")
    p.add_argument("--client-cert", metavar="FILE", help="kube-scheduler's client certificate (PEM)")
    p.add_argument("--client-key", metavar="FILE", help="its key (PEM)")
    p.add_argument(
        "--server-name",
        default=SERVICE_NAME,
        help="the name the serving certificate is for (default: %(default)s)",
    )
    p.add_argument(
        "--http-timeout",
        type=float,
        default=10.0,
        help="seconds; the extender's --http-timeout (default: %(default)s)",
    )
    p.add_argument(
        "--kubeconfig",
        default=KUBEADM_KUBECONFIG,
        help="without --merge: kube-scheduler's kubeconfig (default: %(default)s, kubeadm's)",
    )
    p.add_argument("--output", metavar="FILE", help="write here (0600, atomically) instead of stdout")
    return p


def main(argv: list[str], out: TextIO, err: TextIO = sys.stderr, stdin: TextIO = sys.stdin) -> int:
    """Entry point of ``rdma-cni scheduler-config``."""
    p = parser()
    args = p.parse_args(argv)
    if args.remove:
        if not args.merge:
            p.error("--remove needs --merge FILE (the configuration to take the extender out of)")
        if args.url or args.ca or args.client_cert or args.client_key:
            p.error("--remove takes no --url, --ca, --client-cert or --client-key")
    elif not (args.url and args.ca and args.client_cert and args.client_key):
        p.error("--url, --ca, --client-cert and --client-key are required (or --remove)")
    if not 0 < args.http_timeout <= 600:
        p.error("--http-timeout: from 0 to 600 seconds")
    try:
        ours = None
        if not args.remove:
            url = _check_url(args.url)
            ca, cert, key = _check_credentials(args.ca, args.client_cert, args.client_key, time.time(), err)
            ours = stanza(url, args.server_name, ca, cert, key, args.http_timeout)
        base = _load_base(args.merge, stdin) if args.merge else _fresh(args.kubeconfig)
        merged, notes = merge(base, ours)
        text = _render(merged)
        if args.output:
            try:
                write_atomic(args.output, text, mode=0o600)
            except OSError as exc:
                raise Refused(f"cannot write {args.output}: {exc.strerror or exc}") from None
        else:
            out.write(text)
            out.flush()
    except Refused as exc:
        err.write(f"{PROG}: refused: {exc}\n")
        return 1
    for note in notes:
        err.write(f"{PROG}: note: {note}\n")
    return 0


def _render(config: dict[str, Any]) -> str:
    import yaml

    head = (
        "# kube-scheduler's configuration, written by rdma-cni scheduler-config (docs/deploy.md).\n"
        "# It holds kube-scheduler's private key for the rdma-cni extender: keep it 0600, root's.\n"
    )
    return head + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)

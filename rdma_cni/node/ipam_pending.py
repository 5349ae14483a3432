"""IPAM releases that could not finish, remembered apart from the VFs.

A VF must never be held by another component's failure: when IPAM DEL fails
during ADD's rollback, DEL or GC, the VFs still go home and their allocation
record goes; what IPAM DEL still needs is kept here, one 0600 JSON file per
attachment under ``<stateDir>/ipam-pending/``, written atomically. DEL of the
same attachment and GC of its network retry it (with their own configuration
first, which the operator may have fixed meanwhile, then the one recorded);
ADD of the same attachment retries it before allocating anything, so a late
retry can never release a newer lease. STATUS counts them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from rdma_cni.cni.errors import CniError, IOFailure, IpamError
from rdma_cni.cni.protocol import CniEnv
from rdma_cni.node.ipam import Ipam
from rdma_cni.node.record import QUARANTINE, attachment_files, quarantine, write_atomic
from rdma_cni.node.statedir import make_dirs

log = logging.getLogger("rdma_cni.ipam_pending")

DIRNAME = "ipam-pending"
_SUFFIX = ".json"


@dataclass
class PendingIpam:
    """An attachment's IPAM DELs that have not succeeded yet."""

    container_id: str
    ifname: str  # the attachment's CNI_IFNAME
    network: str
    netns: str
    interfaces: list[str]  # pod-side interface names (each its own IPAM attachment)
    conf: dict[str, Any]  # the network configuration IPAM DEL was given
    created_at: float = 0.0
    attempts: int = 0
    last_error: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


def _parse(text: str) -> PendingIpam:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("expected an object")
    names = {f.name for f in dataclasses.fields(PendingIpam)}
    if set(data) - names:
        raise ValueError(f"unknown keys {sorted(set(data) - names)}")
    item = PendingIpam(**data)
    if not isinstance(item.interfaces, list) or not all(isinstance(i, str) for i in item.interfaces):
        raise ValueError("interfaces must be a list of names")
    if not isinstance(item.conf, dict):
        raise ValueError("conf must be an object")
    return item


class PendingStore:
    """``<stateDir>/ipam-pending``."""

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, DIRNAME)

    def path(self, container_id: str, ifname: str) -> str:
        # Both parts were validated by the protocol layer (or come from a record).
        return os.path.join(self.dir, f"{container_id}@{ifname}{_SUFFIX}")

    def exists(self, container_id: str, ifname: str) -> bool:
        """Is an IPAM release pending for this attachment? (one stat: ADD asks it every time)"""
        return os.path.exists(self.path(container_id, ifname))

    def of_network(self, container_id: str, ifname: str, network: str) -> PendingIpam | None:
        """The pending release of one attachment of ``network``, or None.

        CNI names an attachment by network, container ID and ifname: another
        network's release (its own IPAM, its own leases) is that network's
        DEL's and GC's business, never a reason to fail this one's verbs.
        """
        if not self.exists(container_id, ifname):
            return None
        item = self.get(container_id, ifname)
        return item if item is not None and item.network == network else None

    def get(self, container_id: str, ifname: str) -> PendingIpam | None:
        """The pending release of one attachment, or None; code 5 when unreadable.

        A corrupt file is set aside into ``<stateDir>/quarantine/`` (logged
        as an error: the leases it described need an operator) and reads as
        None, so it never blocks the verbs that find it.
        """
        path = self.path(container_id, ifname)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise IOFailure(f"cannot read pending IPAM release {path}: {exc.strerror}") from exc
        try:
            return _parse(text)
        except (ValueError, TypeError) as exc:
            target = quarantine(path, os.path.join(os.path.dirname(self.dir), QUARANTINE))
            log.error(
                "pending IPAM release %s is corrupt (%s); set aside as %s: release the IPAM leases of %s/%s "
                "by hand",
                path,
                exc,
                target,
                container_id,
                ifname,
            )
            return None

    def all(self, errors: list[str]) -> list[PendingIpam]:
        """Every pending release; unreadable files are reported in ``errors``."""
        out = []
        for _name, cid, ifname in attachment_files(self.dir, "pending IPAM releases directory"):
            try:
                item = self.get(cid, ifname)
            except IOFailure as exc:
                errors.append(exc.msg)
                continue
            if item is not None:
                out.append(item)
        return out

    def count(self) -> int:
        """How many attachments have an IPAM release pending."""
        try:
            return sum(1 for n in os.listdir(self.dir) if n.endswith(_SUFFIX) and not n.startswith("."))
        except OSError:
            return 0

    def put(self, item: PendingIpam) -> None:
        """Remember (or update) a pending release."""
        try:
            make_dirs(os.path.dirname(self.dir))
            make_dirs(self.dir)
        except OSError as exc:
            raise IOFailure(f"cannot create {self.dir}: {exc.strerror}") from exc
        write_atomic(
            self.dir, f"{item.container_id}@{item.ifname}{_SUFFIX}", item.to_json(), "pending IPAM release"
        )

    def remove(self, container_id: str, ifname: str) -> None:
        """Forget a pending release (missing is fine)."""
        try:
            os.unlink(self.path(container_id, ifname))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise IOFailure(f"cannot remove {self.path(container_id, ifname)}: {exc.strerror}") from exc


def ipam_acting_for(doc: dict[str, Any], env: CniEnv, state_dir: str, container_id: str, netns: str) -> Ipam:
    """IPAM of ``doc`` acting for attachment ``container_id`` (GC and retries act for others)."""
    if container_id != env.container_id or netns != env.netns:
        environ = {**env.environ, "CNI_CONTAINERID": container_id, "CNI_NETNS": netns}
        env = dataclasses.replace(env, container_id=container_id, netns=netns, environ=environ)
    return Ipam(doc, env, state_dir)


def ipam_conf(doc: dict[str, Any]) -> dict[str, Any]:
    """What of a network configuration IPAM DEL needs (a chained prevResult is not its business)."""
    return {k: v for k, v in doc.items() if k != "prevResult"}


def remember(
    store: PendingStore,
    *,
    container_id: str,
    ifname: str,
    network: str,
    netns: str,
    interfaces: list[str],
    doc: dict[str, Any],
    error: str,
) -> None:
    """Record that IPAM DEL failed for ``interfaces`` of an attachment (merging with an older entry)."""
    old = store.get(container_id, ifname)
    names = list(dict.fromkeys([*(old.interfaces if old else []), *interfaces]))
    item = PendingIpam(
        container_id=container_id,
        ifname=ifname,
        network=network,
        netns=netns,
        interfaces=names,
        conf=ipam_conf(doc),
        created_at=old.created_at if old else time.time(),
        attempts=(old.attempts if old else 0) + 1,
        last_error=error[:1000],
    )
    store.put(item)
    log.error(
        "IPAM release of %s/%s (%s) is pending: %s; DEL of this attachment and GC of network %s retry it",
        container_id,
        ifname,
        ", ".join(names),
        error,
        network,
    )


def retry(store: PendingStore, item: PendingIpam, doc: dict[str, Any], env: CniEnv, state_dir: str) -> None:
    """Retry a pending release; forget it when done, else raise IpamError (code 104) and keep it.

    Tries the invoking verb's configuration first (an operator may have fixed
    the network's IPAM since), then the recorded one.
    """
    left = list(item.interfaces)
    error = ""
    for conf in _distinct(ipam_conf(doc), item.conf):
        if "ipam" not in conf or conf.get("name") != item.network:
            continue
        try:
            ipam = ipam_acting_for(conf, env, state_dir, item.container_id, item.netns)
        except CniError as exc:
            error = exc.msg
            continue
        still = []
        for name in left:
            try:
                ipam.delete(name)
            except CniError as exc:
                error = exc.msg
                still.append(name)
        left = still
        if not left:
            break
    if not left:
        store.remove(item.container_id, item.ifname)
        log.info("pending IPAM release of %s/%s done", item.container_id, item.ifname)
        return
    store.put(dataclasses.replace(item, interfaces=left, attempts=item.attempts + 1, last_error=error[:1000]))
    raise IpamError(
        f"IPAM release of {item.container_id}/{item.ifname} ({', '.join(left)}) is still pending: "
        f"{error or 'no usable IPAM configuration'}"
    )


def _distinct(*confs: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for conf in confs:
        if conf not in out:
            out.append(conf)
    return out

"""Preparation records: the VFs a DRA claim's allocation holds on this node, from prepare to unprepare.

kubelet calls the node agent's DRA plugin (NodePrepareResources) before the
pod's sandbox exists. The agent proves the claim's allocation against the
node and chooses concrete VFs on the allocated PFs; this record is what it
chose: one 0600 JSON file per claim, ``<stateDir>/prepared/<claim uid>.json``,
written atomically (:mod:`rdma_cni.shared.atomicfile`). From then on the VFs
are held: every scan that hands out VFs (ADD of any network, the agent's
snapshots) counts them as used (:func:`holdings`), whether the pod is
attached or not. The CNI ADD of the pod's DRA network takes exactly these
VFs (:mod:`rdma_cni.verbs.dra`) with the rates recorded here: the bandwidth
the allocation consumed (from the API server's allocation, never from the
pod) and the cap of the validated configuration. DEL is unchanged (the
attachment record goes, the preparation stays: a sandbox made again gets
the same VFs); NodeUnprepareResources removes the preparation.

A record is read strictly; one that cannot be read is an error for every
reader (code 5, naming the file), never set aside: while it exists its VFs
may be promised to a claim, and nobody else may take them.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rdma_cni.cni.errors import IOFailure
from rdma_cni.node import statedir
from rdma_cni.node.record import Attachment, PodInfo, VfRecord, write_atomic
from rdma_cni.shared import atomicfile

__all__ = ["DIRECTORY", "SCHEMA", "Preparation", "PreparedStore", "PreparedVf", "holdings", "valid_uid"]

SCHEMA = 1
DIRECTORY = "prepared"
_SUFFIX = ".json"
# A claim's uid names its file: a Kubernetes UID (a UUID) is letters, digits and '-'.
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# The attachment a preparation holds its VFs as, in scans (never written as a record).
HOLDER_PREFIX = "dra-claim-"


def valid_uid(uid: object) -> bool:
    """Whether ``uid`` may name a preparation's file (a Kubernetes UID, never a path)."""
    return isinstance(uid, str) and _UID.fullmatch(uid) is not None and uid not in (".", "..")


@dataclass
class PreparedVf:
    """One VF prepared for one request of the claim."""

    request: str  # the claim's request (one interface)
    network: str
    pf: str
    device: str  # the DRA device allocated (this network's share of the PF)
    pool: str
    share_id: str  # the allocation's share id ("" when allocated whole)
    vf: int
    pci: str
    min_tx_rate: int  # Mbit/s: the bandwidth the allocation consumed
    max_tx_rate: int  # Mbit/s: the cap of the claim's configuration (0: none)
    name: str | None = None  # the interface's name in the pod, from the configuration


@dataclass
class Preparation:
    """One claim prepared for one pod."""

    claim_namespace: str
    claim_name: str
    claim_uid: str
    pod_name: str
    pod_uid: str
    vfs: list[PreparedVf] = field(default_factory=list)
    created_at: float = 0.0
    schema: int = SCHEMA

    def holding(self) -> Attachment:
        """The preparation as an attachment holding its VFs, for :func:`rdma_cni.node.inventory.scan`."""
        return Attachment(
            container_id=f"{HOLDER_PREFIX}{self.claim_uid}",
            ifname="prepared",
            network=self.vfs[0].network if self.vfs else "",
            netns="",
            cni_version="",
            state="ready",
            pod=PodInfo(self.claim_namespace, self.pod_name, self.pod_uid),
            created_at=self.created_at,
            vfs=[
                VfRecord(
                    pf=v.pf,
                    vf=v.vf,
                    pci=v.pci,
                    host_name="",
                    host_mac="",
                    host_mtu=0,
                    pod_name=v.name or "",
                    min_tx_rate=v.min_tx_rate,
                    max_tx_rate=v.max_tx_rate,
                )
                for v in self.vfs
            ],
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


def _strict(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object")
    names = {f.name: f for f in fields(cls)}
    unknown = set(data) - set(names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    return cls(**data)


def _check_types(obj: Any, where: str, types: dict[str, type | tuple[type, ...]]) -> None:
    for name, kind in types.items():
        value = getattr(obj, name)
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise TypeError(f"{where}.{name}: {type(value).__name__} is not {kind}")


def parse(text: str) -> Preparation:
    """A preparation from its file's text; ValueError or TypeError on anything malformed."""
    data = json.loads(text)
    prep = _strict(Preparation, data, "preparation")
    if prep.schema != SCHEMA:
        raise ValueError(f"preparation schema {prep.schema!r} is not {SCHEMA}")
    _check_types(
        prep,
        "preparation",
        {
            "claim_namespace": str,
            "claim_name": str,
            "claim_uid": str,
            "pod_name": str,
            "pod_uid": str,
            "created_at": (int, float),
            "vfs": list,
        },
    )
    if not valid_uid(prep.claim_uid):
        raise ValueError("claim_uid is not a Kubernetes UID")
    prep.vfs = [_strict(PreparedVf, v, f"vfs[{i}]") for i, v in enumerate(prep.vfs)]
    for i, v in enumerate(prep.vfs):
        _check_types(
            v,
            f"vfs[{i}]",
            {
                "request": str,
                "network": str,
                "pf": str,
                "device": str,
                "pool": str,
                "share_id": str,
                "vf": int,
                "pci": str,
                "min_tx_rate": int,
                "max_tx_rate": int,
                "name": (str, type(None)),
            },
        )
        if v.min_tx_rate < 0 or v.max_tx_rate < 0 or v.vf < 0:
            raise ValueError(f"vfs[{i}]: negative rate or index")
    return prep


class PreparedStore:
    """The ``prepared`` directory under ``stateDir``."""

    def __init__(self, state_dir: str) -> None:
        """Code 5 at once for a ``state_dir`` another user owns or can write (:mod:`.statedir`)."""
        statedir.check_state_dir(state_dir)
        self.state_dir = state_dir
        self.dir = os.path.join(state_dir, DIRECTORY)

    def path(self, claim_uid: str) -> str:
        """The file of a claim's preparation; ValueError for a uid that is no Kubernetes UID."""
        if not valid_uid(claim_uid):
            raise ValueError(f"{claim_uid!r} is not a Kubernetes UID")
        return os.path.join(self.dir, f"{claim_uid}{_SUFFIX}")

    def _read(self, path: str) -> Preparation:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise IOFailure(f"cannot read DRA preparation {path}: {exc.strerror}") from exc
        try:
            prep = parse(text)
        except (ValueError, TypeError) as exc:
            raise IOFailure(
                f"DRA preparation {path} is corrupt: its claim's VFs are unknown; fix or remove it by hand "
                "once the claim is gone",
                str(exc),
            ) from exc
        if os.path.basename(path) != f"{prep.claim_uid}{_SUFFIX}":
            raise IOFailure(f"DRA preparation {path} names claim {prep.claim_uid}, not its file's")
        return prep

    def get(self, claim_uid: str) -> Preparation | None:
        """The claim's preparation, or None; code 5 when it cannot be read."""
        path = self.path(claim_uid)
        if not os.path.exists(path):
            return None
        return self._read(path)

    def all(self) -> list[Preparation]:
        """Every preparation, by claim uid; code 5 when one cannot be read (its VFs are unknown)."""
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise IOFailure(f"cannot list DRA preparations {self.dir}: {exc.strerror}") from exc
        return [
            self._read(os.path.join(self.dir, n))
            for n in names
            if n.endswith(_SUFFIX) and not n.startswith(".")
        ]

    def write(self, prep: Preparation) -> None:
        """Write (or replace) the claim's preparation: 0600, atomically, the directory made 0700."""
        self.path(prep.claim_uid)  # a uid that is no path
        if not prep.created_at:
            prep.created_at = time.time()
        try:
            statedir.make_dirs(self.state_dir)
            statedir.make_dirs(self.dir)
        except OSError as exc:
            raise IOFailure(f"cannot create {self.dir}: {exc.strerror}") from exc
        write_atomic(self.dir, f"{prep.claim_uid}{_SUFFIX}", prep.to_json(), "DRA preparation")

    def delete(self, claim_uid: str) -> bool:
        """Remove a claim's preparation; whether there was one."""
        path = self.path(claim_uid)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise IOFailure(f"cannot remove DRA preparation {path}: {exc.strerror}") from exc
        atomicfile.fsync_dir(self.dir)
        return True


def holdings(state_dir: str) -> list[Attachment]:
    """Every preparation in ``state_dir`` as an attachment holding its VFs (code 5 if one is unreadable)."""
    if not os.path.isdir(os.path.join(state_dir, DIRECTORY)):
        return []
    return [p.holding() for p in PreparedStore(state_dir).all()]

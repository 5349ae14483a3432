"""DRA preparation records (node/prepared) and ADD's choice from them (verbs/dra), without a node.

The integration tier runs both on the simulated node (tests/integration/test_dra_node.py); here
every refusal a record or a choice can make is reached with records and inventories made by hand.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.cni.config import load_netconf
from rdma_cni.cni.errors import InvalidPodRequest, IOFailure, NoCapacity, StateError
from rdma_cni.cni.protocol import CniEnv, PodRef
from rdma_cni.node.inventory import Node, Pf, Vf
from rdma_cni.node.prepared import (
    DIRECTORY,
    Preparation,
    PreparedStore,
    PreparedVf,
    holdings,
    parse,
    valid_uid,
)
from rdma_cni.node.record import RecordStore
from rdma_cni.verbs import dra

UID = "0f3c2a9e-6d4b-4c7e-9a1f-2b8d3e4f5a61"


def vf(
    request: str = "if0", *, pf: str = "ens1f0", index: int = 0, network: str = "rdma-dra", **kw: Any
) -> PreparedVf:
    base: dict[str, Any] = {
        "request": request,
        "network": network,
        "pf": pf,
        "device": "dev",
        "pool": "node-1",
        "share_id": "s",
        "vf": index,
        "pci": f"0000:3b:0{index}.0",
        "min_tx_rate": 1000,
        "max_tx_rate": 0,
    }
    base.update(kw)
    return PreparedVf(**base)


def prep(
    *vfs: PreparedVf, uid: str = UID, claim: str = "c", pod: tuple[str, str] = ("p", "pod-uid")
) -> Preparation:
    return Preparation("ml", claim, uid, pod[0], pod[1], list(vfs))


def state_dir(tmp_path: Path) -> str:
    d = tmp_path / "state"
    d.mkdir(mode=0o700, exist_ok=True)
    return str(d)


def test_a_preparation_round_trips_0600_and_is_held(tmp_path: Path) -> None:
    store = PreparedStore(state_dir(tmp_path))
    p = prep(vf("if0", index=0, min_tx_rate=15000, max_tx_rate=20000), vf("if1", index=1, name="data"))
    store.write(p)
    path = store.path(UID)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert store.get(UID) == p and store.all() == [p]
    held = holdings(store.state_dir)
    assert [(v.pci, v.min_tx_rate, v.max_tx_rate, v.pod_name) for v in held[0].vfs] == [
        ("0000:3b:00.0", 15000, 20000, ""),
        ("0000:3b:01.0", 1000, 0, "data"),
    ]
    assert held[0].pod is not None and held[0].pod.uid == "pod-uid"
    assert store.delete(UID) is True and store.delete(UID) is False
    assert store.get(UID) is None and store.all() == [] and holdings(store.state_dir) == []


def test_no_directory_holds_nothing(tmp_path: Path) -> None:
    assert holdings(state_dir(tmp_path)) == []
    assert PreparedStore(state_dir(tmp_path)).all() == []


@pytest.mark.parametrize("uid", ["", ".", "..", "a/b", "../x", "x" * 200, "-lead"])
def test_a_uid_never_names_a_path(tmp_path: Path, uid: str) -> None:
    assert not valid_uid(uid)
    with pytest.raises(ValueError):
        PreparedStore(state_dir(tmp_path)).path(uid)


def good() -> dict[str, Any]:
    return json.loads(prep(vf()).to_json())


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda d: d.update(schema=2), "preparation schema 2 is not 1"),
        (lambda d: d.update(extra=1), "unknown keys ['extra']"),
        (lambda d: d.update(claim_uid="../x"), "claim_uid is not a Kubernetes UID"),
        (lambda d: d.update(pod_uid=7), "preparation.pod_uid: int"),
        (lambda d: d.update(created_at=True), "preparation.created_at: bool"),
        (lambda d: d["vfs"][0].update(vf="0"), "vfs[0].vf: str"),
        (lambda d: d["vfs"][0].update(min_tx_rate=-1), "vfs[0]: negative rate or index"),
        (lambda d: d["vfs"][0].update(bogus=1), "vfs[0]: unknown keys"),
        (lambda d: d.update(vfs=[7]), "vfs[0]: expected an object"),
        (lambda d: d.clear() or d.update(x=1), "unknown keys"),
    ],
)
def test_a_malformed_preparation_is_refused(change: Any, says: str) -> None:
    doc = good()
    change(doc)
    with pytest.raises((ValueError, TypeError)) as exc:
        parse(json.dumps(doc))
    assert says in str(exc.value)


def test_an_unreadable_preparation_is_code_5_for_every_reader(tmp_path: Path) -> None:
    store = PreparedStore(state_dir(tmp_path))
    store.write(prep(vf()))
    with open(store.path(UID), "w") as f:
        f.write("{not json")
    for read in (lambda: store.get(UID), store.all, lambda: holdings(store.state_dir)):
        with pytest.raises(IOFailure) as exc:
            read()
        assert exc.value.code == 5 and "is corrupt" in exc.value.msg
    # A record under another claim's name is no record of that claim.
    os.unlink(store.path(UID))
    other = "8e429df2-3685-44e6-88ec-31a0f2e3d8c7"
    with open(os.path.join(store.dir, f"{other}.json"), "w") as f:
        f.write(prep(vf()).to_json())
    with pytest.raises(IOFailure, match=r"names claim .* not its file's"):
        store.all()


def test_a_directory_that_cannot_be_read_or_written(tmp_path: Path) -> None:
    base = state_dir(tmp_path)
    store = PreparedStore(base)
    # A file where the directory should be: listing and writing fail with code 5.
    Path(store.dir).write_text("")
    with pytest.raises(IOFailure, match="cannot list DRA preparations"):
        store.all()
    with pytest.raises(IOFailure):
        store.write(prep(vf()))
    with pytest.raises(IOFailure, match="cannot remove DRA preparation"):
        os.unlink(store.dir)
        os.makedirs(os.path.join(store.dir, f"{UID}.json"))
        store.delete(UID)
    with pytest.raises(IOFailure, match="cannot read DRA preparation"):
        store.get(UID)


# -- ADD's choice


def netconf(tmp_path: Path) -> Any:
    return load_netconf(
        {
            "cniVersion": "1.1.0",
            "name": "rdma-dra",
            "type": "rdma-cni",
            "dra": True,
            "pfs": ["ens1f0"],
            "stateDir": state_dir(tmp_path),
            "lockFile": str(tmp_path / "lock"),
        }
    )


def env(pod: PodRef | None) -> CniEnv:
    args = {}
    if pod is not None:
        args = {"K8S_POD_NAMESPACE": pod.namespace, "K8S_POD_NAME": pod.name}
        if pod.uid:
            args["K8S_POD_UID"] = pod.uid
    return CniEnv(command="ADD", container_id="ctr1", netns="/run/netns/x", ifname="net1", args=args)


def test_a_pod_is_found_by_uid_else_by_name(tmp_path: Path) -> None:
    conf = netconf(tmp_path)
    store = PreparedStore(conf.stateDir)
    store.write(prep(vf("if0", index=0, min_tx_rate=7000, max_tx_rate=9000, name="net1"), vf("if1", index=1)))
    store.write(prep(vf("if0", index=2, network="other"), uid="u2", claim="b"))
    store.write(prep(vf("if0", index=3), uid="u3", claim="a", pod=("q", "q-uid")))
    request, source = dra.prepared_request(env(PodRef("ml", "p", "pod-uid")), conf)
    # One claim's VFs in the order prepare wrote them (the claim's requests'); another network's are not
    # this attachment's, nor another pod's.
    assert [(i.min_tx_rate, i.max_tx_rate, i.name) for i in request.interfaces] == [
        (7000, 9000, "net1"),
        (1000, 0, None),
    ]
    assert "DRA claim(s) c (prepared)" in source
    by_name, _ = dra.prepared_request(env(PodRef("ml", "p", "")), conf)
    assert by_name == request
    with pytest.raises(InvalidPodRequest, match="has no prepared DRA claim on network rdma-dra"):
        dra.prepared_request(env(PodRef("other-ns", "p", "pod-uid")), conf)
    with pytest.raises(InvalidPodRequest, match="ADD needs the pod"):
        dra.prepared_request(env(None), conf)


def test_names_that_clash_across_claims_are_code_101(tmp_path: Path) -> None:
    conf = netconf(tmp_path)
    store = PreparedStore(conf.stateDir)
    store.write(prep(vf("if0", index=0), vf("if1", index=1, name="data")))
    store.write(prep(vf("if0", index=2, name="data"), uid="u2", claim="d"))
    with pytest.raises(InvalidPodRequest, match="interface names must be unique"):
        dra.prepared_request(env(PodRef("ml", "p", "pod-uid")), conf)


class Finder:
    def __init__(self, home: set[str]) -> None:
        self.home = home

    def in_host(self, pci: str, name: str | None = None) -> Any:
        return type("Link", (), {"name": f"host-{pci[-4:]}"})() if pci in self.home else None


def node(*indices: int) -> Node:
    pf = Pf("ens1f0", "0000:3b:00.0", 0, 25000, "speed", 8)
    pf.vfs = [Vf("ens1f0", i, f"0000:3b:0{i}.0", f"v{i}", "mlx5_core", [], None) for i in indices]
    return Node([pf])


def test_take_hands_exactly_the_prepared_vfs_or_says_why(tmp_path: Path) -> None:
    conf = netconf(tmp_path)
    PreparedStore(conf.stateDir).write(prep(vf("if0", index=0), vf("if1", index=1)))
    records = RecordStore(conf.stateDir)
    pod = env(PodRef("ml", "p", "pod-uid"))
    chosen = dra.take(node(0, 1, 2), pod, conf, Finder({"0000:3b:00.0", "0000:3b:01.0"}), records, 2)  # type: ignore[arg-type]
    assert [(v.index, v.netdev) for v in chosen] == [(0, "host-00.0"), (1, "host-01.0")]
    with pytest.raises(StateError, match="changed during ADD"):
        dra.take(node(0, 1), pod, conf, Finder(set()), records, 3)  # type: ignore[arg-type]
    with pytest.raises(NoCapacity, match="is not on this node's network rdma-dra any more"):
        dra.take(node(0), pod, conf, Finder({"0000:3b:00.0"}), records, 2)  # type: ignore[arg-type]
    with pytest.raises(NoCapacity, match="is not proven to be in the host"):
        dra.take(node(0, 1), pod, conf, Finder({"0000:3b:00.0"}), records, 2)  # type: ignore[arg-type]


def test_the_prepared_directory_is_named() -> None:
    assert DIRECTORY == "prepared"

"""The NRI plugin's choice of devices on the simulated node: records from ADD, VFs proven in real netns."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from rdma_cni.agent.nri import plugin
from tests.integration.conftest import Cluster, plugin_command
from tests.support.coldstart import AGENT_ONLY, LONG_RUNNING_ONLY, loaded_from, traced_modules


def give_rdma_devices(cluster: Cluster) -> dict[str, str]:
    """A fake RDMA device and uverbs node for every VF (as the kernel would show them); pci -> uverbs path."""
    sysfs = cluster.node.sysfs
    out = {}
    for n, (k, i) in enumerate(cluster.node.all_vfs()):
        pci = cluster.node.vf_pci(k, i)
        vf_dir = os.path.join(sysfs, "bus", "pci", "devices", pci)
        dev = f"mlx5_{n}"
        os.makedirs(os.path.join(vf_dir, "infiniband", dev))
        ib = os.path.join(sysfs, "class", "infiniband", dev)
        os.makedirs(ib)
        os.symlink(vf_dir, os.path.join(ib, "device"))
        verbs = os.path.join(sysfs, "class", "infiniband_verbs", f"uverbs{n}")
        os.makedirs(verbs)
        with open(os.path.join(verbs, "ibdev"), "w") as f:
            f.write(dev + "\n")
        with open(os.path.join(verbs, "dev"), "w") as f:
            f.write(f"231:{192 + n}\n")
        out[pci] = f"/dev/infiniband/uverbs{n}"
    return out


def recorded_pcis(cluster: Cluster, container_id: str) -> list[str]:
    with open(os.path.join(cluster.state_dir, "attachments", f"{container_id}@net1.json")) as f:
        return [vf["pci"] for vf in json.load(f)["vfs"]]


def test_each_pod_gets_exactly_the_devices_of_the_vfs_the_kernel_shows_in_it(cluster: Cluster) -> None:
    conf = cluster.conf()
    alpha = cluster.pod([{"min_tx_rate": 1000}, {}], name="alpha")
    beta = cluster.pod([{}], name="beta")
    plain = cluster.pod(None, name="plain")
    assert cluster.run("ADD", alpha, conf).ok
    assert cluster.run("ADD", beta, conf).ok
    uverbs = give_rdma_devices(cluster)
    devices = plugin.PodDevices([cluster.state_dir])

    for pod in (alpha, beta):
        got = [d.path for d in devices(pod["CNI_CONTAINERID"])]
        assert got == sorted(uverbs[p] for p in recorded_pcis(cluster, pod["CNI_CONTAINERID"]))
    assert devices(plain["CNI_CONTAINERID"]) == []

    # A record (say, hand-made) naming a VF that sits in the host, with another pod's namespace:
    # the kernel does not show that VF there, so the record yields nothing.
    taken = {p for pod in (alpha, beta) for p in recorded_pcis(cluster, pod["CNI_CONTAINERID"])}
    free = next(p for p in uverbs if p not in taken)
    with open(os.path.join(cluster.state_dir, "attachments", f"{alpha['CNI_CONTAINERID']}@net1.json")) as f:
        doc = json.load(f)
    doc["container_id"] = "ghost"
    doc["vfs"][0]["pci"] = free
    doc["vfs"] = doc["vfs"][:1]
    with open(os.path.join(cluster.state_dir, "attachments", "ghost@net1.json"), "w") as f:
        json.dump(doc, f)
    assert devices("ghost") == []
    os.unlink(os.path.join(cluster.state_dir, "attachments", "ghost@net1.json"))

    assert cluster.run("DEL", alpha, conf).ok
    assert devices(alpha["CNI_CONTAINERID"]) == []


def pod_ifindex(netns: str, name: str = "net1") -> int:
    """The ifindex the kernel gives the pod's ``name`` link in its namespace."""
    from rdma_cni.kernel.netns import Netns

    ns = Netns(netns)
    try:
        return next(link.index for link in ns.rtnl.links() if link.name == name)
    finally:
        ns.close()


def test_soft_rdma_devices_follow_the_kernels_port_to_netdev_tie_in_the_pod(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This host has no RDMA netlink; the fake kernel answers at the socket boundary, keyed by the
    # real namespace each socket was opened in (the QEMU tier shows rxe on a real kernel).
    from rdma_cni.kernel import rdma
    from tests.support.fake_rdma import FakeDevice, FakeRdmaKernel

    conf = cluster.conf()
    alpha = cluster.pod([{}], name="alpha")
    beta = cluster.pod([{}], name="beta")
    assert cluster.run("ADD", alpha, conf).ok
    assert cluster.run("ADD", beta, conf).ok
    idx_alpha = pod_ifindex(alpha["CNI_NETNS"])
    # A decoy the pod made itself (CAP_NET_ADMIN in its namespace is enough): not a VF.
    subprocess.run(
        ["ip", "-n", os.path.basename(alpha["CNI_NETNS"]), "link", "add", "fake0", "type", "veth",
         "peer", "name", "fake1"],
        check=True,
    )  # fmt: skip
    idx_decoy = pod_ifindex(alpha["CNI_NETNS"], "fake0")
    kernel = FakeRdmaKernel(
        [
            FakeDevice(1, "rxe_alpha", netdev_index=idx_alpha, netdev_netns=alpha["CNI_NETNS"]),
            FakeDevice(
                2, "rxe_beta", netdev_index=pod_ifindex(beta["CNI_NETNS"]), netdev_netns=beta["CNI_NETNS"]
            ),
            FakeDevice(3, "rxe_decoy", netdev_index=idx_decoy, netdev_netns=alpha["CNI_NETNS"]),
        ],
        mode="shared",
    )
    for pod in (alpha, beta):
        kernel.netns_label(pod["CNI_NETNS"])
    monkeypatch.setattr(rdma, "open_rdma_socket", kernel.open_socket)
    sysfs = cluster.node.sysfs
    for n, dev in enumerate(("rxe_alpha", "rxe_beta", "rxe_decoy")):
        # Soft devices: no PCI parent, so no device link; only ibdev names them.
        verbs = os.path.join(sysfs, "class", "infiniband_verbs", f"uverbs{n}")
        os.makedirs(verbs)
        with open(os.path.join(verbs, "ibdev"), "w") as f:
            f.write(dev + "\n")
        with open(os.path.join(verbs, "dev"), "w") as f:
            f.write(f"231:{192 + n}\n")
    devices = plugin.PodDevices([cluster.state_dir])

    assert [d.path for d in devices(alpha["CNI_CONTAINERID"])] == ["/dev/infiniband/uverbs0"]
    assert [d.path for d in devices(beta["CNI_CONTAINERID"])] == ["/dev/infiniband/uverbs1"]
    # Every question was asked inside a pod's own namespace.
    assert {s.netns for s in kernel.sockets} == {alpha["CNI_NETNS"], beta["CNI_NETNS"]}


@pytest.mark.skipif(not os.environ.get("RDMA_CNI_BINARY"), reason="watches the built binary's imports")
def test_a_cold_add_and_del_load_neither_the_nri_plugin_nor_protobuf(cluster: Cluster) -> None:
    # The agent's NRI messages are generated protobuf code, packed in the same tree as the verbs:
    # a verb, on a node whose VFs have RDMA devices, never pays for them.
    conf = cluster.conf()
    pod = cluster.pod([{}], name="cold")
    give_rdma_devices(cluster)
    for command in ("ADD", "DEL"):
        modules = traced_modules(
            plugin_command(),
            json.dumps(conf).encode(),
            {**cluster.env(command, pod), "RDMA_CNI_WARM": "0"},
            os.path.join(cluster.tmp, f"{command}.trace"),
        )
        # The trace sees the verb's imports.
        assert {"rdma_cni.cli.main", "rdma_cni.kernel.netlink"} <= modules
        assert loaded_from(modules, AGENT_ONLY) == [], command
        if command == "ADD":
            # ADD reads its pod from the API stand-in, through the plugin's own GET only.
            assert "rdma_cni.kube.podget" in modules
            assert loaded_from(modules, LONG_RUNNING_ONLY) == []
    assert cluster.records == []

"""containerd 1.6 (Debian) over CRI: RunPodSandbox, a container listing its interfaces, StopPodSandbox,
RemovePodSandbox, with the pod's request read from the API server or passed by the runtime itself;
through the shim and the agent's CNI server (as shipped) and with the fat binary; and a sandbox
removed while the CNI server is down.

containerd calls no CHECK (its CRI has no call for it) and no GC.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rdma_cni.node import boot
from tests.runtime.conftest import Tier, dump
from tests.runtime.cri import CriClient, Pod
from tests.runtime.harness import (
    FAT,
    IMAGE,
    SHIM,
    Call,
    Containerd,
    Served,
    listed_addresses,
    netns_addresses,
)
from tests.runtime.images import oci_archive
from tests.support.apiserver import ApiServer
from tests.support.processes import wait_gone
from tests.support.simnode import ip
from tests.support.waiting import wait_for

CRI_KEY = "io.kubernetes.cri.pod-annotations"
ANNOTATION = "rdma_interfaces_required"
TWO = '[{"min_tx_rate": 1000, "max_tx_rate": 2000}, {}]'
CRI_ARGS_KEYS = {
    "IgnoreUnknown",
    "K8S_POD_NAMESPACE",
    "K8S_POD_NAME",
    "K8S_POD_INFRA_CONTAINER_ID",
    "K8S_POD_UID",
}


@pytest.fixture(params=["api", "cri"])
def source(request: pytest.FixtureRequest) -> str:
    """Where the plugin reads the pod's request: the API server, or the runtime's CRI annotations."""
    return str(request.param)


@pytest.fixture
def containerd(tier: Tier, api_server: ApiServer, source: str) -> Iterator[tuple[Containerd, CriClient]]:
    if source == "api":
        # No capability: containerd passes no annotations and the plugin asks the API server.
        kubeconfig = os.path.join(tier.root, "kubeconfig")
        api_server.write_kubeconfig(kubeconfig, mode="token")
        conflist = tier.conflist("rdma-rt", kubeconfig=kubeconfig)
    else:
        # The capability, and no kubeconfig at all: an API round trip would fail.
        conflist = tier.conflist("rdma-rt", capabilities={CRI_KEY: True})
    runtime = Containerd(
        os.path.join(tier.root, "containerd"), tier.plugin.bin_dir, conflist, tier.runtime_env()
    )
    client = None
    try:
        runtime.start()
        archive = os.path.join(tier.root, "busybox-oci.tar")
        oci_archive(archive, IMAGE, ["/bin/sleep", "2147483647"])
        runtime.ctr("images", "import", archive)
        client = CriClient(runtime.socket, os.path.join(tier.root, "cri-gen"))
        assert client.wait_ready().runtime_api_version == "v1"
        yield runtime, client
    finally:
        if client is not None:
            client.close()
        runtime.stop()


def new_pod(client: CriClient, tier: Tier, api: ApiServer, name: str, annotations: dict[str, str]) -> Pod:
    uid = str(uuid.uuid4())
    api.add_pod("team-a", name, annotations, uid=uid)
    log_dir = os.path.join(tier.root, "pods", name)
    os.makedirs(log_dir)
    return client.run_pod(name, "team-a", uid, annotations, log_dir)


def processes_in(netns: str) -> list[int]:
    """The processes in the network namespace at ``netns``."""
    st = os.stat(netns)
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ns = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue
            if (ns.st_dev, ns.st_ino) == (st.st_dev, st.st_ino):
                pids.append(int(entry))
    return pids


def calls_for(tier: Tier, pod: Pod) -> list[Call]:
    return [c for c in tier.plugin.calls() if c.container_id == pod.id]


# Both request sources as shipped (the shim); the fat binary once.
@pytest.mark.parametrize(("mode", "source"), [(SHIM, "api"), (SHIM, "cri"), (FAT, "api")])
def test_pods_under_containerd(
    tier: Tier, api_server: ApiServer, containerd: tuple[Containerd, CriClient], source: str
) -> None:
    _, client = containerd
    subnet = ipaddress.ip_network(tier.subnet)
    asked = new_pod(client, tier, api_server, "asks-two", {ANNOTATION: TWO, "team": "rdma"})
    plain = new_pod(client, tier, api_server, "asks-nothing", {})

    # ADD, as containerd ran it.
    for pod, interfaces in ((asked, ["eth0", "eth0-1"]), (plain, ["eth0"])):
        (add,) = calls_for(tier, pod)
        assert add.command == "ADD" and add.exit_code == 0, dump(add)
        assert add.ifname == "eth0" and add.path == tier.plugin.bin_dir
        assert set(add.cni_args) == CRI_ARGS_KEYS, add.args
        assert add.cni_args["K8S_POD_NAMESPACE"] == "team-a" and add.cni_args["K8S_POD_NAME"] == pod.name
        assert add.cni_args["K8S_POD_UID"] == pod.uid and add.cni_args["K8S_POD_INFRA_CONTAINER_ID"] == pod.id
        assert add.stdin is not None
        runtime_config: dict[str, Any] = add.stdin.get("runtimeConfig", {})
        if source == "cri":
            # All the pod's annotations; null for a pod that has none.
            expected = dict(pod.config.annotations) or None
            assert runtime_config == {CRI_KEY: expected}, dump(add.stdin)
        else:
            assert CRI_KEY not in runtime_config

        # The kernel's view of the sandbox, and the container's own.
        kernel = netns_addresses(add.netns)
        assert sorted(kernel) == sorted(["lo", *interfaces]), kernel
        assert all(
            len(kernel[i]) == 1 and ipaddress.ip_interface(kernel[i][0]).ip in subnet for i in interfaces
        ), kernel
        code, listing = client.run_to_completion(pod, "lister", IMAGE, ["/bin/ip", "-o", "-4", "addr"])
        assert code == 0, listing
        assert listed_addresses(listing) == kernel, listing

    assert len(tier.leases()) == 3 and len(tier.records()) == 2
    rates = sorted(tuple(s["rate"]) for s in tier.pf_settings().values() if any(s.get("rate", [0, 0])))
    assert rates == [(1000, 2000)]
    log = tier.plugin_log()
    if source == "cri":
        assert f"annotation {ANNOTATION} (from the runtime's annotations)" in log
        assert "defaultRequest (pod team-a/asks-nothing has no" in log
        assert api_server.request_count == 0
    else:
        assert f"pod team-a/asks-two annotation {ANNOTATION} (from the API server)" in log
        paths = sorted(r.path for r in api_server.requests_seen)
        assert paths == [
            "/api/v1/namespaces/team-a/pods/asks-nothing",
            "/api/v1/namespaces/team-a/pods/asks-two",
        ], paths

    # StopPodSandbox: DEL with the netns; RemovePodSandbox: DEL again without one.
    for pod in (asked, plain):
        client.stop_pod(pod)
    assert tier.host_vf_names() == tier.expected_vf_names()
    tier.assert_released()
    for pod in (asked, plain):
        client.remove_pod(pod)
        add, stop_del, remove_del = calls_for(tier, pod)
        assert (stop_del.command, stop_del.exit_code, stop_del.netns) == ("DEL", 0, add.netns)
        assert (remove_del.command, remove_del.exit_code, remove_del.netns) == ("DEL", 0, "")
        assert set(remove_del.cni_args) == CRI_ARGS_KEYS
    tier.assert_released()
    calls = tier.plugin.calls()
    tier.assert_ran_as_installed(calls)
    assert {c.command for c in calls} == {"ADD", "DEL"}  # no CHECK, no GC, no VERSION probe


@pytest.mark.parametrize(("mode", "source"), [(SHIM, "cri")])
@pytest.mark.parametrize("reboot", [False, True], ids=["agent-back", "spool-lost-in-reboot"])
def test_a_sandbox_removed_while_the_agent_is_down(
    tier: Tier, api_server: ApiServer, containerd: tuple[Containerd, CriClient], reboot: bool
) -> None:
    _, client = containerd
    pod = new_pod(client, tier, api_server, "asks-two", {ANNOTATION: TWO})
    (add,) = calls_for(tier, pod)
    assert add.exit_code == 0, dump(add.__dict__)
    held = tier.records()
    in_pod = tier.vfs_away()
    assert len(held) == 1 and len(in_pod) == 2 and len(tier.leases()) == 2

    # The agent goes (restarting, upgrading); kubelet stops and removes the sandbox meanwhile.
    tier.stop_server()
    client.stop_pod(pod)
    client.remove_pod(pod)
    # No plugin ran: the shim answered both DELs, spooled as one request.
    _, *dels = calls_for(tier, pod)
    assert [(d.command, d.exit_code, d.spooled) for d in dels] == [("DEL", 0, True)] * 2, dump(dels)
    assert len(tier.spooled()) == 1
    assert tier.records() == held  # its VFs stay held until a DEL runs
    tier.namespace_gone(in_pod, reboot=reboot)
    if reboot:
        # /run is a tmpfs: the spool is gone with the reboot, the records (/var/lib) are not.
        for name in os.listdir(tier.spool):
            os.unlink(os.path.join(tier.spool, name))
        # What a reboot changes that a test cannot: the kernel's boot id. The record (and the
        # state directory's note of the boot it last checked) carry an earlier boot's instead.
        of_an_earlier_boot(tier, held)

    tier.start_server()
    if not reboot:
        # The agent runs the spool as it starts: the VFs home under their names, record and leases gone.
        wait_for(lambda: not tier.records(), 60, "the spooled DEL to run")
        *_, spooled = tier.served()
        assert spooled == Served("DEL", pod.id, "eth0", "spooled", 0), tier.server_log()
        assert "ran the spooled DEL" in tier.server_log()
        assert tier.spooled() == []
        tier.assert_released()
        return

    # Nothing left to run, and containerd has forgotten the sandbox: it never sends another DEL,
    # and calls no GC. The CNI server's start releases the record of the earlier boot, with the
    # IPAM configuration and CNI_PATH the record keeps: no DEL, no GC, no verb of any network.
    assert tier.records() == [], tier.server_log()
    assert {s.command for s in tier.served()} == {"ADD"}  # no DEL, no GC ran
    assert "records of earlier boots" in tier.server_log() and '"released": [' in tier.server_log()
    tier.assert_released()


def of_an_earlier_boot(tier: Tier, records: list[str]) -> None:
    """The records written in an earlier boot, whose records were all checked then."""
    earlier = str(uuid.uuid4())
    for name in records:
        path = os.path.join(tier.state_dir, "attachments", name)
        with open(path) as f:
            doc = json.load(f)
        assert doc["boot_id"] == boot.boot_id()
        doc["boot_id"] = earlier
        with open(path, "w") as f:
            json.dump(doc, f)
    with open(os.path.join(tier.state_dir, boot.MARKER), "w") as f:
        f.write(earlier + "\n")


@pytest.mark.parametrize(("mode", "source"), [(SHIM, "cri")])
def test_a_reboot_with_the_sandbox_still_known(
    tier: Tier, api_server: ApiServer, containerd: tuple[Containerd, CriClient]
) -> None:
    runtime, client = containerd
    pod = new_pod(client, tier, api_server, "asks-two", {ANNOTATION: TWO})
    (add,) = calls_for(tier, pod)
    assert add.exit_code == 0, dump(add.__dict__)
    held = tier.records()
    in_pod = tier.vfs_away()
    assert len(held) == 1 and len(in_pod) == 2

    # The reboot: what lives in memory and on /run goes (processes, the sandbox's namespace,
    # containerd's state, the spool); containerd's root and the records stay.
    tier.stop_server()
    sandbox = processes_in(add.netns)
    runtime.stop()
    for pid in sandbox:  # containerd's shims are gone, the sandbox's own process is not
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert wait_gone(sandbox, timeout=20), f"the sandbox processes {sandbox} did not go"
    ip("netns", "del", os.path.basename(add.netns))
    shutil.rmtree(os.path.join(runtime.root, "state"))
    tier.namespace_gone(in_pod, reboot=True)
    runtime.start()
    client.wait_ready()

    # kubelet finds the old sandbox not ready and stops it, before the agent is up: containerd
    # sends DEL with CNI_NETNS empty (the namespace is gone), and the shim spools it.
    client.stop_pod(pod)
    client.remove_pod(pod)
    _, *dels = calls_for(tier, pod)
    assert dels and all(d.spooled and d.exit_code == 0 for d in dels), dump([d.__dict__ for d in dels])
    assert len(tier.spooled()) == 1
    assert tier.records() == held
    tier.start_server()
    wait_for(lambda: not tier.records(), 60, "the spooled DEL to run")
    *_, spooled = tier.served()
    assert spooled == Served("DEL", pod.id, "eth0", "spooled", 0), tier.server_log()
    assert tier.spooled() == []
    tier.assert_released()

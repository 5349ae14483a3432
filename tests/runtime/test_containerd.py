"""containerd 1.6 (Debian) over CRI: RunPodSandbox, a container listing its interfaces, StopPodSandbox,
RemovePodSandbox, with the pod's request read from the API server or passed by the runtime itself.
"""

from __future__ import annotations

import ipaddress
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.runtime.conftest import Tier, dump
from tests.runtime.cri import CriClient, Pod
from tests.runtime.harness import IMAGE, Call, Containerd, listed_addresses, netns_addresses
from tests.runtime.images import oci_archive
from tests.support.apiserver import ApiServer

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
    runtime = Containerd(os.path.join(tier.root, "containerd"), tier.plugin.bin_dir, conflist)
    client = None
    try:
        runtime.start()
        archive = os.path.join(tier.root, "busybox-oci.tar")
        oci_archive(archive, IMAGE, ["/bin/sleep", "2147483647"])
        runtime.ctr("images", "import", archive)
        client = CriClient(runtime.socket, os.path.join(tier.root, "cri-gen"))
        assert client.version().runtime_api_version == "v1"
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


def calls_for(tier: Tier, pod: Pod) -> list[Call]:
    return [c for c in tier.plugin.calls() if c.container_id == pod.id]


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

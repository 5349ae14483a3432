"""The node tier's machinery without a node: its build (``build_components.sh --node``), the
binaries' lookup, and what the tier changes in conf/base/node/daemonset.yaml (its image line only)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.support.kube.process import ComponentFailed
from tests.support.node import node as nodesupport
from tests.support.node.host import Addresses

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build_components.sh"
NODE = (
    "kubelet",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "multus-daemon",
    "multus-shim",
    "multus",
    "install_multus",
    "thin_entrypoint",
    "passthru",
    "crictl",
    "pause",
)


def _run(cache: Path, *args: str, go: str = "/bin/false") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RDMA_CNI_BUILD_CACHE": str(cache), "GO": go}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def _pinned(module: str, path: str) -> str:
    for line in (REPO / "gobuild" / module / "go.mod").read_text().splitlines():
        words = line.split("//")[0].replace("require", "").split()
        if len(words) == 2 and words[0] == path:
            return words[1]
    raise AssertionError(f"{path} is not pinned in gobuild/{module}/go.mod")


def test_list_names_the_nodes_components_at_their_pins_without_building(tmp_path: Path) -> None:
    out = _run(tmp_path / "cache", "--list", "--node")
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert [name for name, _, _ in lines] == list(NODE)
    pins = {
        "kubelet": _pinned("kube", "k8s.io/kubernetes"),
        "containerd": _pinned("containerd", "github.com/containerd/containerd/v2"),
        "multus": _pinned("multus", "gopkg.in/k8snetworkplumbingwg/multus-cni.v4"),
        "crictl": _pinned("crictl", "sigs.k8s.io/cri-tools"),
    }
    # containerd 2.x, Multus v4.3 or later (kubelet is the control plane's pin by construction).
    assert pins["containerd"].startswith("v2.") and pins["multus"] >= "v4.3.0"
    for name, version, path in lines:
        group = {"containerd-shim-runc-v2": "containerd", "ctr": "containerd"}.get(name, name)
        group = "multus" if name in nodesupport.images.MULTUS_BINARIES else group
        if group in pins:
            assert version == pins[group], name
        assert path == str(tmp_path / "cache" / f"{name}-{version}" / name)
    assert not (tmp_path / "cache").exists()


def test_a_warm_node_cache_builds_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    listed = _run(cache, "--list", "--node").stdout.split("\n")
    for line in filter(None, listed):
        path = Path(line.split()[2])
        path.parent.mkdir(parents=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    out = _run(cache, "--node")  # GO=/bin/false: any build would fail
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n") == listed


def test_a_failed_node_build_fails_and_leaves_nothing_that_looks_built(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    out = _run(cache, "--node")
    assert out.returncode == 1 and "the node's build failed" in out.stderr
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_a_missing_node_component_names_make_node_components(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RDMA_CNI_BUILD_CACHE", str(tmp_path))
    with pytest.raises(ComponentFailed, match=r"is not built .*run `make node-components`"):
        nodesupport.node_binaries()


def test_the_daemonset_is_applied_with_only_its_image_changed() -> None:
    shipped = (REPO / "conf" / "base/node/daemonset.yaml").read_text()
    applied = nodesupport.shipped_daemonset("localhost/other:1")
    diff = [(a, b) for a, b in zip(shipped.splitlines(), applied.splitlines(), strict=True) if a != b]
    assert diff == [(f"          image: {nodesupport.SHIPPED_IMAGE}", "          image: localhost/other:1")]


def test_the_runs_addresses_are_loopback_and_the_apiserver_is_the_service_ranges_first() -> None:
    import ipaddress

    addresses = Addresses.for_run()
    service = ipaddress.ip_network(addresses.service_range)
    assert ipaddress.ip_address(addresses.apiserver) == next(service.hosts())
    for address in (addresses.apiserver, addresses.node):
        assert ipaddress.ip_address(address).is_loopback
    assert ipaddress.ip_address(addresses.node) not in service

"""podman 4.3 (Debian) with the CNI network backend: libcni's VERSION probe, run with a MAC, exec, rm;
through the shim and ``rdma-cni cni-server`` (docs/deploy.md, the shim without Kubernetes) and with
the fat binary; and a container removed while the CNI server is down.

podman calls no CHECK (its CNI backend sets up and tears down only) and no GC.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Iterator

import pytest

from tests.runtime.conftest import Tier, dump
from tests.runtime.harness import FAT, PODMAN_IMAGE, SHIM, Podman, Served, listed_addresses, netns_addresses
from tests.runtime.images import rootfs_tar
from tests.support.waiting import wait_for

NETWORK = "rdma-rt"
# Within this sandbox's hard limits; podman's defaults exceed them.
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


@pytest.fixture
def podman(tier: Tier) -> Iterator[Podman]:
    # podman passes only the container's name: the request comes from the config's args.
    entry = {"args": {"cni": {"rdma_interfaces_required": [{"min_tx_rate": 1000, "max_tx_rate": 3000}, {}]}}}
    conflist = tier.conflist(NETWORK, **entry)
    runtime = Podman(os.path.join(tier.root, "podman"), tier.plugin.bin_dir, conflist, tier.runtime_env())
    try:
        rootfs = os.path.join(tier.root, "rootfs.tar")
        with open(rootfs, "wb") as f:
            f.write(rootfs_tar())
        runtime("import", "--change", 'CMD ["/bin/sleep", "2147483647"]', rootfs, PODMAN_IMAGE)
        yield runtime
    finally:
        runtime.stop()


@pytest.mark.parametrize("mode", [SHIM, FAT])
def test_container_under_podman(tier: Tier, podman: Podman) -> None:
    networks = json.loads(podman("network", "ls", "--format", "json").stdout)
    assert NETWORK in [n["name"] for n in networks]  # the VERSION probe passed: the network is usable
    name = f"{tier.node.prefix}c"
    mac = "02:13:00:00:00:01"
    podman("run", "-d", "--name", name, "--network", f"{NETWORK}:mac={mac}", *ULIMITS, PODMAN_IMAGE)

    calls = tier.plugin.calls()
    probes = [c for c in calls if c.command == "VERSION"]
    assert probes and all(
        (c.netns, c.ifname, c.path, c.exit_code) == ("dummy", "dummy", "dummy", 0) for c in probes
    ), dump([c.__dict__ for c in probes])
    (add,) = [c for c in calls if c.command == "ADD"]
    assert add.exit_code == 0 and add.ifname == "eth0", dump(add.__dict__)
    assert add.cni_args == {"IgnoreUnknown": "1", "K8S_POD_NAME": name, "MAC": mac}, add.args
    assert tier.plugin.bin_dir in add.path.split(":")
    assert add.stdin is not None and "runtimeConfig" not in add.stdin

    # The kernel's view of the container's netns, and the container's own.
    kernel = netns_addresses(add.netns)
    subnet = ipaddress.ip_network(tier.subnet)
    assert sorted(kernel) == ["eth0", "eth0-1", "lo"], kernel
    assert all(ipaddress.ip_interface(kernel[i][0]).ip in subnet for i in ("eth0", "eth0-1")), kernel
    listing = podman("exec", name, "ip", "-o", "-4", "addr").stdout
    assert listed_addresses(listing) == kernel, listing
    link = podman("exec", name, "ip", "-o", "link", "show", "eth0").stdout
    assert f"link/ether {mac} " in link, link
    assert mac in [s.get("mac") for s in tier.pf_settings().values()]  # PF-side too
    rates = [tuple(s["rate"]) for s in tier.pf_settings().values() if any(s.get("rate", [0, 0]))]
    assert rates == [(1000, 3000)]
    assert len(tier.records()) == 1 and len(tier.leases()) == 2
    assert "pod request from config args.cni.rdma_interfaces_required" in tier.plugin_log()

    # busybox as PID 1 ignores SIGTERM: -t 0 kills at once.
    podman("rm", "-f", "-t", "0", name)
    dels = [c for c in tier.plugin.calls() if c.command == "DEL"]
    assert dels and all(d.exit_code == 0 and d.container_id == add.container_id for d in dels)
    assert dels[0].netns == add.netns and dels[0].cni_args == add.cni_args
    tier.assert_released()
    calls = tier.plugin.calls()
    tier.assert_ran_as_installed(calls)
    assert {c.command for c in calls} == {"VERSION", "ADD", "DEL"}  # no CHECK, no GC


def test_a_container_removed_while_the_agent_is_down(tier: Tier, podman: Podman) -> None:
    name = f"{tier.node.prefix}c"
    podman("run", "-d", "--name", name, "--network", NETWORK, *ULIMITS, PODMAN_IMAGE)
    (add,) = [c for c in tier.plugin.calls() if c.command == "ADD"]
    assert add.exit_code == 0, dump(add.__dict__)
    held = tier.records()
    in_pod = tier.vfs_away()
    assert len(held) == 1 and len(in_pod) == 2

    tier.stop_server()
    # The container stops (killed here): the podman process conmon starts to clean up after it runs
    # the DEL, and the shim spools it; then the container is removed.
    podman("kill", name)
    (spooled_file,) = wait_for(tier.spooled, 60, "the DEL of podman's clean-up to be spooled")
    assert spooled_file.startswith(f"del-{add.container_id}-")
    podman("rm", "-f", "-t", "0", name)
    # No plugin ran the DELs: the shim spooled them (podman's clean-up's, and its removal's if any).
    assert [s.command for s in tier.served() if s.command != "VERSION"] == ["ADD"]
    dels = [c for c in tier.plugin.calls() if c.command == "DEL"]
    assert dels and all(d.spooled and d.exit_code == 0 for d in dels), dump([d.__dict__ for d in dels])
    assert tier.spooled() == [spooled_file] and tier.records() == held
    tier.namespace_gone(in_pod, reboot=False)

    tier.start_server()
    wait_for(lambda: not tier.records(), 60, "the spooled DEL to run")
    spooled = tier.served()[-1]
    assert spooled == Served("DEL", add.container_id, add.ifname, "spooled", 0), tier.server_log()
    assert "ran the spooled DEL" in tier.server_log()
    assert tier.spooled() == []
    tier.assert_released()

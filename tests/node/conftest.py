"""Fixtures of the node tier: one real node (kubelet, containerd 2.x, Multus, rdma-cni's DaemonSet).

One node per session (bringing it up costs a few minutes on the shared 2-core machine); each
test works in a namespace of its own and leaves the node as it found it: every VF home, no
record, no lease (:func:`node_at_rest`). Needs root, ``make build``, ``make components`` and
``make node-components``; ``make node`` runs it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.node import host
from tests.support.node.node import Node, bring_up, prepare, tear_down, wait_agent_ready
from tests.support.simnode import SimNode
from tests.support.waiting import wait_for

if os.geteuid() != 0:
    pytest.skip("the node tier needs root (mount namespaces, cgroups, veths)", allow_module_level=True)
_missing = [t for t in ("podman", "runc", "mount", "ip") if not shutil.which(t)]
if _missing:
    pytest.fail(f"the node tier needs {_missing}: run make deps", pytrace=False)

_names = itertools.count()


def unique(prefix: str) -> str:
    """A name no other test of this session uses."""
    return f"{prefix}-{next(_names)}"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def node() -> Iterator[Node]:
    """The node, up (its DaemonSets Ready, the agent's state published, rdma-scheduler serving)."""
    # A SIGTERM (a CI timeout) tears the node down too: its shims and containers would outlive
    # this process otherwise, and keep its namespace, cgroups and the sysctls kubelet set.
    signal.signal(signal.SIGTERM, _interrupt)
    machine = host.machine_root()
    before = host.host_plugin_state(machine)
    # Short: the node's sockets (containerd's shims, NRI) live below it in /run.
    root = tempfile.mkdtemp(prefix="rcni-node-", dir="/tmp")
    up: Node | None = None
    try:
        up = prepare(root)
        bring_up(up)
        yield up
    finally:
        problems = tear_down(up, machine, before) if up is not None else []
        os.close(machine)
        if os.environ.get("RDMA_CNI_NODE_KEEP"):
            print(f"node tier: kept {root}")
        else:
            host.remove_tree(root)
        assert not problems, "the node tier did not clean up: " + "; ".join(problems)


@pytest.fixture
def namespace(node: Node) -> Iterator[str]:
    """A namespace of the test's own, deleted (with its pods) after it."""
    name = unique("node-test")
    node.kubectl("create", "namespace", name)
    wait_for(
        lambda: node.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        60,
        f"the default service account of {name}",
    )
    yield name
    node.kubectl("delete", "namespace", name, "--wait=true", "--timeout=180s", check=False)
    # The API forgets a pod before its sandbox's DELs are done: the next test starts at rest. One
    # that left something held errors here, and the node is put back at rest for the next.
    try:
        wait_at_rest(node, 180)
    except AssertionError:
        release_as_a_reboot_would(node)
        raise


def release_as_a_reboot_would(node: Node) -> None:
    """Release whatever the node still holds as its next boot would: VFs whose namespace went
    back in the host, every record marked as an earlier boot's, the agent restarted (its start
    releases them)."""
    gone = [(k, i) for k, i in node.sim.all_vfs() if node.sim.vf_wire(k, i) not in SimNode.host_links()]
    node.vfs_back_from_gone_namespaces(gone, reboot=False)
    node.mark_as_an_earlier_boot()
    for agent in node.agent_pods():
        node.kubectl("delete", "pod", agent["metadata"]["name"], "-n", "kube-system", "--wait=true")
    wait_agent_ready(node)
    wait_at_rest(node, 120)


def held(node: Node) -> dict[str, Any]:
    """What the node still holds for pods (empty when at rest): records, leases of any network
    (the default one's included), VFs away from home, PF-side rates left set."""
    out: dict[str, Any] = {}
    if node.records():
        out["records"] = node.records()
    if os.path.isdir("/var/lib/cni/networks"):
        leases = {net: node.leases(net) for net in os.listdir("/var/lib/cni/networks")}
        if any(leases.values()):
            out["leases"] = {net: got for net, got in leases.items() if got}
    away = sorted(node.all_vfs() - node.vfs_home())
    if away:
        out["vfs away"] = away
    rates = {key: s["rate"] for key, s in node.pf_settings().items() if s.get("rate", [0, 0]) != [0, 0]}
    if rates:
        out["rates"] = rates
    return out


def wait_at_rest(node: Node, timeout: float = 90) -> None:
    """Wait until the node holds nothing for any pod; fail saying what it still holds."""
    try:
        wait_for(lambda: not held(node), timeout, "the node at rest")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: still held {held(node)}") from None

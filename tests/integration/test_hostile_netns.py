"""CNI_NETNS that is not a pod's network namespace: refused at once, the node untouched (issue 16, item 6)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.integration.conftest import Cluster, assert_node_pristine, host_names
from tests.support.hostview import changed_links, host_links


@pytest.fixture
def host_bind_mount(cluster: Cluster) -> Iterator[str]:
    """A bind mount of the host's own network namespace, as `ip netns` would make for a pod."""
    path = os.path.join(cluster.tmp, "hostns")
    open(path, "w").close()
    subprocess.run(["mount", "--bind", "/proc/self/ns/net", path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=False)


def _special(cluster: Cluster, kind: str) -> str:
    path = os.path.join(cluster.tmp, kind)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "file":
        with open(path, "w") as f:
            f.write("not a namespace\n")
    elif kind == "dir":
        os.mkdir(path)
    return path


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("fifo", "not a network namespace"),
        ("file", "not a network namespace"),
        ("dir", "not a network namespace"),
        ("/proc/self/ns/mnt", "not a network namespace"),
        ("/proc/self/ns/net", "own"),
        ("/dev/null", "not a network namespace"),
        ("bind", "own"),
    ],
)
def test_add_refuses_what_is_not_a_pod_netns(
    cluster: Cluster, request: pytest.FixtureRequest, kind: str, needle: str
) -> None:
    if kind == "bind":
        netns = request.getfixturevalue("host_bind_mount")
    elif kind.startswith("/"):
        netns = kind
    else:
        netns = _special(cluster, kind)
    pod = {**cluster.pod([{"max_tx_rate": 1000}]), "CNI_NETNS": netns}
    before = host_links(cluster.node.prefix)
    started = time.monotonic()
    out = cluster.run("ADD", pod, cluster.conf(), timeout=30)
    assert time.monotonic() - started < 20  # a FIFO used to block forever
    assert out.doc is not None and out.doc["code"] == 4, out.doc
    assert "CNI_NETNS" in out.doc["msg"] and needle in out.doc["msg"], out.doc
    assert cluster.node.vf_state()["calls"] == []
    assert_node_pristine(cluster)
    assert changed_links(before, host_links(cluster.node.prefix)) == []


def test_missing_netns_is_still_code_3(cluster: Cluster) -> None:
    pod = {**cluster.pod([{}]), "CNI_NETNS": os.path.join(cluster.tmp, "gone")}
    out = cluster.run("ADD", pod, cluster.conf())
    assert out.doc is not None and out.doc["code"] == 3, out.doc
    assert_node_pristine(cluster)


def test_check_and_del_with_a_fifo_netns_do_not_block(cluster: Cluster) -> None:
    pod = cluster.pod([{}])
    conf = cluster.conf()
    add = cluster.run("ADD", pod, conf)
    assert add.ok and add.doc is not None, add.doc
    fifo = {**pod, "CNI_NETNS": _special(cluster, "fifo")}
    check = cluster.run("CHECK", fifo, cluster.check_conf(conf, add.doc), timeout=30)
    assert check.doc is not None and check.doc["code"] == 4, check.doc
    # DEL with an unusable CNI_NETNS must still end (the record names the real one).
    assert cluster.run("DEL", fifo, conf, timeout=30).ok
    assert cluster.run("DEL", pod, conf).ok
    assert_node_pristine(cluster)
    assert host_names(cluster)

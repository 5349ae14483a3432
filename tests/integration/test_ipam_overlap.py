"""IPAM that never looks at the pod's interface runs while the VF moves; every other type after it.

The order is proven without timing: the IPAM plugin is a wrapper on CNI_PATH
(named like the real type) that records what it sees and then hands over to
Debian's host-local, and the plugin's move is wrapped (in-process) to wait
for the wrapper, or to tell it when the move is done. With IPAM started
before the move, the wrapper runs while the move waits for it; started after,
the wrapped move gives up waiting and the wrapper sees the moved interface.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from rdma_cni.cni.errors import KernelError
from rdma_cni.node import attach
from tests.integration.conftest import Cluster, addresses_in, assert_node_pristine, ns_name, use_ipam
from tests.support.fake_ipam import HOST_LOCAL


def _wait_for(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _recording_ipam(cluster: Cluster, name: str) -> tuple[dict[str, Any], dict[str, str]]:
    """IPAM ``name``: ADD notes whether its interface is already in the pod, then marks its start;
    DEL marks its start, then waits (up to 5 s) for the plugin's move home and notes whether it saw
    it end while DEL was still running. Both then run host-local."""
    files = {
        k: os.path.join(cluster.tmp, f"order-{k}")
        for k in ("add-saw", "add-started", "del-saw", "del-started", "moved-home")
    }
    add = (
        f'if nsenter --net="$CNI_NETNS" ip link show dev "$CNI_IFNAME" >/dev/null 2>&1; '
        f"then echo in-pod > {files['add-saw']}; else echo not-in-pod > {files['add-saw']}; fi; "
        f"touch {files['add-started']}; exec {HOST_LOCAL}"
    )
    delete = (
        f"touch {files['del-started']}; i=0; "
        f"while [ ! -e {files['moved-home']} ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done; "
        f"if [ -e {files['moved-home']} ]; then echo during-move > {files['del-saw']}; "
        f"else echo not-during-move > {files['del-saw']}; fi; exec {HOST_LOCAL}"
    )
    return use_ipam(cluster, name, {"ADD": add, "DEL": delete}), files


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _move_in_waiting_for(marker: str, seconds: float) -> Callable[..., Any]:
    real = attach.move_in

    def move_in(*args: Any, **kwargs: Any) -> Any:
        _wait_for(marker, seconds)
        return real(*args, **kwargs)

    return move_in


def _move_out_telling(marker: str, seconds: float, started: str) -> Callable[..., Any]:
    real = attach.move_out

    def move_out(*args: Any, **kwargs: Any) -> Any:
        # Gives the IPAM DEL time to start first if it was started first; never needed for the proof.
        _wait_for(started, seconds)
        real(*args, **kwargs)
        with open(marker, "w"):
            pass

    return move_out


def test_host_local_runs_while_the_vf_moves_in_and_home(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf, files = _recording_ipam(cluster, "host-local")
    monkeypatch.setattr(attach, "move_in", _move_in_waiting_for(files["add-started"], 5))
    monkeypatch.setattr(attach, "move_out", _move_out_telling(files["moved-home"], 5, files["del-started"]))
    pod = cluster.pod([{"max_tx_rate": 1000}])
    out = cluster.run_inproc("ADD", pod, conf)
    assert out.code == 0, out.doc
    # IPAM ran before the interface reached the pod, and ADD still applied its address.
    assert _read(files["add-saw"]) == "not-in-pod"
    assert addresses_in(ns_name(pod))["net1"] == [out.doc["ips"][0]["address"]]
    out = cluster.run_inproc("DEL", pod, conf)
    assert out.code == 0, out.doc
    # IPAM DEL was still running when the VF had come home.
    assert _read(files["del-saw"]) == "during-move"
    assert_node_pristine(cluster)


def test_an_unknown_ipam_type_runs_after_the_move_and_before_it_on_del(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same wrapper under a name the plugin does not know (as dhcp would be): CNI's order.
    conf, files = _recording_ipam(cluster, "order-ipam")
    monkeypatch.setattr(attach, "move_in", _move_in_waiting_for(files["add-started"], 0.5))
    monkeypatch.setattr(attach, "move_out", _move_out_telling(files["moved-home"], 0.5, files["del-started"]))
    pod = cluster.pod([{"max_tx_rate": 1000}])
    out = cluster.run_inproc("ADD", pod, conf)
    assert out.code == 0, out.doc
    assert _read(files["add-saw"]) == "in-pod"
    out = cluster.run_inproc("DEL", pod, conf)
    assert out.code == 0, out.doc
    assert _read(files["del-saw"]) == "not-during-move"
    assert_node_pristine(cluster)


def _slow_host_local(cluster: Cluster, verb: str, seconds: float) -> tuple[dict[str, Any], str, str]:
    """host-local whose ``verb`` marks its start, waits, runs host-local and then marks its end."""
    started, done = (os.path.join(cluster.tmp, f"slow-{verb}-{k}") for k in ("started", "done"))
    code = f"touch {started}; sleep {seconds}; {HOST_LOCAL}; status=$?; touch {done}; exit $status"
    return use_ipam(cluster, "host-local", {verb: code}), started, done


@pytest.mark.parametrize("after", [False, True], ids=["before-effect", "after-effect"])
def test_a_move_that_fails_while_ipam_add_runs_waits_for_it_then_releases_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, after: bool
) -> None:
    conf, started, done = _slow_host_local(cluster, "ADD", 1)
    real = attach.move_in

    def failing_move(*args: Any, **kwargs: Any) -> Any:
        assert _wait_for(started, 5), "IPAM ADD was not started before the move"
        if after:
            real(*args, **kwargs)
        raise KernelError("injected failure of the move")

    monkeypatch.setattr(attach, "move_in", failing_move)
    pod = cluster.pod([{"max_tx_rate": 1000}, {}])
    out = cluster.run_inproc("ADD", pod, conf)
    assert out.code == 1 and out.doc is not None and "injected" in out.doc["msg"], out.doc
    # ADD waited for its IPAM before rolling back, so the rollback's IPAM DEL came after the
    # lease was written and released it.
    assert os.path.exists(done), "ADD returned while its IPAM was still running"
    assert addresses_in(ns_name(pod)) == {"lo": []}
    assert_node_pristine(cluster)


def test_a_move_home_that_fails_while_ipam_del_runs_keeps_the_record_and_del_finishes(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf, started, done = _slow_host_local(cluster, "DEL", 0.5)
    pod = cluster.pod([{"max_tx_rate": 1000}])
    assert cluster.run_inproc("ADD", pod, conf).code == 0
    real = attach.move_out

    def failing_move_out(*args: Any, **kwargs: Any) -> Any:
        assert _wait_for(started, 5), "IPAM DEL was not started before the move home"
        raise KernelError("injected failure of the move home")

    monkeypatch.setattr(attach, "move_out", failing_move_out)
    out = cluster.run_inproc("DEL", pod, conf)
    assert out.doc is not None and out.doc["code"] == 103 and "injected" in out.doc["details"], out.doc
    assert os.path.exists(done), "DEL returned while its IPAM was still running"
    assert len(cluster.records) == 1  # the VF is still in the pod: its record stays
    assert cluster.ipam_allocations() == []  # IPAM DEL ran to its end all the same
    monkeypatch.setattr(attach, "move_out", real)
    assert cluster.run_inproc("DEL", pod, conf).code == 0
    assert_node_pristine(cluster)

"""The DRA side wired into the agent (agent/dra/service, agent/loop): passes, failures, the plugin's life.

The node is stood in for (read_devices patched): the integration and cluster
tiers read real ones. What is checked is the wiring: each pass of the agent
reads the DRA devices too and offers them, each kind of failure does what
the node-state snapshot's does, the kubelet plugin serves until the agent
stops, and setup_agent builds the DRA side only for DRA networks, refusing a
PF shared between paths.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.agent import loop
from rdma_cni.agent.dra import service
from rdma_cni.agent.dra.service import DraAgent
from rdma_cni.agent.snapshot import NetworkView
from rdma_cni.cni.errors import IOFailure, KernelError, TryAgainLater
from rdma_cni.shared.dra.slices import DraDevice


class Publisher:
    def __init__(self) -> None:
        self.offered: list[list[DraDevice]] = []
        self.steps = 0

    def offer(self, devices: Any) -> None:
        self.offered.append(devices)

    def step(self) -> bool:
        self.steps += 1
        return False


def agent(tmp_path: Path, **kw: Any) -> DraAgent:
    view = NetworkView(
        "rdma-dra", pfs=("p0",), state_dir=str(tmp_path / "s"), lock_file=str(tmp_path / "l"), dra=True
    )
    other = NetworkView("rdma-net", pfs=("p1",), state_dir=str(tmp_path / "s"), lock_file=str(tmp_path / "l"))
    a = DraAgent([view, other], "node-1", lambda: None, **kw)  # type: ignore[arg-type,return-value]
    a.publisher = Publisher()  # type: ignore[assignment]
    return a


DEVICE = DraDevice("rdma-dra", "p0", 4, 25000)


@pytest.mark.parametrize(
    ("raised", "ok", "offered"),
    [
        (None, True, [[DEVICE]]),
        (TryAgainLater("node lock busy"), False, []),
        # A record nobody can read: what the node may promise is unknown, so nothing.
        (IOFailure("cannot list records"), False, [[]]),
        (KernelError("netlink down"), False, []),
        (OSError(5, "EIO"), False, []),
    ],
)
def test_a_pass_offers_the_devices_or_handles_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: Exception | None, ok: bool, offered: list[Any]
) -> None:
    a = agent(tmp_path)
    assert [v.name for v in a.views] == ["rdma-dra"]

    def read(views: Any) -> list[DraDevice]:
        assert [v.name for v in views] == ["rdma-dra"]
        if raised is not None:
            raise raised
        return [DEVICE]

    monkeypatch.setattr(service, "read_devices", read)
    assert a.refresh() is ok
    assert a.publisher.offered == offered  # type: ignore[attr-defined]
    assert (a.refreshes, a.refresh_errors) == ((1, 0) if ok else (0, 1))
    a.step()
    assert a.publisher.steps == 1  # type: ignore[attr-defined]


def test_its_directories_are_each_networks_records_and_preparations(tmp_path: Path) -> None:
    assert agent(tmp_path).directories == [
        str(tmp_path / "s" / "attachments"),
        str(tmp_path / "s" / "prepared"),
    ]


def test_the_plugin_serves_until_the_agent_stops(tmp_path: Path) -> None:
    base = Path(f"/tmp/drs-{os.getpid()}")
    a = agent(tmp_path, registry_dir=str(base / "r"), plugin_dir=str(base / "p"))
    stop = threading.Event()
    try:
        loop.start_dra(loop.Agent([], None, dra=a), stop)  # type: ignore[arg-type]
        assert a.plugin is not None and os.path.exists(a.plugin.endpoint)
        stop.set()
        deadline = time.monotonic() + 10
        while os.path.exists(a.plugin.registration_socket) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(a.plugin.registration_socket)
    finally:
        stop.set()
        shutil.rmtree(base, ignore_errors=True)
    # Without kubelet's directories there is no plugin (slices are still published).
    quiet = agent(tmp_path)
    quiet.start(threading.Event())
    assert quiet.plugin is None


def test_a_plugin_that_cannot_serve_fails_the_start(tmp_path: Path) -> None:
    (tmp_path / "r").write_text("a file, not kubelet's registry")
    a = agent(tmp_path, registry_dir=str(tmp_path / "r"), plugin_dir=str(tmp_path / "p"))
    with pytest.raises((OSError, RuntimeError)):
        a.start(threading.Event())


def test_the_agents_loop_drives_the_dra_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = agent(tmp_path)
    monkeypatch.setattr(service, "read_devices", lambda views: [DEVICE])
    monkeypatch.setattr(loop, "snapshot", lambda views: loop.unusable())
    published = Publisher()
    ag = loop.Agent([NetworkView("rdma-net", state_dir=str(tmp_path / "s"))], published, poll=0.01, dra=a)  # type: ignore[arg-type]
    assert set(a.directories) <= set(ag.directories)
    assert [v.name for v in ag.all_views] == ["rdma-net", "rdma-dra"]
    stop = threading.Event()
    thread = threading.Thread(target=ag.run, args=(stop,))
    thread.start()
    deadline = time.monotonic() + 10
    while a.publisher.steps < 3 and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.02)
    stop.set()
    thread.join(10)
    assert a.refreshes >= 1 and a.publisher.offered[0] == [DEVICE]  # type: ignore[attr-defined]
    assert a.publisher.steps >= 3  # type: ignore[attr-defined]


def conflist(tmp_path: Path, name: str, **fields: Any) -> str:
    path = tmp_path / f"{name}.conflist"
    entry = {"type": "rdma-cni", "stateDir": str(tmp_path / "s"), "lockFile": str(tmp_path / "l"), **fields}
    path.write_text(json.dumps({"cniVersion": "1.1.0", "name": name, "plugins": [entry]}))
    return str(path)


def kubeconfig(tmp_path: Path) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True},
                    }
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return str(path)


def test_setup_builds_the_dra_side_for_dra_networks_only(tmp_path: Path) -> None:
    plain = conflist(tmp_path, "rdma-net", pfs=["p1"])
    drafile = conflist(tmp_path, "rdma-dra", pfs=["p0"], dra=True)
    built = loop.setup_agent(
        node_name="node-1", network_configs=[plain, drafile], kubeconfig=kubeconfig(tmp_path)
    )
    assert [v.name for v in built.views] == ["rdma-net"]
    assert built.dra is not None and [v.name for v in built.dra.views] == ["rdma-dra"]
    assert built.dra.plugin_dir is None  # no kubelet directories given: no plugin
    with_kubelet = loop.setup_agent(
        node_name="node-1",
        network_configs=[drafile],
        kubeconfig=kubeconfig(tmp_path),
        kubelet_dirs=("/r", "/p"),
    )
    assert with_kubelet.views == [] and with_kubelet.dra is not None
    assert (with_kubelet.dra.registry_dir, with_kubelet.dra.plugin_dir) == ("/r", "/p")
    assert (
        loop.setup_agent(node_name="node-1", network_configs=[plain], kubeconfig=kubeconfig(tmp_path)).dra
        is None
    )
    shared = conflist(tmp_path, "rdma-old", pfs=["p0"])
    with pytest.raises(ValueError, match="PF p0 is in DRA network rdma-dra and in network rdma-old"):
        loop.setup_agent(
            node_name="node-1", network_configs=[shared, drafile], kubeconfig=kubeconfig(tmp_path)
        )

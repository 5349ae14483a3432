"""RDMA isolation reaches the pod's namespace through the fd it holds, never by path again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rdma_cni.kernel import rdma
from rdma_cni.node.isolation import RdmaIsolation


class _Pod:
    """A stand-in for Netns: an open fd, and a path that no longer names it."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path


def test_where_and_move_out_open_the_pod_socket_by_fd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = tmp_path / "netns"
    stand_in.write_text("")
    fd = os.open(stand_in, os.O_RDONLY)
    stand_in.unlink()  # the path is gone (or swapped): only the fd still names the namespace
    opened: list[object] = []

    class Stop(Exception):
        pass

    def fake_open(netns_path: str | int | None = None, timeout: float | None = None) -> object:
        opened.append(netns_path)
        raise Stop

    monkeypatch.setattr(rdma, "open_rdma_socket", fake_open)
    pod = _Pod(fd, str(stand_in))
    try:
        with pytest.raises(Stop):
            RdmaIsolation("auto").where("mlx5_0", pod)  # type: ignore[arg-type]
        with pytest.raises(Stop):
            RdmaIsolation("auto").move_out("mlx5_0", pod)  # type: ignore[arg-type]
    finally:
        os.close(fd)
    assert opened == [fd, fd]

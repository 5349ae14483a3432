"""The node agent advertises its node's RDMA capacity as extended resources in the Node's status."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from rdma_cni.agent.capacity import Advertiser, resources
from rdma_cni.kube.client import ApiError
from rdma_cni.shared import nodestate
from tests.support import sched_objects as so

BW, VF = nodestate.BANDWIDTH_RESOURCE, nodestate.VF_RESOURCE


class Client:
    """The API client's merge patch, recorded; fails with ``error`` while it is set."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, Any]] = []
        self.error: Exception | None = None

    def patch_merge(self, path: str, body: Any) -> Any:
        self.patches.append((path, body))
        if self.error is not None:
            raise self.error
        return {}


def test_resources_are_the_states_vfs_and_the_pfs_capacities_summed() -> None:
    state = so.state([("p0", 25_000, 4), ("p1", 100_000, 8)], [("u", [("p0", 20_000, 0)])])
    assert resources(state) == {VF: "12", BW: "125000"}  # capacities, not what is free


def test_no_bandwidth_is_advertised_when_a_pfs_capacity_is_unknown() -> None:
    assert resources(so.state([("p0", 25_000, 4), ("p1", None, 2)])) == {VF: "6"}


def test_written_once_then_only_when_changed_or_asked_again() -> None:
    client = Client()
    advertiser = Advertiser(lambda: client, "n1")
    state = so.state([("p0", 25_000, 4)])
    assert advertiser.advertise(state)
    values = {BW: "25000", VF: "4"}
    assert client.patches == [
        ("/api/v1/nodes/n1/status", {"status": {"capacity": values, "allocatable": values}})
    ]
    # Pods come and go: the capacity stays, nothing is written.
    assert not advertiser.advertise(so.state([("p0", 25_000, 4)], [("u", [("p0", 5_000, 0)])]))
    assert advertiser.advertise(state, again=True)  # a heartbeat: the kubelet may have reset them
    # A PF's capacity becomes unknown: its bandwidth is removed (null in a merge patch).
    assert advertiser.advertise(so.state([("p0", None, 4)]))
    removed = {BW: None, VF: "4"}
    assert client.patches[-1][1] == {"status": {"capacity": removed, "allocatable": removed}}
    assert advertiser.writes == 3


def test_a_refused_patch_is_logged_once_and_tried_again_with_the_next_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = Client()
    advertiser = Advertiser(lambda: client, "n1")
    state = so.state([("p0", 25_000, 4)])
    client.error = ApiError(403, "Forbidden", 'nodes "n1" is forbidden: cannot patch resource "nodes/status"')
    with caplog.at_level(logging.WARNING, logger="rdma_cni.agent"):
        assert not advertiser.advertise(state)
        assert not advertiser.advertise(state)
    assert len(client.patches) == 2  # nothing is believed written: each state tries again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "nodes/status" in warnings[0], warnings
    client.error = None
    assert advertiser.advertise(state) and advertiser.last_error == ""
    assert not advertiser.advertise(state)

"""The agent's ResourceSlice publisher (agent/dra/publish) against a fake API: writes only what changed.

The fake keeps slices as the API server does (names from generateName,
resourceVersions checked on update, quantities written back canonically as
``25k``); the cluster tier runs the publisher against the real kube-apiserver
and its admission policy.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

from rdma_cni.agent.dra.publish import SLICES, SlicePublisher, normal
from rdma_cni.kube.client import ApiError, Conflict, NotFound, Unavailable
from rdma_cni.shared.dra.slices import MAX_DEVICES_PER_SLICE, DraDevice


def canonical(value: str) -> str:
    n = int(value)
    return f"{n // 1000}k" if n and n % 1000 == 0 else value


class FakeApi:
    """ResourceSlices and one Node, with the server's habits; ``fail`` makes the next calls fail."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail: list[ApiError] = []
        self.names = itertools.count()
        self.versions = itertools.count(1)

    def _maybe_fail(self) -> None:
        if self.fail:
            raise self.fail.pop(0)

    def _store(self, doc: dict[str, Any]) -> dict[str, Any]:
        doc = copy.deepcopy(doc)
        for dev in doc["spec"]["devices"]:
            for cap in dev["capacity"].values():
                cap["value"] = canonical(cap["value"])
        doc["metadata"]["resourceVersion"] = str(next(self.versions))
        self.slices[doc["metadata"]["name"]] = doc
        return doc

    def get(self, path: str) -> dict[str, Any]:
        self.calls.append(("GET", path))
        self._maybe_fail()
        return {"metadata": {"name": "node-1", "uid": "node-uid"}}

    def list(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("LIST", path))
        self._maybe_fail()
        assert path == SLICES
        assert params == {"fieldSelector": "spec.nodeName=node-1,spec.driver=rdma-cni.io"}
        return {"items": copy.deepcopy(list(self.slices.values()))}

    def post(self, path: str, doc: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("POST", path))
        self._maybe_fail()
        doc = copy.deepcopy(doc)
        doc["metadata"]["name"] = doc["metadata"].pop("generateName") + f"x{next(self.names)}"
        return self._store(doc)

    def put(self, path: str, doc: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("PUT", path))
        self._maybe_fail()
        name = path.rsplit("/", 1)[1]
        assert doc["metadata"]["name"] == name and "generateName" not in doc["metadata"]
        if self.slices[name]["metadata"]["resourceVersion"] != doc["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", "stale")
        return self._store(doc)

    def delete(self, path: str) -> dict[str, Any]:
        self.calls.append(("DELETE", path))
        self._maybe_fail()
        return self.slices.pop(path.rsplit("/", 1)[1])

    def writes(self) -> list[str]:
        return [verb for verb, _ in self.calls if verb in ("POST", "PUT", "DELETE")]

    def devices(self) -> list[str]:
        return sorted(
            d["attributes"]["pf"]["string"] for s in self.slices.values() for d in s["spec"]["devices"]
        )

    def generations(self) -> set[int]:
        return {s["spec"]["pool"]["generation"] for s in self.slices.values()}


def dev(pf: str, *, vfs: int = 4, bandwidth: int | None = 25000, network: str = "rdma-dra") -> DraDevice:
    return DraDevice(network, pf, vfs, bandwidth, bandwidth, bandwidth)


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


def publisher(api: FakeApi, **kw: Any) -> SlicePublisher:
    return SlicePublisher(lambda: api, "node-1", min_backoff=0, max_backoff=0, **kw)  # type: ignore[arg-type,return-value]


def test_published_once_then_only_on_change(api: FakeApi) -> None:
    p = publisher(api)
    p.offer([dev("p0"), dev("p1")])
    assert p.step() is True
    assert api.writes() == ["POST"] and api.devices() == ["p0", "p1"] and api.generations() == {1}
    (stored,) = api.slices.values()
    assert stored["metadata"]["ownerReferences"][0] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "node-1",
        "uid": "node-uid",
        "controller": True,
    }
    # The same reading again: nothing to do, not even a list.
    api.calls.clear()
    p.offer([dev("p0"), dev("p1")])
    assert p.step() is False and api.calls == []
    # A new agent (nothing remembered) finds the pool as it wants it, "25k" against 25000: no write.
    fresh = publisher(api)
    fresh.offer([dev("p0"), dev("p1")])
    assert fresh.step() is False and api.writes() == [] and fresh.generation == 1
    # A change: the slice is updated in place, one generation up.
    p.offer([dev("p0", vfs=3), dev("p1")])
    assert p.step() is True
    assert api.writes() == ["PUT"] and api.generations() == {2}


def test_the_pool_grows_into_slices_and_shrinks_back(api: FakeApi) -> None:
    p = publisher(api)
    many = [dev(f"p{i}", network=f"n{j}") for i in range(16) for j in range(9)]
    p.offer(many)
    assert p.step()
    assert sorted(len(s["spec"]["devices"]) for s in api.slices.values()) == [16, MAX_DEVICES_PER_SLICE]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in api.slices.values()} == {2}
    api.calls.clear()
    p.offer([dev("p0")])
    assert p.step()
    assert sorted(api.writes()) == ["DELETE", "PUT"] and len(api.slices) == 1
    (only,) = api.slices.values()
    assert only["spec"]["pool"] == {"name": "node-1", "generation": 2, "resourceSliceCount": 1}
    p.offer([])
    assert p.step() and api.slices == {}


def test_slices_edited_or_deleted_behind_its_back_come_back_at_the_resync(api: FakeApi) -> None:
    p = publisher(api, resync=0)
    p.offer([dev("p0")])
    assert p.step()
    api.slices.clear()
    assert p.step() is True and api.devices() == ["p0"]
    (stored,) = api.slices.values()
    stored["spec"]["devices"][0]["capacity"]["vfs"]["value"] = "99"
    assert p.step() is True
    (stored,) = api.slices.values()
    assert stored["spec"]["devices"][0]["capacity"]["vfs"]["value"] == "4"
    assert p.step() is False  # equal now


def test_failures_are_retried_with_backoff_and_a_conflict_reads_again(api: FakeApi) -> None:
    p = SlicePublisher(lambda: api, "node-1", min_backoff=0.0, max_backoff=0.0)  # type: ignore[arg-type,return-value]
    p.offer([dev("p0")])
    api.fail = [Unavailable(503, "ServiceUnavailable", "down")]
    assert p.step() is False and p.failures == 1 and "down" in p.last_error
    assert p.step() is True and p.last_error == "" and api.devices() == ["p0"]
    # Someone updated the slice meanwhile: the PUT conflicts, the next pass reads it again.
    p.offer([dev("p0", vfs=2)])
    (name,) = api.slices
    real_put = api.put

    def racing_put(path: str, doc: dict[str, Any]) -> dict[str, Any]:
        api.slices[name]["metadata"]["resourceVersion"] = "somebody-else"
        api.put = real_put  # type: ignore[method-assign]
        return real_put(path, doc)

    api.put = racing_put  # type: ignore[method-assign]
    assert p.step() is False and p.failures == 2
    assert p.step() is True
    assert api.slices[name]["spec"]["devices"][0]["capacity"]["vfs"]["value"] == "2"


def test_a_node_made_again_gets_its_new_uid(api: FakeApi) -> None:
    p = publisher(api)
    p.offer([dev("p0")])
    assert p.step()
    api.fail = [NotFound(404, "NotFound", "node")]
    p.offer([dev("p1")])
    assert p.step() is False
    assert p._owner is None  # read again on the next write
    assert p.step() is True


def test_backoff_grows_and_is_bounded() -> None:
    api = FakeApi()
    p = SlicePublisher(lambda: api, "node-1", min_backoff=0.5, max_backoff=2.0)  # type: ignore[arg-type,return-value]
    p.offer([dev("p0")])
    delays = []
    for _ in range(4):
        api.fail = [Unavailable(503, "ServiceUnavailable", "down")]
        p._next_attempt = 0.0
        p.step()
        delays.append(p._backoff)
    assert delays == [0.5, 1.0, 2.0, 2.0]


def test_quantities_compare_by_value() -> None:
    a = [{"name": "d", "capacity": {"bandwidth": {"value": "25k", "requestPolicy": {"default": "0"}}}}]
    b = [{"name": "d", "capacity": {"bandwidth": {"value": "25000", "requestPolicy": {"default": "0"}}}}]
    assert normal(a) == normal(b)
    c = [
        {
            "name": "d",
            "capacity": {"vfs": {"value": "4", "requestPolicy": {"default": "1", "validValues": ["1"]}}},
        }
    ]
    assert normal(c) != normal(b)
    # What is not a device is compared as it is (a slice someone else wrote).
    assert normal([{"capacity": "junk"}, "junk"]) == ["junk", {"capacity": "junk"}]


def test_a_reading_back_to_the_published_one_cancels_the_pending_one(api: FakeApi) -> None:
    p = publisher(api)
    p.offer([dev("p0")])
    assert p.step()
    p.offer([dev("p0", vfs=1)])  # a VF taken...
    p.offer([dev("p0")])  # ...and given back before the next step: nothing to write
    api.calls.clear()
    assert p.step() is False and api.calls == []
    assert (
        api.slices
        and next(iter(api.slices.values()))["spec"]["devices"][0]["capacity"]["vfs"]["value"] == "4"
    )

"""The API stand-in's Kubernetes semantics: nodes, lists, watches, pods/binding (over real HTTPS)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.support.apiserver import MAX_ANNOTATIONS_BYTES, ApiServer, make_node  # noqa: E402

META_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
META_ONE = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


@pytest.fixture
def http(api: ApiServer) -> Iterator[requests.Session]:
    with requests.Session() as session:
        session.trust_env = False
        session.verify = api.ca_path
        session.headers["Authorization"] = f"Bearer {api.token}"
        yield session


def url(api: ApiServer, path: str) -> str:
    return api.url + path


def status_of(resp: requests.Response, code: int, reason: str) -> dict[str, Any]:
    """Check ``resp`` is a Kubernetes Status with ``code`` and ``reason``; return it."""
    assert resp.status_code == code, resp.text
    doc = resp.json()
    assert doc["kind"] == "Status" and doc["apiVersion"] == "v1"
    assert doc["status"] == "Failure" and doc["code"] == code and doc["reason"] == reason, doc
    return doc


class Watch:
    """A watch stream read on a background thread, events collected in order."""

    def __init__(
        self, api: ApiServer, http: requests.Session, address: str, params: dict[str, Any], **kwargs: Any
    ) -> None:
        self.api = api
        self.resp = http.get(address, params={"watch": "1", **params}, stream=True, timeout=10, **kwargs)
        assert self.resp.status_code == 200, self.resp.text
        self.events: list[dict[str, Any]] = []
        self.ended_cleanly: bool | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in self.resp.iter_lines():
                if line:
                    self.events.append(json.loads(line))
            self.ended_cleanly = True
        except requests.exceptions.RequestException as exc:
            self.error = exc
            self.ended_cleanly = False

    def wait_for(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.events) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.events) >= count, self.events
        return self.events

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive()

    def close(self) -> None:
        # Closing our end does not wake a thread blocked reading it: the server hangs up instead.
        self.api.drop_watches()
        self.join()
        self.resp.close()


def wait_watchers(api: ApiServer, count: int) -> None:
    deadline = time.monotonic() + 5
    while api.watch_count != count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert api.watch_count == count


# -- nodes: GET and PATCH


def test_node_get_is_the_stored_object_with_a_resource_version(
    api: ApiServer, http: requests.Session
) -> None:
    made = api.add_node("node-a", labels={"rack": "r1"}, images=40)
    resp = http.get(url(api, "/api/v1/nodes/node-a"))
    assert resp.status_code == 200
    node = resp.json()
    assert node == made
    assert node["kind"] == "Node" and node["apiVersion"] == "v1"
    assert node["metadata"]["labels"]["rack"] == "r1"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "node-a"
    assert len(node["status"]["images"]) == 40
    assert {c["type"] for c in node["status"]["conditions"]} >= {"Ready", "MemoryPressure"}
    assert int(node["metadata"]["resourceVersion"]) == api.resource_version


def test_node_get_metadata_only(api: ApiServer, http: requests.Session) -> None:
    api.add_node("node-a", annotations={"k": "v"}, images=3)
    doc = http.get(url(api, "/api/v1/nodes/node-a"), headers={"Accept": META_ONE}).json()
    assert doc["kind"] == "PartialObjectMetadata" and doc["apiVersion"] == "meta.k8s.io/v1"
    assert set(doc) == {"kind", "apiVersion", "metadata"}
    assert doc["metadata"]["annotations"]["k"] == "v"


def test_unknown_node_is_404_with_a_status(api: ApiServer, http: requests.Session) -> None:
    doc = status_of(http.get(url(api, "/api/v1/nodes/nope")), 404, "NotFound")
    assert doc["message"] == 'nodes "nope" not found'
    assert doc["details"] == {"name": "nope", "kind": "nodes"}
    resp = http.patch(url(api, "/api/v1/nodes/nope"), data=b"{}", headers=MERGE)
    status_of(resp, 404, "NotFound")


def test_merge_patch_sets_and_deletes_annotations_and_bumps_the_version(
    api: ApiServer, http: requests.Session
) -> None:
    api.add_node("node-a", annotations={"keep": "1", "drop": "2"})
    before = api.resource_version
    patch = {"metadata": {"annotations": {"rdma-cni.io/node-state": '{"version":1}', "drop": None}}}
    resp = http.patch(url(api, "/api/v1/nodes/node-a"), data=json.dumps(patch), headers=MERGE)
    assert resp.status_code == 200, resp.text
    node = resp.json()
    annotations = node["metadata"]["annotations"]
    assert annotations["rdma-cni.io/node-state"] == '{"version":1}'
    assert annotations["keep"] == "1" and "drop" not in annotations
    assert int(node["metadata"]["resourceVersion"]) == before + 1 == api.resource_version
    assert api.get_node("node-a") == node


def test_a_patch_that_changes_nothing_writes_nothing(api: ApiServer, http: requests.Session) -> None:
    api.add_node("node-a", annotations={"a": "1"})
    before = api.resource_version
    resp = http.patch(
        url(api, "/api/v1/nodes/node-a"), json={"metadata": {"annotations": {"a": "1"}}}, headers=MERGE
    )
    assert resp.status_code == 200
    assert resp.json()["metadata"]["resourceVersion"] == str(before) and api.resource_version == before


def test_patch_cannot_change_status(api: ApiServer, http: requests.Session) -> None:
    made = api.add_node("node-a")
    resp = http.patch(
        url(api, "/api/v1/nodes/node-a"), json={"status": {"capacity": {"cpu": "1"}}}, headers=MERGE
    )
    assert resp.status_code == 200
    assert resp.json()["status"] == made["status"]


def test_stale_resource_version_in_the_patch_is_409(api: ApiServer, http: requests.Session) -> None:
    node = api.add_node("node-a")
    rv = node["metadata"]["resourceVersion"]
    api.set_node_annotations("node-a", {"someone": "else"})
    patch = {"metadata": {"resourceVersion": rv, "annotations": {"mine": "x"}}}
    doc = status_of(http.patch(url(api, "/api/v1/nodes/node-a"), json=patch, headers=MERGE), 409, "Conflict")
    assert doc["message"].startswith(
        'Operation cannot be fulfilled on nodes "node-a": the object has been modified'
    )
    assert "mine" not in api.get_node("node-a")["metadata"]["annotations"]
    # With the current version it goes through.
    patch["metadata"]["resourceVersion"] = str(api.resource_version)
    assert http.patch(url(api, "/api/v1/nodes/node-a"), json=patch, headers=MERGE).status_code == 200


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"metadata": {"annotations": {"big": "x" * MAX_ANNOTATIONS_BYTES}}}, "metadata.annotations"),
        ({"metadata": {"annotations": {"n": 5}}}, "metadata.annotations.n"),
        ({"metadata": {"annotations": {"bad key!": "v"}}}, "metadata.annotations"),
        ({"metadata": {"labels": {"l": "not a valid value"}}}, "metadata.labels.l"),
        ({"metadata": {"name": "other"}}, "metadata.name"),
        ({"metadata": {"uid": "forged"}}, "metadata.uid"),
        ({"metadata": "text"}, "metadata"),
    ],
)
def test_patches_that_make_an_invalid_node_are_422(
    api: ApiServer, http: requests.Session, patch: dict[str, Any], field: str
) -> None:
    node = api.add_node("node-a")
    doc = status_of(http.patch(url(api, "/api/v1/nodes/node-a"), json=patch, headers=MERGE), 422, "Invalid")
    assert doc["details"]["kind"] == "Node" and doc["details"]["causes"][0]["field"] == field
    assert doc["message"].startswith(f'Node "node-a" is invalid: {field}: ')
    assert api.get_node("node-a") == node


def test_annotations_just_under_the_limit_are_accepted(api: ApiServer, http: requests.Session) -> None:
    api.add_node("node-a", annotations={})
    existing = sum(len(k) + len(v) for k, v in api.get_node("node-a")["metadata"]["annotations"].items())
    value = "x" * (MAX_ANNOTATIONS_BYTES - existing - len("big"))
    resp = http.patch(
        url(api, "/api/v1/nodes/node-a"), json={"metadata": {"annotations": {"big": value}}}, headers=MERGE
    )
    assert resp.status_code == 200, resp.text[:200]


def test_patch_body_that_is_not_json_is_400_and_other_patch_types_415(
    api: ApiServer, http: requests.Session
) -> None:
    api.add_node("node-a")
    status_of(
        http.patch(url(api, "/api/v1/nodes/node-a"), data=b"{not json", headers=MERGE), 400, "BadRequest"
    )
    status_of(http.patch(url(api, "/api/v1/nodes/node-a"), data=b"[1]", headers=MERGE), 400, "BadRequest")
    resp = http.patch(
        url(api, "/api/v1/nodes/node-a"), json=[], headers={"Content-Type": "application/json-patch+json"}
    )
    status_of(resp, 415, "UnsupportedMediaType")
    status_of(http.put(url(api, "/api/v1/nodes/node-a"), json={}), 405, "MethodNotAllowed")


def test_oversized_body_is_413(api: ApiServer, http: requests.Session) -> None:
    api.add_node("node-a")
    big = b'{"metadata":{"annotations":{"a":"' + b"x" * (3 * 1024 * 1024) + b'"}}}'
    status_of(
        http.patch(url(api, "/api/v1/nodes/node-a"), data=big, headers=MERGE), 413, "RequestEntityTooLarge"
    )


# -- LIST


def test_node_list_full_and_metadata_only(api: ApiServer, http: requests.Session) -> None:
    for name in ("node-b", "node-a", "node-c"):
        api.add_node(name, images=2)
    full = http.get(url(api, "/api/v1/nodes")).json()
    assert full["kind"] == "NodeList" and full["apiVersion"] == "v1"
    assert full["metadata"]["resourceVersion"] == str(api.resource_version)
    assert [n["metadata"]["name"] for n in full["items"]] == ["node-a", "node-b", "node-c"]
    # Items of a typed list carry no kind or apiVersion.
    assert "kind" not in full["items"][0] and full["items"][0]["status"]["images"]

    meta = http.get(url(api, "/api/v1/nodes"), headers={"Accept": META_LIST}).json()
    assert meta["kind"] == "PartialObjectMetadataList" and meta["apiVersion"] == "meta.k8s.io/v1"
    assert meta["metadata"]["resourceVersion"] == str(api.resource_version)
    for item, node in zip(meta["items"], full["items"], strict=True):
        assert item == {
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": node["metadata"],
        }


def test_accept_with_fallbacks_picks_the_first_servable(api: ApiServer, http: requests.Session) -> None:
    api.add_node("node-a")
    protobuf = "application/vnd.kubernetes.protobuf;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
    accept = f"{protobuf},{META_LIST},application/json"
    assert (
        http.get(url(api, "/api/v1/nodes"), headers={"Accept": accept}).json()["kind"]
        == "PartialObjectMetadataList"
    )
    # The single-object form for a list cannot be served.
    status_of(http.get(url(api, "/api/v1/nodes"), headers={"Accept": META_ONE}), 406, "NotAcceptable")
    status_of(
        http.get(url(api, "/api/v1/nodes"), headers={"Accept": "application/yaml"}), 406, "NotAcceptable"
    )


def test_list_pages_with_limit_and_continue(api: ApiServer, http: requests.Session) -> None:
    for i in range(5):
        api.add_node(f"node-{i}")
    names: list[str] = []
    params: dict[str, Any] = {"limit": 2}
    remaining = []
    while True:
        page = http.get(url(api, "/api/v1/nodes"), params=params, headers={"Accept": META_LIST}).json()
        names += [item["metadata"]["name"] for item in page["items"]]
        token = page["metadata"].get("continue")
        if not token:
            break
        remaining.append(page["metadata"]["remainingItemCount"])
        params = {"limit": 2, "continue": token}
    assert names == [f"node-{i}" for i in range(5)]
    assert remaining == [3, 1]


def test_continue_token_after_compaction_is_410_and_garbage_400(
    api: ApiServer, http: requests.Session
) -> None:
    for i in range(3):
        api.add_node(f"node-{i}")
    token = http.get(url(api, "/api/v1/nodes"), params={"limit": 1}).json()["metadata"]["continue"]
    api.add_node("node-9")
    api.compact()
    status_of(http.get(url(api, "/api/v1/nodes"), params={"limit": 1, "continue": token}), 410, "Expired")
    status_of(http.get(url(api, "/api/v1/nodes"), params={"continue": "!!"}), 400, "BadRequest")
    status_of(http.get(url(api, "/api/v1/nodes"), params={"limit": "-1"}), 400, "BadRequest")


def test_pod_lists_with_field_and_label_selectors(api: ApiServer, http: requests.Session) -> None:
    api.add_pod("a", "bound-1", node_name="node-1", labels={"app": "x", "tier": "db"})
    api.add_pod("a", "bound-2", node_name="node-2", labels={"app": "y"})
    api.add_pod("b", "pending", node_name=None, labels={"app": "x"}, scheduler_name="rdma-scheduler")

    def names(path: str, **params: str) -> list[str]:
        resp = http.get(url(api, path), params=params)
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        assert doc["kind"] == "PodList"
        return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in doc["items"]]

    assert names("/api/v1/pods") == ["a/bound-1", "a/bound-2", "b/pending"]
    assert names("/api/v1/namespaces/a/pods") == ["a/bound-1", "a/bound-2"]
    assert names("/api/v1/pods", fieldSelector="spec.nodeName=node-2") == ["a/bound-2"]
    assert names("/api/v1/pods", fieldSelector="spec.nodeName==node-1") == ["a/bound-1"]
    assert names("/api/v1/pods", fieldSelector="spec.nodeName=") == ["b/pending"]
    assert names("/api/v1/pods", fieldSelector="spec.nodeName!=") == ["a/bound-1", "a/bound-2"]
    assert names("/api/v1/pods", fieldSelector="spec.schedulerName=rdma-scheduler,status.phase=Pending") == [
        "b/pending"
    ]
    assert names("/api/v1/pods", labelSelector="app=x") == ["a/bound-1", "b/pending"]
    assert names("/api/v1/pods", labelSelector="app in (x,y),!tier") == ["a/bound-2", "b/pending"]
    assert names("/api/v1/pods", labelSelector="tier,app!=y") == ["a/bound-1"]
    assert names("/api/v1/pods", labelSelector="app notin (x)") == ["a/bound-2"]
    doc = status_of(
        http.get(url(api, "/api/v1/pods"), params={"fieldSelector": "spec.hostIPC=x"}), 400, "BadRequest"
    )
    assert doc["message"] == "field label not supported: spec.hostIPC"
    status_of(http.get(url(api, "/api/v1/pods"), params={"labelSelector": "a in b"}), 400, "BadRequest")


def test_forbidden_namespace_covers_list_delete_and_binding(api: ApiServer, http: requests.Session) -> None:
    api.add_pod("locked", "p", node_name=None)
    api.forbid_namespace("locked")
    status_of(http.get(url(api, "/api/v1/namespaces/locked/pods")), 403, "Forbidden")
    status_of(http.delete(url(api, "/api/v1/namespaces/locked/pods/p")), 403, "Forbidden")
    binding = {"metadata": {"name": "p"}, "target": {"name": "node-1"}}
    status_of(http.post(url(api, "/api/v1/namespaces/locked/pods/p/binding"), json=binding), 403, "Forbidden")
    assert api.get_pod("locked", "p") is not None


def test_5000_realistic_nodes_list_well_under_a_second(api: ApiServer, http: requests.Session) -> None:
    state = "x" * 600
    for i in range(5000):
        api.add_node(f"node-{i:05d}", images=40, annotations={"rdma-cni.io/node-state": state})
    http.get(url(api, "/api/v1/nodes"), headers={"Accept": META_LIST})  # encodes once
    start = time.perf_counter()
    doc = http.get(url(api, "/api/v1/nodes"), headers={"Accept": META_LIST}).json()
    assert len(doc["items"]) == 5000
    assert time.perf_counter() - start < 0.5


# -- pods: binding and DELETE


def binding(name: str, node: str, uid: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if uid:
        meta["uid"] = uid
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": meta,
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }


def test_binding_sets_node_name_and_answers_201(api: ApiServer, http: requests.Session) -> None:
    pod = api.add_pod("ns", "p", node_name=None)
    before = api.resource_version
    resp = http.post(
        url(api, "/api/v1/namespaces/ns/pods/p/binding"), json=binding("p", "node-7", pod["metadata"]["uid"])
    )
    assert resp.status_code == 201
    assert resp.json() == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "code": 201,
    }
    bound = api.get_pod("ns", "p")
    assert bound["spec"]["nodeName"] == "node-7"
    assert int(bound["metadata"]["resourceVersion"]) == before + 1
    assert any(c["type"] == "PodScheduled" and c["status"] == "True" for c in bound["status"]["conditions"])


def test_binding_refusals(api: ApiServer, http: requests.Session) -> None:
    api.add_pod("ns", "p", node_name=None, uid="uid-1")
    path = url(api, "/api/v1/namespaces/ns/pods/p/binding")
    doc = status_of(http.post(path, json=binding("p", "node-1", "uid-OLD")), 409, "Conflict")
    assert "Precondition failed: UID in precondition: uid-OLD, UID in object meta: uid-1" in doc["message"]
    status_of(http.post(path, json=binding("other", "node-1")), 400, "BadRequest")
    status_of(
        http.post(path, json={"kind": "Binding", "metadata": {"name": "p"}, "target": {}}), 422, "Invalid"
    )
    status_of(
        http.post(path, json={**binding("p", "n"), "target": {"kind": "Pod", "name": "n"}}), 422, "Invalid"
    )
    status_of(http.post(path, data=b"{", headers={"Content-Type": "application/json"}), 400, "BadRequest")
    assert "nodeName" not in api.get_pod("ns", "p")["spec"]

    assert http.post(path, json=binding("p", "node-1")).status_code == 201
    doc = status_of(http.post(path, json=binding("p", "node-2")), 409, "Conflict")
    assert (
        doc["message"]
        == 'Operation cannot be fulfilled on pods/binding "p": pod p is already assigned to node "node-1"'
    )
    assert api.get_pod("ns", "p")["spec"]["nodeName"] == "node-1"

    gone = status_of(
        http.post(url(api, "/api/v1/namespaces/ns/pods/gone/binding"), json=binding("gone", "n")),
        404,
        "NotFound",
    )
    assert gone["message"] == 'pods "gone" not found'
    status_of(http.get(path), 405, "MethodNotAllowed")


def test_delete_pod(api: ApiServer, http: requests.Session) -> None:
    api.add_pod("ns", "p")
    resp = http.delete(url(api, "/api/v1/namespaces/ns/pods/p"))
    assert resp.status_code == 200 and resp.json()["metadata"]["name"] == "p"
    assert api.get_pod("ns", "p") is None
    status_of(http.delete(url(api, "/api/v1/namespaces/ns/pods/p")), 404, "NotFound")
    status_of(http.get(url(api, "/api/v1/namespaces/ns/pods/p")), 404, "NotFound")


# -- WATCH


def test_watch_from_a_version_streams_changes_in_order(api: ApiServer, http: requests.Session) -> None:
    api.add_node("node-a")
    since = api.resource_version
    watch = Watch(
        api, http, url(api, "/api/v1/nodes"), {"resourceVersion": since}, headers={"Accept": META_LIST}
    )
    try:
        wait_watchers(api, 1)
        api.add_node("node-b")
        api.set_node_annotations("node-a", {"k": "v"})
        api.add_pod("ns", "p")  # another resource: not in this stream
        api.remove_node("node-b")
        events = watch.wait_for(3)
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
            ("ADDED", "node-b"),
            ("MODIFIED", "node-a"),
            ("DELETED", "node-b"),
        ]
        assert all(e["object"]["kind"] == "PartialObjectMetadata" for e in events)
        versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
        assert versions == sorted(versions) and versions[0] > since
        assert events[1]["object"]["metadata"]["annotations"]["k"] == "v"
    finally:
        watch.close()


def test_watch_from_zero_starts_with_what_exists(api: ApiServer, http: requests.Session) -> None:
    api.add_node("node-a")
    api.add_node("node-b")
    watch = Watch(api, http, url(api, "/api/v1/nodes"), {"resourceVersion": "0"})
    try:
        events = watch.wait_for(2)
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
            ("ADDED", "node-a"),
            ("ADDED", "node-b"),
        ]
        assert events[0]["object"]["kind"] == "Node" and "status" in events[0]["object"]
        api.add_node("node-c")
        assert watch.wait_for(3)[2]["type"] == "ADDED"
    finally:
        watch.close()


def test_watch_bookmarks_carry_the_current_version(api: ApiServer, http: requests.Session) -> None:
    api.add_node("node-a")
    api.add_pod("ns", "p")  # moves the global version past the last node change
    since = api.resource_version
    watch = Watch(
        api,
        http,
        url(api, "/api/v1/nodes"),
        {"resourceVersion": since, "allowWatchBookmarks": "true"},
        headers={"Accept": META_LIST},
    )
    try:
        wait_watchers(api, 1)
        api.add_pod("ns", "q")
        api.send_bookmarks()
        event = watch.wait_for(1)[0]
        assert event["type"] == "BOOKMARK"
        assert event["object"] == {
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": str(api.resource_version)},
        }
    finally:
        watch.close()


def test_periodic_bookmarks_only_when_asked(api: ApiServer, http: requests.Session) -> None:
    api.bookmark_interval = 0.1
    with_bm = Watch(
        api,
        http,
        url(api, "/api/v1/nodes"),
        {"resourceVersion": api.resource_version, "allowWatchBookmarks": "1"},
    )
    without = Watch(api, http, url(api, "/api/v1/nodes"), {"resourceVersion": api.resource_version})
    try:
        events = with_bm.wait_for(2, timeout=3)
        assert {e["type"] for e in events} == {"BOOKMARK"}
        assert events[0]["object"]["kind"] == "Node"
        assert without.events == []
    finally:
        with_bm.close()
        without.close()


def test_watch_from_a_compacted_version_gets_a_410_error_event(
    api: ApiServer, http: requests.Session
) -> None:
    api.add_node("node-a")
    old = api.resource_version
    api.add_node("node-b")
    api.compact()
    watch = Watch(api, http, url(api, "/api/v1/nodes"), {"resourceVersion": old})
    watch.join()
    assert watch.ended_cleanly
    assert len(watch.events) == 1
    event = watch.events[0]
    assert event["type"] == "ERROR"
    assert event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"
    assert event["object"]["message"] == f"too old resource version: {old} ({api.resource_version})"
    # The current version is still fine.
    current = Watch(api, http, url(api, "/api/v1/nodes"), {"resourceVersion": api.resource_version})
    try:
        api.add_node("node-c")
        assert current.wait_for(1)[0]["type"] == "ADDED"
    finally:
        current.close()


def test_history_limit_expires_old_versions(http: requests.Session, tmp_path: Path) -> None:
    with ApiServer(history=10) as api, requests.Session() as session:
        session.trust_env = False
        session.verify = api.ca_path
        session.headers["Authorization"] = f"Bearer {api.token}"
        first = api.resource_version
        for i in range(30):
            api.add_node(f"node-{i}")
        watch = Watch(api, session, url(api, "/api/v1/nodes"), {"resourceVersion": first})
        watch.join()
        assert watch.events[0]["type"] == "ERROR" and watch.events[0]["object"]["code"] == 410
        recent = Watch(api, session, url(api, "/api/v1/nodes"), {"resourceVersion": api.resource_version - 3})
        try:
            assert [e["object"]["metadata"]["name"] for e in recent.wait_for(3)] == [
                "node-27",
                "node-28",
                "node-29",
            ]
        finally:
            recent.close()


def test_dropped_watch_breaks_the_stream(api: ApiServer, http: requests.Session) -> None:
    watch = Watch(api, http, url(api, "/api/v1/nodes"), {"resourceVersion": api.resource_version})
    wait_watchers(api, 1)
    api.drop_watches()
    watch.join()
    assert watch.ended_cleanly is False, "a dropped watch must not look like a clean end"
    assert isinstance(watch.error, requests.exceptions.ChunkedEncodingError)
    wait_watchers(api, 0)


def test_watch_timeout_ends_the_stream_cleanly(api: ApiServer, http: requests.Session) -> None:
    watch = Watch(
        api, http, url(api, "/api/v1/nodes"), {"resourceVersion": api.resource_version, "timeoutSeconds": "1"}
    )
    watch.join(timeout=5)
    assert watch.ended_cleanly is True and watch.events == []


def test_pod_watch_with_a_field_selector_sees_pods_enter_and_leave(
    api: ApiServer, http: requests.Session
) -> None:
    api.add_pod("ns", "p", node_name=None)
    watch = Watch(
        api,
        http,
        url(api, "/api/v1/pods"),
        {"resourceVersion": api.resource_version, "fieldSelector": "spec.nodeName="},
    )
    try:
        wait_watchers(api, 1)
        api.add_pod("ns", "q", node_name=None)
        assert (
            http.post(
                url(api, "/api/v1/namespaces/ns/pods/p/binding"), json=binding("p", "node-1")
            ).status_code
            == 201
        )
        api.add_pod("ns", "bound", node_name="node-2")  # never visible
        events = watch.wait_for(2)
        time.sleep(0.2)
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in watch.events] == [
            ("ADDED", "q"),
            ("DELETED", "p"),
        ]
        assert events[1]["object"]["spec"]["nodeName"] == "node-1"
    finally:
        watch.close()


def test_namespaced_pod_watch(api: ApiServer, http: requests.Session) -> None:
    watch = Watch(api, http, url(api, "/api/v1/namespaces/a/pods"), {"resourceVersion": api.resource_version})
    try:
        wait_watchers(api, 1)
        api.add_pod("b", "other")
        api.add_pod("a", "mine")
        assert [e["object"]["metadata"]["name"] for e in watch.wait_for(1)] == ["mine"]
    finally:
        watch.close()


def test_bad_watch_parameters_are_400(api: ApiServer, http: requests.Session) -> None:
    resp = http.get(url(api, "/api/v1/nodes"), params={"watch": "1", "resourceVersion": "abc"})
    status_of(resp, 400, "BadRequest")


# -- faults and auth apply everywhere


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/v1/nodes"),
        ("GET", "/api/v1/nodes/node-a"),
        ("PATCH", "/api/v1/nodes/node-a"),
        ("GET", "/api/v1/pods"),
        ("POST", "/api/v1/namespaces/ns/pods/p/binding"),
        ("DELETE", "/api/v1/namespaces/ns/pods/p"),
    ],
)
def test_fail_next_and_auth_apply_to_every_path(
    api: ApiServer, http: requests.Session, method: str, path: str
) -> None:
    api.add_node("node-a")
    api.add_pod("ns", "p", node_name=None)
    api.fail_next(1, status=429)
    status_of(http.request(method, url(api, path), json={}, headers=MERGE), 429, "TooManyRequests")
    resp = requests.request(method, url(api, path), verify=api.ca_path, json={}, timeout=5)
    status_of(resp, 401, "Unauthorized")


def test_hang_applies_to_watches_too(api: ApiServer, http: requests.Session) -> None:
    api.hang(1.0)
    start = time.monotonic()
    with pytest.raises(requests.exceptions.ReadTimeout):
        http.get(url(api, "/api/v1/nodes"), params={"watch": "1"}, timeout=0.3)
    assert time.monotonic() - start < 1.0
    api.reset()


def test_make_node_is_deterministic_apart_from_times() -> None:
    a, b = make_node("n", images=40), make_node("n", images=40)
    for doc in (a, b):
        doc["metadata"].pop("creationTimestamp")
        doc["status"].pop("conditions")
    assert a == b
    assert len(json.dumps(make_node("n", images=40))) > 8000  # realistic: images dominate

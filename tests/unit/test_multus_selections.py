"""Which rdma-cni attachments the extender counts for a pod, read as Multus reads its annotations.

The reader's agreement with Multus' own code is checked in
tests/integration/test_multus_differential.py; these are the pod-level rules:
the default network counted first, a pod Multus fails has no attachments,
doubt and unreadable text refuse the pod, and the bound on attachments.
"""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest

from rdma_cni.cni.errors import InvalidPodRequest
from rdma_cni.extender.demand import Demands, selected_networks
from rdma_cni.shared import placement
from rdma_cni.shared.attachments import MAX_ATTACHMENTS, TooManyAttachments, pod_selections
from rdma_cni.shared.multusnet import (
    MultusFails,
    UnreadableNetworks,
    read_default_network,
    read_networks,
)
from rdma_cni.shared.podrequest import parse_request
from tests.support import sched_objects as so

NETS = "k8s.v1.cni.cncf.io/networks"
DEFAULT = "v1.multus-cni.io/default-network"


def _nested(depth: int, key: str = "cni-args") -> str:
    """A networks annotation selecting rdma-a whose ``cni-args`` make it nest ``depth`` levels in all."""
    inner = depth - 3  # the list, the element and the cni-args object
    return f'[{{"name": "rdma-a", "{key}": {{"x": ' + "[" * inner + "]" * inner + "}}]"


def demands(*networks: str) -> Demands:
    default = parse_request("[{}]", "--default-request")
    return Demands(
        annotation="rdma_interfaces_required", networks=frozenset(networks), default_request=default
    )


def count(annotations: dict[str, str], *networks: str) -> int:
    got = demands(*(networks or ("rdma-a",))).of_pod(so.pod("p", annotations))
    return 0 if got is None else len(got.requests)


@pytest.mark.parametrize(
    "value",
    [
        '[{"Name": "rdma-a"}]',
        '[{"NAME": "rdma-a", "CNI-ARGS": {"rdma_interfaces_required": "[{}]"}}]',
        '[{"nam\u212a": "other", "name": "rdma-a"}]',  # the Kelvin sign folds to k: the last name wins
        '[{"name": "other", "name": "rdma-a"}]',
        '[{"name": "rdma-a", "name": null}]',  # null leaves a Go string as it was
        '[{"name": "rdma-a"}]' + " " * (70 * 1024),  # past the old 64 KiB, under the API's 256 KiB
        # Fields Multus checks, each in a form it accepts.
        '[{"name": "rdma-a", "mac": "0000.5e00.5301", "infiniband-guid": "00:11:22:33:44:55:66:77"}]',
        '[{"name": "rdma-a", "ips": ["10.0.0.1/24", "fd00::1"], "default-route": ["10.0.0.1", "", null]}]',
        '[{"name": "rdma-a", "bandwidth": {"ingressRate": 1, "X": 1.5}, '
        '"portMappings": [{"hostPort": 8}, null]}]',
        # cni-args nested to the bound, 512 levels in all: walked without recursion.
        '[{"name": "rdma-a", "cni-args": {"x": ' + "[" * 509 + "]" * 509 + "}}]",
    ],
)
def test_forms_multus_reads_are_counted(value: str) -> None:
    assert count({NETS: value}) == 1


def test_a_repeated_cni_args_object_merges_as_go_does() -> None:
    value = (
        '[{"name": "rdma-a", "cni-args": {"a": 1}, '
        '"cni-arg\u017f": {"rdma_interfaces_required": "[{}, {}]"}}]'
    )
    (sel,) = read_networks(value, "team-a").selections
    assert sel.cni_args == {"a": 1, "rdma_interfaces_required": "[{}, {}]"}
    assert count({NETS: value}) == 2


def test_the_default_network_is_an_attachment_and_comes_first() -> None:
    annotations = {DEFAULT: "rdma-a", NETS: json.dumps([{"name": "rdma-b", "cni-args": {"x": 1}}])}
    sels = pod_selections("pod team-a/p", "team-a", annotations, lambda s: s.name.startswith("rdma-"))
    assert [(s.namespace, s.name) for s in sels] == [("", "rdma-a"), ("team-a", "rdma-b")]
    got = demands("rdma-a", "rdma-b").of_pod(so.pod("p", annotations))
    assert got is not None and [n for n, _ in got.networks] == ["rdma-a", "rdma-b"]
    # Unqualified, it is looked up in Multus' namespace, which the extender is not told: any namespace.
    assert count({DEFAULT: "rdma-a"}, "infra/rdma-a") == 1
    assert count({DEFAULT: "infra/rdma-a"}, "infra/rdma-a") == 1
    assert count({DEFAULT: "other/rdma-a"}, "infra/rdma-a") == 0


@pytest.mark.parametrize(
    "annotations",
    [
        {NETS: "rdma-a", DEFAULT: "a,b"},  # more than one default network
        {NETS: "rdma-a", DEFAULT: "[]"},  # none: Multus panics
        {NETS: "rdma-a", DEFAULT: ""},
        {NETS: "rdma-a, Rdma-b"},  # a comma-form name that is not a DNS label
        {NETS: '[{"name": "rdma-a"}, null]'},  # Multus dereferences the null and panics
        {NETS: '[{"name": "rdma-a", "interface": 5}]'},  # a type error fails the whole annotation
        {NETS: '[{"name": "rdma-a", "cni-args": {"n": 1e400}}]'},  # overflows float64
        {NETS: '[{"name": "rdma-a", "bandwidth": {"ingressRate": 1.5}}]'},  # not an int
        {NETS: '[{"name": "rdma-a", "portMappings": [{"protocol": 6}]}]'},  # not a string
        {NETS: '[{"name": "rdma-a", "portMappings": {}}]'},  # not a list
        {NETS: '[{"name": "rdma-a", "ips": [null]}]'},  # null decodes as "", which is no address
        {NETS: '[{"name": "rdma-a", "default-route": [5]}]'},  # not a string
    ],
)
def test_a_pod_multus_fails_has_no_attachment(annotations: dict[str, str]) -> None:
    assert count(annotations) == 0


def test_the_reader_says_multus_fails() -> None:
    with pytest.raises(MultusFails):
        read_networks('{"name": "rdma-a"}', "team-a")
    with pytest.raises(MultusFails):
        read_default_network("[]", "kube-system")
    assert read_default_network(None, "kube-system") is None


@pytest.mark.parametrize(
    ("value", "phrase"),
    [
        ('[{"name": "rdma-a", "x": ' + "[" * 3000 + "]" * 3000 + "}]", "nested 3002 levels deep"),
        ("rdma-a" + " " * (256 * 1024), "over the API server's 262144"),
        (",".join(["a"] * 1025), "selects 1025 networks; the extender reads at most 1024"),
        (json.dumps([{"name": "a"}] * 1025), "selects 1025 networks; the extender reads at most 1024"),
        ('[{"name": "rdma-a", "ips": ["fe80::1%eth0"]}]', "ips holds an address"),
        (
            '[{"name": "rdma-a", "default-route": ["10.0.0.1"], "default-route": []}]',
            "default-route is repeated",
        ),
        ('[{"name": "rdma-a", "mac": "02:00:00:00:00"}]', "mac is not a plain"),
    ],
)
def test_what_cannot_be_read_as_multus_does_refuses_the_pod(value: str, phrase: str) -> None:
    with pytest.raises(UnreadableNetworks) as err:
        demands("rdma-a").of_pod(so.pod("p", {NETS: value}))
    assert isinstance(err.value, InvalidPodRequest) and err.value.code == 101
    assert err.value.msg.startswith(
        f"pod team-a/p annotation {NETS} cannot be read exactly as Multus reads it"
    )
    assert phrase in err.value.msg and len(err.value.msg) < 400


def test_a_doubt_refuses_only_a_pod_that_selects_an_rdma_network() -> None:
    value = '[{"name": "macvlan", "ips": ["fe80::1%eth0"]}]'
    assert demands("rdma-a").of_pod(so.pod("p", {NETS: value})) is None


def test_a_non_string_annotation_refuses() -> None:
    with pytest.raises(UnreadableNetworks, match="is not a string"):
        demands("rdma-a").of_pod(so.pod("p", {NETS: ["rdma-a"]}))  # type: ignore[dict-item]


def test_attachments_per_pod_are_bounded() -> None:
    assert count({NETS: ",".join(["rdma-a"] * MAX_ATTACHMENTS)}) == MAX_ATTACHMENTS
    over = {NETS: ",".join(["rdma-a"] * 1000)}
    with pytest.raises(TooManyAttachments) as err:
        demands("rdma-a").of_pod(so.pod("p", over))
    assert err.value.code == 101
    assert (
        f"at most {MAX_ATTACHMENTS} rdma-cni attachments" in err.value.msg and "1000 times" in err.value.msg
    )
    # Other networks do not count toward the bound.
    assert count({NETS: ",".join(["macvlan"] * 1000 + ["rdma-a"])}) == 1
    one = demands("rdma-a").of_pod(so.pod("q", {NETS: "rdma-a"}))
    assert one is not None and one.requests == (placement.Request(0, 0),)


def test_text_no_api_server_sends_refuses() -> None:
    with pytest.raises(UnreadableNetworks, match="lone surrogate"):
        read_networks("\ud800rdma-a", "team-a")
    with pytest.raises(UnreadableNetworks, match="is not a string"):
        selected_networks("team-a", 5)
    with pytest.raises(UnreadableNetworks, match=f"annotation {DEFAULT} is not a string"):
        demands("rdma-a").of_pod(so.pod("p", {DEFAULT: 5}))  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("value", "phrase"),
    [
        (",".join(["rdma-a"] * 3000), "selects 3000 networks; the extender reads at most 1024"),
        (",".join(["rdma-a"] * 33), "selects rdma-cni networks 33 times"),
        ('[{"name": "rdma-a", "x": ' + "[" * 3000 + "]" * 3000 + "}]", "nested 3002 levels deep"),
        (_nested(100_000), "nested 100000 levels deep; the extender reads at most 512"),
    ],
)
def test_the_filter_answers_a_refusal_once_at_5000_nodes(value: str, phrase: str) -> None:
    from tests.unit.test_extender_bounds import filter_bytes, make

    ext, names = make()
    body, _ = filter_bytes(ext, so.pod("p", {NETS: value}), names)
    out = json.loads(body)
    assert out["Error"].startswith("rdma-cni: pod team-a/p") and phrase in out["Error"]
    assert out["FailedAndUnresolvableNodes"] == {} and len(body) < 2048


@pytest.mark.parametrize("depth", [10, 512, 513, 1_000, 100_000])
def test_nesting_is_read_to_the_bound_and_refused_past_it(depth: int) -> None:
    """Any depth up to the annotation size: counted up to 512 levels, a typed refusal past it.

    Never a RecursionError, whatever the caller's stack, and bounded in time and memory.
    """
    value = _nested(depth)
    tracemalloc.start()
    began = time.perf_counter()
    try:
        if depth <= 512:
            assert count({NETS: value}) == 1
            (sel,) = read_networks(value, "team-a").selections
            assert sel.cni_args is not None and "x" in sel.cni_args
        else:
            with pytest.raises(UnreadableNetworks) as err:
                demands("rdma-a").of_pod(so.pod("p", {NETS: value}))
            assert err.value.code == 101 and err.value.msg.startswith(f"pod team-a/p annotation {NETS}")
            assert f"is nested {depth} levels deep; the extender reads at most 512" in err.value.msg
        elapsed = time.perf_counter() - began
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 2.0  # ~30 ms at 100,000 levels when quiet; generous for a loaded machine
    assert peak < 20 * len(value) + (1 << 20), peak


def test_the_bound_holds_on_a_deep_stack() -> None:
    """Text at the bound is read the same with 400 frames already on the stack (an HTTP thread's)."""

    def at(depth: int) -> int:
        if depth:
            return at(depth - 1)
        return count({NETS: _nested(512)})

    assert at(400) == 1


def test_brackets_inside_strings_do_not_count() -> None:
    args = {"x": "[{" * 5000 + "\\", "y": '\\"' + "[" * 600}  # escaped backslashes and quotes too
    (sel,) = read_networks(json.dumps([{"name": "rdma-a", "cni-args": args}]), "team-a").selections
    assert sel.cni_args == args

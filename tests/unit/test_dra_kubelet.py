"""The kubelet plugin's gRPC (agent/dra/kubelet) answering kubelet's calls, replayed byte for byte.

The calls are tests/unit/data/kubelet-dra-wire.json: the real kubelet v1.37.2's
calls to the agent's plugin, recorded by the node tier (tests/node/test_dra.py
with ``RDMA_CNI_RECORD_DRA_WIRE``, docs/testing.md#the-kubelets-dra-calls):
registration's GetInfo and NotifyRegistrationStatus, then NodePrepareResources
and NodeUnprepareResources for one pod's claim, each request as kubelet
serialized it and each answer as the agent gave it. Beside the bytes the
fixture has the claim and its allocation as kube-apiserver had them in that
run (``api``), so what the plugin reads out of kubelet's bytes and what it
answers are checked against something the bytes did not give. What the plugin
decides about a claim is agent/dra/prepare's (a stand-in here, the
integration, cluster and node tiers run the real one); this is the wire:
registration, every claim answered, errors per claim, bounds, sockets.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from rdma_cni.agent.dra import dra_v1_pb2 as dra_pb
from rdma_cni.agent.dra import registration_v1_pb2 as reg_pb
from rdma_cni.agent.dra.kubelet import MAX_CLAIMS, KubeletPlugin
from rdma_cni.agent.dra.prepare import ClaimRef, Prepared, PreparedDevice
from rdma_cni.shared.dra import DRIVER
from tests.support.drawire import DRA, REGISTRATION, Call, api, load, provenance, replay

WIRE = Path(__file__).parent / "data" / "kubelet-dra-wire.json"
KUBELET = "v1.37.2"  # the node tier's (scripts/build_components.sh); its test_dra checks the same


class FakePreparer:
    """Answers like agent/dra/prepare: the first claim prepared, the others refused."""

    def __init__(self) -> None:
        self.asked: list[list[ClaimRef]] = []
        self.unasked: list[list[ClaimRef]] = []

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared]:
        self.asked.append(list(claims))
        out = {}
        for i, ref in enumerate(claims):
            if i == 0:
                out[ref.uid] = Prepared(
                    [
                        PreparedDevice(("if0",), "node-1", "rdma-dra-ens1f0-12345678", "share-a"),
                        PreparedDevice(("if1",), "node-1", "rdma-dra-ens1f0-12345678", "share-b"),
                    ]
                )
            else:
                out[ref.uid] = Prepared(error=f"rdma-cni: claim {ref}: it is not allocated")
        return out

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        self.unasked.append(list(claims))
        return {ref.uid: "" for ref in claims}


class RecordedPreparer:
    """Prepares the recorded run's claim as the real agent did there, from the API's allocation."""

    def __init__(self) -> None:
        seen = api(str(WIRE))
        self.claims = [ClaimRef(c["namespace"], c["uid"], c["name"]) for c in seen["claims"]]
        self.devices = [
            PreparedDevice((a["request"],), a["pool"], a["device"], a["shareID"]) for a in seen["allocation"]
        ]
        self.asked: list[list[ClaimRef]] = []
        self.unasked: list[list[ClaimRef]] = []

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared]:
        self.asked.append(list(claims))
        return {ref.uid: Prepared(list(self.devices)) for ref in claims}

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        self.unasked.append(list(claims))
        return {ref.uid: "" for ref in claims}


@contextlib.contextmanager
def serve(tmp_path: Path, preparer: object) -> Iterator[KubeletPlugin]:
    # A short path: a unix socket's path is at most 107 bytes.
    base = Path(f"/tmp/dra-{os.getpid()}-{tmp_path.name[-12:]}")
    served = KubeletPlugin(
        preparer,  # type: ignore[arg-type]
        registry_dir=str(base / "plugins_registry"),
        plugin_dir=str(base / "plugins" / DRIVER),
    )
    served.start()
    try:
        yield served
    finally:
        served.stop(0)
        import shutil

        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[tuple[KubeletPlugin, FakePreparer]]:
    preparer = FakePreparer()
    with serve(tmp_path, preparer) as served:
        yield served, preparer


@pytest.fixture
def recorded(tmp_path: Path) -> Iterator[tuple[KubeletPlugin, RecordedPreparer]]:
    preparer = RecordedPreparer()
    with serve(tmp_path, preparer) as served:
        yield served, preparer


def sockets(p: KubeletPlugin) -> dict[str, str]:
    return {"registration": p.registration_socket, "dra": p.endpoint}


def test_the_fixture_is_the_real_kubelets_registration_then_one_pods_claim() -> None:
    source, calls = load(str(WIRE))
    made = provenance(str(WIRE))
    assert source.startswith(f"recorded from the real kubelet {KUBELET}") and made["kubelet"] == KUBELET
    assert made["recorded"] and made["how"] and made["normalized"]
    assert [(c.socket, c.method) for c in calls] == [
        ("registration", REGISTRATION + "GetInfo"),
        ("registration", REGISTRATION + "NotifyRegistrationStatus"),
        ("dra", DRA + "NodePrepareResources"),
        ("dra", DRA + "NodeUnprepareResources"),
    ]
    # kubelet's deadlines (the plugin's docstring): GetInfo within 1 s, 5 s for the verdict,
    # 45 s for each of the DRA calls; all of them answered by the agent.
    assert [c.timeout for c in calls] == [1, 5, 45, 45]
    assert all(c.code == "OK" and c.answer is not None for c in calls)
    assert all((c.user_agent or "").startswith("grpc-go/") for c in calls)


def test_python_serializes_kubelets_requests_to_kubelets_bytes() -> None:
    # The cluster tier, which has no kubelet, sends these requests itself (tests/support/kube/dra.py):
    # built from the claim the API had, Python's protobuf gives the bytes the real kubelet sent.
    _, calls = load(str(WIRE))
    refs = [dra_pb.Claim(**c) for c in api(str(WIRE))["claims"]]
    assert calls[0].request == reg_pb.InfoRequest().SerializeToString() == b""
    assert calls[1].request == reg_pb.RegistrationStatus(plugin_registered=True).SerializeToString()
    assert calls[2].request == dra_pb.NodePrepareResourcesRequest(claims=refs).SerializeToString()
    assert calls[3].request == dra_pb.NodeUnprepareResourcesRequest(claims=refs).SerializeToString()


def test_kubelets_calls_are_answered_as_the_agent_answered_kubelet(
    recorded: tuple[KubeletPlugin, RecordedPreparer],
) -> None:
    served, preparer = recorded
    _, calls = load(str(WIRE))
    answers = replay(calls, sockets(served))
    assert [code for code, _ in answers] == ["OK"] * 4

    # GetInfo: the recorded answer but for the endpoint, which is this plugin's own socket.
    info = reg_pb.PluginInfo.FromString(answers[0][1])
    assert (info.type, info.name, list(info.supported_versions)) == ("DRAPlugin", DRIVER, ["v1.DRAPlugin"])
    assert info.endpoint == served.endpoint
    expected = reg_pb.PluginInfo.FromString(calls[0].answer)
    expected.endpoint = served.endpoint
    assert answers[0][1] == expected.SerializeToString()
    assert answers[1][1] == calls[1].answer and served.registered is True

    # kubelet's claim read out of its bytes is the claim kube-apiserver had, and the answers are
    # the bytes the real kubelet took from the agent.
    assert preparer.asked == [preparer.claims] and preparer.unasked == [preparer.claims]
    assert answers[2][1] == calls[2].answer
    assert answers[3][1] == calls[3].answer


def test_a_claim_refused_among_others_is_answered_with_its_error(
    plugin: tuple[KubeletPlugin, FakePreparer],
) -> None:
    # kubelet's recorded request with a second claim after its own (repeated fields concatenate):
    # every claim asked about is answered, the refused one with its error and no device.
    served, preparer = plugin
    _, calls = load(str(WIRE))
    second = dra_pb.NodePrepareResourcesRequest(
        claims=[dra_pb.Claim(namespace="ml", uid="8e429df2-3685-44e6-88ec-31a0f2e3d8c7", name="gpu")]
    )
    request = calls[2].request + second.SerializeToString()
    call = Call("dra", DRA + "NodePrepareResources", request)
    ((code, answer),) = replay([call], sockets(served))
    assert code == "OK"
    asked = dra_pb.NodePrepareResourcesRequest.FromString(request)
    first_uid, second_uid = (c.uid for c in asked.claims)
    assert [r.uid for r in preparer.asked[0]] == [first_uid, second_uid]
    prepared = dra_pb.NodePrepareResourcesResponse.FromString(answer)
    assert set(prepared.claims) == {first_uid, second_uid}
    devices = prepared.claims[first_uid].devices
    assert [(list(d.request_names), d.pool_name, d.device_name, d.share_id) for d in devices] == [
        (["if0"], "node-1", "rdma-dra-ens1f0-12345678", "share-a"),
        (["if1"], "node-1", "rdma-dra-ens1f0-12345678", "share-b"),
    ]
    assert prepared.claims[first_uid].error == ""
    assert prepared.claims[second_uid].error == "rdma-cni: claim ml/gpu: it is not allocated"
    assert not prepared.claims[second_uid].devices


def test_a_refused_registration_is_remembered(plugin: tuple[KubeletPlugin, FakePreparer]) -> None:
    served, _ = plugin
    status = reg_pb.RegistrationStatus(plugin_registered=False, error="no handler")
    call = Call("registration", REGISTRATION + "NotifyRegistrationStatus", status.SerializeToString())
    assert replay([call], sockets(served))[0][0] == "OK"
    assert served.registered is False and served.registration_error == "no handler"


def test_too_many_claims_and_garbage_are_refused(plugin: tuple[KubeletPlugin, FakePreparer]) -> None:
    served, preparer = plugin
    many = dra_pb.NodePrepareResourcesRequest(
        claims=[dra_pb.Claim(namespace="a", uid=f"u{i}", name=f"c{i}") for i in range(MAX_CLAIMS + 1)]
    )
    calls = [
        Call("dra", DRA + "NodePrepareResources", many.SerializeToString()),
        Call("dra", DRA + "NodeUnprepareResources", many.SerializeToString()),
        Call("dra", DRA + "NodePrepareResources", b"\xff\xff\xff"),  # not a message
        Call("dra", DRA + "NoSuchMethod", b""),
        Call("registration", DRA + "NodePrepareResources", many.SerializeToString()),  # wrong socket
    ]
    codes = [code for code, _ in replay(calls, sockets(served))]
    assert codes == ["INVALID_ARGUMENT", "INVALID_ARGUMENT", "INTERNAL", "UNIMPLEMENTED", "UNIMPLEMENTED"]
    assert preparer.asked == [] and preparer.unasked == []


def test_sockets_are_private_and_go_with_the_plugin(tmp_path: Path) -> None:
    base = Path(f"/tmp/dra-s-{os.getpid()}")
    served = KubeletPlugin(FakePreparer(), registry_dir=str(base / "r"), plugin_dir=str(base / "p"))  # type: ignore[arg-type]
    served.start()
    try:
        for path in (served.registration_socket, served.endpoint):
            assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.path.basename(served.registration_socket).startswith(f"{DRIVER}-")
        assert served.registration_socket.endswith("-reg.sock")
    finally:
        served.stop(0)
    assert not os.path.exists(served.registration_socket) and not os.path.exists(served.endpoint)
    import shutil

    shutil.rmtree(base, ignore_errors=True)


def test_a_dead_agents_sockets_are_removed_a_live_ones_kept() -> None:
    base = Path(f"/tmp/dra-d-{os.getpid()}")
    registry = base / "r"
    registry.mkdir(parents=True)
    dead = registry / f"{DRIVER}-deadbeef-reg.sock"
    live = registry / f"{DRIVER}-0badcafe-reg.sock"
    stranger = registry / "other.example.com-reg.sock"
    not_a_socket = registry / f"{DRIVER}-notsock-reg.sock"
    not_a_socket.write_text("a file that is no socket: never ours to remove")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(live))
    listener.listen()
    for path in (dead, stranger):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()  # bound, never listening: nobody answers
    served = KubeletPlugin(FakePreparer(), registry_dir=str(registry), plugin_dir=str(base / "p"))  # type: ignore[arg-type]
    served.start()
    try:
        assert not dead.exists() and live.exists() and stranger.exists() and not_a_socket.exists()
    finally:
        served.stop(0)
        listener.close()
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_a_socket_that_cannot_be_served_fails_the_start(tmp_path: Path) -> None:
    base = Path(f"/tmp/dra-f-{os.getpid()}")
    (base / "p").mkdir(parents=True, exist_ok=True)
    (base / "r").write_text("a file where the registry directory should be")
    served = KubeletPlugin(FakePreparer(), registry_dir=str(base / "r"), plugin_dir=str(base / "p"))  # type: ignore[arg-type]
    with pytest.raises((OSError, RuntimeError)):
        served.start()
    assert served._servers == []  # the DRA socket's server was stopped again
    import shutil

    shutil.rmtree(base, ignore_errors=True)


def test_kubelet_dials_the_registration_socket_by_its_path(
    plugin: tuple[KubeletPlugin, FakePreparer],
) -> None:
    # grpc-go's passthrough resolver makes the path the :authority; grpcio must not mind.
    served, _ = plugin
    with grpc.insecure_channel(
        f"unix:{served.registration_socket}", options=[("grpc.default_authority", served.registration_socket)]
    ) as channel:
        answer = channel.unary_unary(REGISTRATION + "GetInfo")(b"", timeout=5)
    assert reg_pb.PluginInfo.FromString(answer).name == DRIVER


def test_the_recorder_forwards_and_keeps_every_call(plugin: tuple[KubeletPlugin, FakePreparer]) -> None:
    # What the node tier puts between the real kubelet and the agent to record kubelet's calls.
    from tests.support.drawire import Recorder

    served, _ = plugin
    base = Path(served.endpoint).parent.parent.parent
    listen = {"registration": str(base / "rec-reg.sock"), "dra": str(base / "rec-dra.sock")}
    recorder = Recorder(listen, sockets(served))
    recorder.start()
    try:
        _, calls = load(str(WIRE))
        direct = replay(calls, sockets(served))
        through = replay(calls, listen)
    finally:
        recorder.stop()
    assert [code for code, _ in through] == ["OK"] * 4
    assert through[0] == direct[0]  # the same plugin, the same answers
    assert [(c.socket, c.method, c.request) for c in recorder.calls] == [
        (c.socket, c.method, c.request) for c in calls
    ]
    assert all(c.answer is not None for c in recorder.calls)
    saved = recorder.to_json("test")
    assert '"source": "test"' in saved and saved.count('"method"') == 4

"""kubelet's calls to a DRA plugin, as bytes: recorded, replayed, and (until recorded) built from its source.

A call is the gRPC method's path, the request's serialized protobuf message
(base64 in the fixture) and the socket it went to (``registration`` or
``dra``). :func:`replay` sends recorded calls, byte for byte, to a plugin's
sockets and returns the raw answers; :class:`Recorder` stands where kubelet
expects the plugin (both sockets), forwards each call's bytes unchanged to
the real plugin's sockets and remembers them: the node tier records the real
kubelet v1.37.2 through it.

:func:`from_source` builds the calls the way kubelet v1.37.2's code builds
them, for the unit tier until the recording exists:
``pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`` dials the
registration socket by its path (so the path is the call's authority),
calls ``GetInfo(&InfoRequest{})`` and, once it has taken the plugin,
``NotifyRegistrationStatus(&RegistrationStatus{PluginRegistered: true})``;
``pkg/kubelet/cm/dra/manager.go`` sends ``NodePrepareResourcesRequest{Claims:
[{Namespace, Uid, Name}]}`` with the claims of a pod, and the same claims in
``NodeUnprepareResourcesRequest`` when the pod is done. Go's protobuf and
Python's serialize these messages to the same bytes (fields in number order,
no unknown fields), so the bytes are kubelet's.

    python -m tests.support.drawire > tests/unit/data/kubelet-dra-wire.json
"""

from __future__ import annotations

import base64
import json
import sys
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

REGISTRATION = "/pluginregistration.Registration/"
DRA = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/"
SOURCE = (
    "built from kubelet v1.37.2's source (pluginmanager/operationexecutor/operation_generator.go, "
    "cm/dra/manager.go) by tests/support/drawire.py"
)


@dataclass
class Call:
    """One unary call: where it went, the method's path, the request's bytes."""

    socket: str  # "registration" or "dra"
    method: str
    request: bytes
    answer: bytes | None = None
    code: str = "OK"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "socket": self.socket,
            "method": self.method,
            "request": base64.b64encode(self.request).decode(),
        }
        if self.answer is not None:
            doc["answer"] = base64.b64encode(self.answer).decode()
        doc["code"] = self.code
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Call:
        answer = doc.get("answer")
        return cls(
            doc["socket"],
            doc["method"],
            base64.b64decode(doc["request"]),
            base64.b64decode(answer) if answer is not None else None,
            doc.get("code", "OK"),
        )


def from_source(claims: list[tuple[str, str, str]]) -> list[Call]:
    """kubelet's calls for one pod with ``claims`` ((namespace, uid, name) each), as its source makes them."""
    from rdma_cni.agent.dra import dra_v1_pb2 as dra_pb
    from rdma_cni.agent.dra import registration_v1_pb2 as reg_pb

    refs = [dra_pb.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]
    return [
        Call("registration", REGISTRATION + "GetInfo", reg_pb.InfoRequest().SerializeToString()),
        Call(
            "registration",
            REGISTRATION + "NotifyRegistrationStatus",
            reg_pb.RegistrationStatus(plugin_registered=True).SerializeToString(),
        ),
        Call(
            "dra",
            DRA + "NodePrepareResources",
            dra_pb.NodePrepareResourcesRequest(claims=refs).SerializeToString(),
        ),
        Call(
            "dra",
            DRA + "NodeUnprepareResources",
            dra_pb.NodeUnprepareResourcesRequest(claims=refs).SerializeToString(),
        ),
    ]


def _channel(path: str, authority: str | None) -> grpc.Channel:
    options = [("grpc.default_authority", authority)] if authority else []
    return grpc.insecure_channel(f"unix:{path}", options=options)


def replay(calls: list[Call], sockets: dict[str, str], timeout: float = 45) -> list[tuple[str, bytes | None]]:
    """Send each call's bytes to ``sockets[call.socket]``; (status code name, answer bytes) per call.

    The registration socket is dialled as kubelet dials it, by its path (the call's authority).
    """
    out: list[tuple[str, bytes | None]] = []
    channels = {
        name: _channel(path, path if name == "registration" else None) for name, path in sockets.items()
    }
    try:
        for call in calls:
            method = channels[call.socket].unary_unary(call.method)
            try:
                out.append(("OK", method(call.request, timeout=timeout)))
            except grpc.RpcError as exc:
                out.append((exc.code().name, None))
    finally:
        for channel in channels.values():
            channel.close()
    return out


@dataclass
class Recorder:
    """Serves ``listen`` (name -> socket path, where kubelet looks) and forwards to ``target`` (the plugin).

    Every call's bytes both ways are kept in :attr:`calls`, in arrival order.
    """

    listen: dict[str, str]
    target: dict[str, str]
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: list[grpc.Server] = []

    def _handler(self, name: str) -> grpc.GenericRpcHandler:
        channel = _channel(self.target[name], None)
        recorder = self

        class Forward(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
                method = details.method

                def call(request: bytes, context: grpc.ServicerContext) -> bytes:
                    entry = Call(name, method, request)
                    with recorder._lock:
                        recorder.calls.append(entry)
                    try:
                        entry.answer = channel.unary_unary(method)(request, timeout=60)
                    except grpc.RpcError as exc:
                        entry.code = exc.code().name
                        context.abort(exc.code(), exc.details() or "")
                    return entry.answer

                return grpc.unary_unary_rpc_method_handler(call)

        return Forward()

    def start(self) -> None:
        """Listen on every socket of :attr:`listen`."""
        for name, path in self.listen.items():
            server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[self._handler(name)])
            server.add_insecure_port(f"unix:{path}")
            server.start()
            self._servers.append(server)

    def stop(self) -> None:
        for server in self._servers:
            server.stop(0).wait()

    def to_json(self, source: str) -> str:
        with self._lock:
            return json.dumps({"source": source, "calls": [c.to_json() for c in self.calls]}, indent=1)


def load(path: str) -> tuple[str, list[Call]]:
    """A fixture's source line and its calls."""
    with open(path) as f:
        doc = json.load(f)
    return doc["source"], [Call.from_json(c) for c in doc["calls"]]


if __name__ == "__main__":
    calls = from_source(
        [
            ("ml", "0f3c2a9e-6d4b-4c7e-9a1f-2b8d3e4f5a61", "trainer-0-rdma-x7k2p"),
            ("ml", "8e429df2-3685-44e6-88ec-31a0f2e3d8c7", "trainer-0-gpu-q9w4z"),
        ]
    )
    sys.stdout.write(json.dumps({"source": SOURCE, "calls": [c.to_json() for c in calls]}, indent=1) + "\n")

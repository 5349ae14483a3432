"""kubelet's calls to a DRA plugin, as bytes: recorded from the real kubelet, and replayed.

A call is the gRPC method's path, the request's serialized protobuf message
(base64 in the fixture) and the socket it went to (``registration`` or
``dra``); recorded, also the plugin's answer, its status, the deadline the
caller gave and its user agent. :class:`Recorder` stands where kubelet expects
the plugin (both sockets), forwards each call's bytes unchanged to the real
plugin's sockets and remembers them: the node tier records kubelet v1.37.2
through it (tests/node/test_dra.py, ``RDMA_CNI_RECORD_DRA_WIRE``), into
tests/unit/data/kubelet-dra-wire.json. :func:`replay` sends recorded calls,
byte for byte, to a plugin's sockets and returns the raw answers.
"""

from __future__ import annotations

import base64
import json
import math
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

REGISTRATION = "/pluginregistration.Registration/"
DRA = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/"


@dataclass
class Call:
    """One unary call: where it went, the method's path, the request's bytes."""

    socket: str  # "registration" or "dra"
    method: str
    request: bytes
    answer: bytes | None = None
    code: str = "OK"
    # What the caller sent besides the message, as recorded (not replayed): its deadline in whole
    # seconds (the time left when the call arrived, rounded up) and its user agent.
    timeout: int | None = None
    user_agent: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "socket": self.socket,
            "method": self.method,
            "request": base64.b64encode(self.request).decode(),
        }
        if self.answer is not None:
            doc["answer"] = base64.b64encode(self.answer).decode()
        doc["code"] = self.code
        if self.timeout is not None:
            doc["timeout"] = self.timeout
        if self.user_agent is not None:
            doc["user_agent"] = self.user_agent
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
            doc.get("timeout"),
            doc.get("user_agent"),
        )


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
                    left = context.time_remaining()
                    if left is not None and left < 1e6:  # grpcio says "no deadline" with a huge number
                        entry.timeout = math.ceil(left)
                    agents = [v for k, v in context.invocation_metadata() if k == "user-agent"]
                    entry.user_agent = str(agents[0]) if agents else None
                    with recorder._lock:
                        recorder.calls.append(entry)
                    try:
                        entry.answer = channel.unary_unary(method)(
                            request, timeout=min(left, 60) if left is not None else 60
                        )
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

    def to_json(
        self, source: str, provenance: dict[str, Any] | None = None, api: dict[str, Any] | None = None
    ) -> str:
        """The fixture: ``source``, ``provenance``, ``api`` (what the run knew besides the bytes), calls."""
        with self._lock:
            doc: dict[str, Any] = {"source": source}
            if provenance is not None:
                doc["provenance"] = provenance
            if api is not None:
                doc["api"] = api
            doc["calls"] = [c.to_json() for c in self.calls]
            return json.dumps(doc, indent=1) + "\n"


def load(path: str) -> tuple[str, list[Call]]:
    """A fixture's source line and its calls."""
    with open(path) as f:
        doc = json.load(f)
    return doc["source"], [Call.from_json(c) for c in doc["calls"]]


def provenance(path: str) -> dict[str, Any]:
    """A recorded fixture's provenance (kubelet's version, when, how, what was normalized)."""
    with open(path) as f:
        return dict(json.load(f).get("provenance", {}))


def api(path: str) -> dict[str, Any]:
    """A recorded fixture's ``api``: the claims and allocation kube-apiserver had in that run."""
    with open(path) as f:
        return dict(json.load(f).get("api", {}))

"""kubelet's DRA plugin service (v1) and plugin registration, served to kubelet over two unix sockets.

kubelet finds plugins by their registration socket in its plugin registry
(``/var/lib/kubelet/plugins_registry``): it calls ``GetInfo`` (within 1 s),
checks the answer (type ``DRAPlugin``, this driver's name, the endpoint of
the DRA service and ``v1.DRAPlugin`` among the services), and says with
``NotifyRegistrationStatus`` whether it took the plugin
(k8s.io/kubernetes pkg/kubelet/pluginmanager and pkg/kubelet/cm/dra/plugin,
v1.37). It then calls ``NodePrepareResources`` before a pod's sandbox exists
and ``NodeUnprepareResources`` once its containers stopped, each with the
pod's claims of this driver (namespace, uid, name) and 45 s to answer; every
claim gets an entry in the answer, its ``error`` set when it failed
(:mod:`.prepare` decides).

The messages are generated at build time from k8s.io/kubelet's own .proto
files (``dra_v1_pb2``, ``registration_v1_pb2``: scripts/kubelet_protos.sh);
the services are served with grpcio's generic handlers, under the method
paths those files define, so nothing of gRPC is written here.

Each agent's sockets have names of their own (``rdma-cni.io-<id>-reg.sock``,
``dra-<id>.sock``, 0600): during a rollout the old and the new agent are both
registered, and kubelet calls the one that is connected, the newest first
(its DRA plugin manager keeps every registration of a driver). grpcio removes
a unix socket's path when it stops listening, whoever's file is there by
then, so a shared name would let the old agent remove the new one's socket.
At start, sockets of this driver that nobody serves any more (an agent
killed) are removed.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import stat
from concurrent import futures
from typing import Any

import grpc

from rdma_cni.agent.dra import dra_v1_pb2 as dra_pb
from rdma_cni.agent.dra import registration_v1_pb2 as reg_pb
from rdma_cni.agent.dra.prepare import ClaimRef, Preparer
from rdma_cni.shared.dra import DRIVER

log = logging.getLogger("rdma_cni.agent")

__all__ = ["DEFAULT_PLUGIN_DIR", "DEFAULT_REGISTRY_DIR", "MAX_CLAIMS", "KubeletPlugin"]

DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_PLUGIN_DIR = f"/var/lib/kubelet/plugins/{DRIVER}"
PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1 constants.go
SERVICE_VERSION = "v1.DRAPlugin"  # dra/v1 types.go: DRAPluginService
# A pod has at most as many claims as it has containers and claim references; kubelet sends the
# claims of one pod (or of the pods it starts together). More than this is no kubelet.
MAX_CLAIMS = 256


def _service(descriptor: Any) -> str:
    return str(descriptor.full_name)


DRA_SERVICE = _service(dra_pb.DESCRIPTOR.services_by_name["DRAPlugin"])
REGISTRATION_SERVICE = _service(reg_pb.DESCRIPTOR.services_by_name["Registration"])


def _claims(request: Any, context: grpc.ServicerContext) -> list[ClaimRef]:
    if len(request.claims) > MAX_CLAIMS:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.claims)} claims, the limit is {MAX_CLAIMS}"
        )
    return [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]


class KubeletPlugin:
    """The two gRPC servers kubelet talks to; :meth:`start`, then :meth:`stop`."""

    def __init__(
        self,
        preparer: Preparer,
        *,
        registry_dir: str = DEFAULT_REGISTRY_DIR,
        plugin_dir: str = DEFAULT_PLUGIN_DIR,
    ) -> None:
        self.preparer = preparer
        ident = secrets.token_hex(4)
        self.registration_socket = os.path.join(registry_dir, f"{DRIVER}-{ident}-reg.sock")
        self.endpoint = os.path.join(plugin_dir, f"dra-{ident}.sock")
        self.registered: bool | None = None  # what kubelet last said
        self.registration_error = ""
        self._servers: list[grpc.Server] = []

    # -- Registration

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The plugin's identity: kubelet registers it under the driver's name."""
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE, name=DRIVER, endpoint=self.endpoint, supported_versions=[SERVICE_VERSION]
        )

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        """kubelet's verdict on the registration, logged (an error means kubelet will not call us)."""
        self.registered = bool(request.plugin_registered)
        self.registration_error = request.error
        if request.plugin_registered:
            log.info("DRA: kubelet registered the %s plugin (%s)", DRIVER, self.endpoint)
        else:
            log.error("DRA: kubelet refused the %s plugin: %s", DRIVER, request.error)
        return reg_pb.RegistrationStatusResponse()

    # -- DRAPlugin

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Prepare each claim (:meth:`Preparer.prepare`); every claim asked about is answered."""
        outcome = self.preparer.prepare(_claims(request, context))
        answer = dra_pb.NodePrepareResourcesResponse()
        for uid, prepared in outcome.items():
            entry = answer.claims[uid]
            if prepared.error:
                entry.error = prepared.error
                continue
            for dev in prepared.devices:
                entry.devices.add(
                    request_names=list(dev.requests),
                    pool_name=dev.pool,
                    device_name=dev.device,
                    share_id=dev.share_id,
                )
        return answer

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Drop each claim's preparation (:meth:`Preparer.unprepare`)."""
        outcome = self.preparer.unprepare(_claims(request, context))
        answer = dra_pb.NodeUnprepareResourcesResponse()
        for uid, error in outcome.items():
            answer.claims[uid].error = error
        return answer

    # -- serving

    def _handlers(self, service: str, methods: dict[str, tuple[Any, Any, Any]]) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            service,
            {
                name: grpc.unary_unary_rpc_method_handler(
                    call, request_deserializer=req.FromString, response_serializer=resp.SerializeToString
                )
                for name, (call, req, resp) in methods.items()
            },
        )

    def start(self) -> None:
        """Serve the DRA service on :attr:`endpoint`, then registration (kubelet calls the endpoint next).

        OSError or RuntimeError when a socket cannot be served.
        """
        dra = self._handlers(
            DRA_SERVICE,
            {
                "NodePrepareResources": (
                    self.NodePrepareResources,
                    dra_pb.NodePrepareResourcesRequest,
                    dra_pb.NodePrepareResourcesResponse,
                ),
                "NodeUnprepareResources": (
                    self.NodeUnprepareResources,
                    dra_pb.NodeUnprepareResourcesRequest,
                    dra_pb.NodeUnprepareResourcesResponse,
                ),
            },
        )
        registration = self._handlers(
            REGISTRATION_SERVICE,
            {
                "GetInfo": (self.GetInfo, reg_pb.InfoRequest, reg_pb.PluginInfo),
                "NotifyRegistrationStatus": (
                    self.NotifyRegistrationStatus,
                    reg_pb.RegistrationStatus,
                    reg_pb.RegistrationStatusResponse,
                ),
            },
        )
        try:
            for path, handler in ((self.endpoint, dra), (self.registration_socket, registration)):
                self._servers.append(self._serve(path, handler))
        except BaseException:
            self.stop()
            raise
        log.info("DRA: kubelet plugin serving %s, registering at %s", self.endpoint, self.registration_socket)

    def _serve(self, path: str, handler: grpc.GenericRpcHandler) -> grpc.Server:
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o750, exist_ok=True)
        _remove_dead(directory, path)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
        if not server.add_insecure_port(f"unix:{path}"):
            raise OSError(f"cannot listen on {path}")
        server.start()
        os.chmod(path, 0o600)
        return server

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving, registration first (kubelet deregisters the plugin when its socket goes).

        grpcio removes each socket as it stops listening.
        """
        for server in reversed(self._servers):
            server.stop(grace).wait(grace + 1)
        self._servers = []


def _remove_dead(directory: str, path: str) -> None:
    """Remove this driver's sockets in ``directory`` that nobody answers on (a killed agent's)."""
    mine = os.path.basename(path)
    prefix, suffix = (f"{DRIVER}-", "-reg.sock") if mine.endswith("-reg.sock") else ("dra-", ".sock")
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name == mine or not (name.startswith(prefix) and name.endswith(suffix)):
            continue
        other = os.path.join(directory, name)
        try:
            if not stat.S_ISSOCK(os.lstat(other).st_mode):
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1)
                probe.connect(other)
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                try:
                    os.unlink(other)
                    log.info("DRA: removed %s, which nobody serves", other)
                except OSError:
                    pass

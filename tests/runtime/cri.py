"""A small CRI client over gRPC, speaking to containerd the way kubelet does.

The protobuf definitions are this tier's own (``cri_api.proto``: only what it
uses, numbered as k8s.io/cri-api's runtime.v1); they are compiled with
grpcio-tools when the client is first needed, into a directory of the
caller's choosing.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
PROTO = HERE / "cri_api.proto"


def compile_cri(out_dir: str) -> tuple[ModuleType, ModuleType]:
    """Compile ``cri_api.proto`` into ``out_dir``; return the message and the service modules."""
    from grpc_tools import protoc

    os.makedirs(out_dir, exist_ok=True)
    code = protoc.main(
        ["protoc", f"-I{HERE}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", str(PROTO)]
    )
    assert code == 0, f"protoc failed on {PROTO} ({code})"
    # The generated service module imports the message module by its bare name.
    sys.path.insert(0, out_dir)
    try:
        return importlib.import_module("cri_api_pb2"), importlib.import_module("cri_api_pb2_grpc")
    finally:
        sys.path.remove(out_dir)


@dataclass
class Pod:
    """A pod sandbox as RunPodSandbox made it."""

    id: str
    config: Any  # PodSandboxConfig
    name: str
    namespace: str
    uid: str


class CriClient:
    """RuntimeService over containerd's socket."""

    def __init__(self, socket: str, gen_dir: str) -> None:
        import grpc

        self.pb, service = compile_cri(gen_dir)
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.runtime = service.RuntimeServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def version(self, timeout: float = 5) -> Any:
        return self.runtime.Version(self.pb.VersionRequest(version="v1"), timeout=timeout)

    def wait_ready(self, timeout: float = 60) -> Any:
        """Version once containerd's CRI service answers: it listens before it has initialized,
        and until then refuses every call with "server is not initialized yet" (kubelet retries)."""
        import grpc

        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.version()
            except grpc.RpcError as err:
                if "not initialized" not in str(err.details()) or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def run_pod(self, name: str, namespace: str, uid: str, annotations: dict[str, str], log_dir: str) -> Pod:
        config = self.pb.PodSandboxConfig(
            metadata=self.pb.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
            hostname=name,
            log_directory=log_dir,
            labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace},
            annotations=annotations,
        )
        reply = self.runtime.RunPodSandbox(self.pb.RunPodSandboxRequest(config=config), timeout=120)
        return Pod(reply.pod_sandbox_id, config, name, namespace, uid)

    def stop_pod(self, pod: Pod) -> None:
        self.runtime.StopPodSandbox(self.pb.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=120)

    def remove_pod(self, pod: Pod) -> None:
        self.runtime.RemovePodSandbox(self.pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id), timeout=120)

    def run_to_completion(
        self, pod: Pod, name: str, image: str, command: list[str], timeout: float = 60
    ) -> tuple[int, str]:
        """Create and start a container in ``pod``, wait for it to exit; its exit code and output."""
        config = self.pb.ContainerConfig(
            metadata=self.pb.ContainerMetadata(name=name, attempt=0),
            image=self.pb.ImageSpec(image=image),
            command=command,
            log_path=f"{name}.log",
        )
        created = self.runtime.CreateContainer(
            self.pb.CreateContainerRequest(pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config),
            timeout=60,
        )
        cid = created.container_id
        self.runtime.StartContainer(self.pb.StartContainerRequest(container_id=cid), timeout=60)
        deadline = time.monotonic() + timeout
        while True:
            status = self.runtime.ContainerStatus(
                self.pb.ContainerStatusRequest(container_id=cid), timeout=10
            ).status
            if status.state == self.pb.CONTAINER_EXITED:
                break
            assert time.monotonic() < deadline, f"container {name} still {status.state} after {timeout} s"
            time.sleep(0.1)
        return status.exit_code, read_cri_log(os.path.join(pod.config.log_directory, f"{name}.log"))


def read_cri_log(path: str) -> str:
    """The text of a CRI container log: lines of ``<time> <stream> <F|P> <text>``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 3)
            text = parts[3] if len(parts) == 4 else ""
            out.append(text if parts[2:3] == ["P"] else text + "\n")
    return "".join(out)

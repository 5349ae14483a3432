"""The NRI scenarios' driver in the guest: pods and containers through containerd's CRI, the agent too.

Runs under the guest's python3 with Debian's python3-grpcio. The CRI messages
are encoded and decoded by hand with a protobuf subset (``pb.py``, next to
this file), so no generated code has to match the guest's protobuf runtime.
Every container runs a probe script and exits; what it printed (its CRI
log) and what the guest's kernel says are collected into ``--out``
(``results.json``) for ``test_nri.py`` to assert on. Nothing here
asserts: a wrong answer is a fact for the host-side tests.

Steps, in one boot (the order matters, see ``scenarios/nri.sh``):

1. the agent registered through the recording relay; pods ``nri-a`` and
   ``nri-b`` (one VF each, through rdma-cni) and ``nri-plain`` (host network:
   no CNI, no attachment); soft-RoCE on each pod's VF, created inside its
   namespace; one container in each pod;
2. the agent restarted on containerd's socket directly: a later container
   still gets its devices;
3. containerd restarted (SIGTERM, the pods' shims keep running, started
   again with the same configuration) under the running agent: the agent
   reconnects by itself, and a new container in an existing pod gets its
   devices;
4. the agent frozen (SIGSTOP): a container is created within the runtime's
   request timeout, without devices; thawed, the agent serves again;
5. the agent stopped: a container still starts, without devices.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpc
import pb

SERVICE = "/runtime.v1.RuntimeService/"
NODE = 2  # runtime.v1.NamespaceMode NODE
EXITED = 2  # runtime.v1.ContainerState CONTAINER_EXITED
IMAGE = "docker.io/library/rdma-cni-busybox:e2e"

# The probe: one "key: value" line per fact. $1 is the other pod's uverbs MAJ:MIN, $2 this pod's.
PROBE = r"""
d=$(ls /dev/infiniband 2>/dev/null)
echo "devices: " $d
echo "memlock: $(ulimit -l)"
for f in /dev/infiniband/*; do
    [ -e "$f" ] || continue
    if ( : <"$f" ) 2>/dev/null; then echo "open $f: ok"; else echo "open $f: $( ( : <"$f" ) 2>&1 )"; fi
done
mk() {
    maj=${2%%:*}; min=${2##*:}
    if out=$(busybox mknod "/tmp/$1" c "$maj" "$min" 2>&1); then
        echo "mknod $1: ok"
        if ( : <"/tmp/$1" ) 2>/dev/null; then echo "open $1: ok"
        else echo "open $1: $( ( : <"/tmp/$1" ) 2>&1 )"; fi
    else
        echo "mknod $1: $out"
    fi
}
[ -n "$1" ] && mk other "$1"
[ -n "$2" ] && mk own "$2"
echo "done: yes"
"""


def now() -> float:
    """Monotonic seconds."""
    return time.monotonic()


class Cri:
    """The few RuntimeService calls the scenarios need, as raw protobuf over grpcio."""

    def __init__(self, socket_path: str) -> None:
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")

    def call(self, method: str, request: bytes, timeout: float = 120) -> pb.Fields:
        """One unary call; the decoded response fields."""
        stub = self.channel.unary_unary(SERVICE + method)
        return pb.decode(stub(request, timeout=timeout))

    def version(self) -> dict[str, str]:
        f = self.call("Version", pb.f_string(1, "v1"), timeout=30)
        return {"runtime": pb.string(f, 2), "version": pb.string(f, 3), "api": pb.string(f, 4)}

    @staticmethod
    def sandbox_config(name: str, log_dir: str, host_network: bool) -> bytes:
        # A UID as Kubernetes makes one (the plugin refuses others): 32 hex digits, as a static pod's.
        uid = hashlib.md5(name.encode()).hexdigest()
        meta = pb.f_string(1, name) + pb.f_string(2, uid) + pb.f_string(3, "default")
        labels = [("io.kubernetes.pod.name", name), ("io.kubernetes.pod.namespace", "default")]
        out = (
            pb.f_bytes(1, meta)
            # A host-network pod shares the node's UTS namespace: no hostname of its own.
            + pb.f_string(2, "" if host_network else name)
            + pb.f_string(3, log_dir)
            + pb.f_messages(6, [pb.f_string(1, k) + pb.f_string(2, v) for k, v in labels])
        )
        if host_network:
            # linux.security_context.namespace_options.network = NODE: no netns, so no CNI.
            out += pb.f_bytes(8, pb.f_bytes(2, pb.f_bytes(1, pb.f_varint(1, NODE))))
        return out

    def run_pod(self, name: str, host_network: bool = False) -> dict[str, Any]:
        log_dir = f"/var/log/pods/default_{name}"
        os.makedirs(log_dir, exist_ok=True)
        config = self.sandbox_config(name, log_dir, host_network)
        start = now()
        f = self.call("RunPodSandbox", pb.f_bytes(1, config), timeout=300)
        return {
            "name": name,
            "id": pb.string(f, 1),
            "config": config,
            "log_dir": log_dir,
            "host_network": host_network,
            "seconds": round(now() - start, 2),
        }

    def run_container(
        self, pod: dict[str, Any], name: str, args: list[str], timeout: float = 120
    ) -> dict[str, Any]:
        """Create, start and wait for one probe container; its log, exit code and timings."""
        linux = b""
        if pod["host_network"]:
            linux = pb.f_bytes(15, pb.f_bytes(2, pb.f_bytes(3, pb.f_varint(1, NODE))))
        config = (
            pb.f_bytes(1, pb.f_string(1, name))
            + pb.f_bytes(2, pb.f_string(1, IMAGE))
            + pb.f_string(3, "/bin/sh")
            + b"".join(pb.f_string(4, a) for a in ["-c", PROBE, "probe", *args])
            + pb.f_string(11, f"{name}.log")
            + linux
        )
        request = pb.f_string(1, pod["id"]) + pb.f_bytes(2, config) + pb.f_bytes(3, pod["config"])
        result: dict[str, Any] = {"pod": pod["name"], "name": name}
        start = now()
        try:
            created = self.call("CreateContainer", request, timeout=timeout)
        except grpc.RpcError as exc:
            result.update(
                error=f"CreateContainer: {exc.code()}: {exc.details()}", seconds=round(now() - start, 2)
            )
            return result
        result["create_seconds"] = round(now() - start, 2)
        cid = pb.string(created, 1)
        self.call("StartContainer", pb.f_string(1, cid), timeout=timeout)
        deadline = now() + timeout
        while True:
            status = pb.message(self.call("ContainerStatus", pb.f_string(1, cid), timeout=30), 1)
            if pb.integer(status, 3) == EXITED or now() > deadline:
                break
            time.sleep(0.2)
        result["seconds"] = round(now() - start, 2)
        result["exit_code"] = pb.integer(status, 7)
        result["state"] = pb.integer(status, 3)
        result["log"] = read_cri_log(os.path.join(pod["log_dir"], f"{name}.log"))
        result["facts"] = facts(result["log"])
        return result


def count(path: str, text: str) -> int:
    """Occurrences of ``text`` in the file at ``path`` (0 when it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().count(text)
    except OSError:
        return 0


def read_cri_log(path: str) -> str:
    """The text of a CRI container log (lines of ``<time> <stream> <F|P> <text>``)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError as exc:
        return f"<no log: {exc}>"
    out = []
    for line in lines:
        parts = line.rstrip("\n").split(" ", 3)
        out.append((parts[3] if len(parts) == 4 else "") + ("" if parts[2:3] == ["P"] else "\n"))
    return "".join(out)


def facts(log: str) -> dict[str, str]:
    """The probe's "key: value" lines."""
    out = {}
    for line in log.splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            out[key] = value.strip()
    return out


def record_of(state_dir: str, sandbox: str) -> dict[str, Any] | None:
    """The plugin's allocation record of a sandbox (the pod's netns path, its VFs)."""
    for path in glob.glob(os.path.join(state_dir, "attachments", f"{sandbox}@*.json")):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return None


def read_sysfs(path: str) -> str | None:
    """A sysfs attribute's text, None when absent."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def uverbs_of(ibdev: str) -> tuple[str, str] | None:
    """(uverbsN, MAJ:MIN) of an RDMA device, from sysfs."""
    for d in glob.glob("/sys/class/infiniband_verbs/uverbs*"):
        try:
            with open(os.path.join(d, "ibdev")) as f:
                if f.read().strip() != ibdev:
                    continue
            with open(os.path.join(d, "dev")) as f:
                return os.path.basename(d), f.read().strip()
        except OSError:
            continue
    return None


class Agent:
    """The node agent (``rdma-cni install --watch --node-state``), started and stopped by pid."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(args.out, "agent.log")

    def start(self, nri_socket: str) -> None:
        a = self.args
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "NODE_NAME": "e2e-guest",
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": a.api_port,
            "TMPDIR": "/tmp",
        }
        os.makedirs("/run/agent/bin", exist_ok=True)
        command = [
            a.plugin,
            "install",
            "--watch",
            "--node-state",
            f"--source={a.plugin}",
            "--cni-bin-dir=/run/agent/bin",
            "--kubeconfig-path=/run/agent/kubeconfig",
            f"--serviceaccount-dir={a.sa_dir}",
            f"--network-config={a.network_config}",
            f"--api-kubeconfig={a.api_kubeconfig}",
            f"--nri-socket={nri_socket}",
            "--memlock=unlimited",
        ]
        with open(self.log_path, "ab") as log:
            log.write(f"=== start on {nri_socket}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)

    def registrations(self) -> tuple[int, int]:
        """(times the agent synchronized, times containerd put a plugin in its list), from the logs.

        containerd answers RegisterPlugin before it configures and synchronizes the
        plugin, and sends events only once the plugin is in its list (logged as its
        "plugin invocation order"): a container created before that gets nothing.
        """
        return (
            count(self.log_path, "NRI: synchronized with the runtime"),
            count(self.args.containerd_log, "plugin invocation order"),
        )

    def wait_registered(self, before: tuple[int, int], timeout: float) -> float | None:
        """Seconds until both counts exceed ``before``'s; None on timeout."""
        start = now()
        while now() - start < timeout:
            synced, listed = self.registrations()
            if synced > before[0] and listed > before[1]:
                return round(now() - start, 2)
            time.sleep(0.2)
        return None

    def log_size(self) -> int:
        """Bytes in the agent's log so far (to cut out what it said during one step)."""
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        """What the agent logged after ``offset``."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            return f.read()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def alive(pid: int) -> bool:
    """Is the process running (a zombie, exited but not yet reaped by its parent, is not)?"""
    stat = read_sysfs(f"/proc/{pid}/stat")
    return stat is not None and stat.rsplit(")", 1)[1].split()[0] != "Z"


class Containerd:
    """containerd, started by nri.sh; stopped with SIGTERM and started again with the same config."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.config = args.containerd_config
        self.log_path = args.containerd_log
        self.pid_file = args.containerd_pidfile
        with open(self.pid_file, encoding="ascii") as f:
            self.pid = int(f.read())

    def stop(self, timeout: float) -> float | None:
        """SIGTERM, as systemd stops it (the shims, and so the pods, keep running); seconds to exit."""
        start = now()
        os.kill(self.pid, signal.SIGTERM)
        while now() - start < timeout:
            if not alive(self.pid):
                return round(now() - start, 2)
            time.sleep(0.1)
        return None

    def start(self) -> None:
        """The same command line as nri.sh's, its output appended to the same log (the counts go on)."""
        with open(self.log_path, "ab") as log:
            log.write(b"=== containerd restarted by nri_cri.py\n")
            log.flush()
            proc = subprocess.Popen(
                ["containerd", "--config", self.config], stdout=log, stderr=log, start_new_session=True
            )
        self.pid = proc.pid
        # nri.sh stops whichever containerd runs at the end.
        with open(self.pid_file, "w", encoding="ascii") as f:
            f.write(f"{self.pid}\n")


def wait_cri(socket_path: str, timeout: float) -> tuple[Cri, float | None]:
    """A fresh CRI client once the runtime answers Version (a channel that saw the runtime die backs off)."""
    start = now()
    while now() - start < timeout:
        if os.path.exists(socket_path):
            cri = Cri(socket_path)
            try:
                cri.call("Version", pb.f_string(1, "v1"), timeout=5)
                return cri, round(now() - start, 2)
            except grpc.RpcError:
                cri.channel.close()
        time.sleep(0.2)
    return Cri(socket_path), None


def main() -> int:
    """Run every step; results.json is written even when a step raises (with the error)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cri-socket", required=True)
    parser.add_argument("--nri-socket", required=True)
    parser.add_argument("--record-socket", required=True)
    parser.add_argument("--plugin", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--network-config", required=True)
    parser.add_argument("--api-kubeconfig", required=True)
    parser.add_argument("--api-port", required=True)
    parser.add_argument("--sa-dir", required=True)
    parser.add_argument("--containerd-log", required=True)
    parser.add_argument("--containerd-config", required=True)
    parser.add_argument("--containerd-pidfile", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {"steps": []}
    agent = Agent(args)

    def step(name: str) -> None:
        results["steps"].append(name)
        print(f"[{time.clock_gettime(time.CLOCK_BOOTTIME):.1f}] nri step: {name}", flush=True)

    try:
        cri = Cri(args.cri_socket)
        results["version"] = cri.version()
        step("agent via the recording relay")
        agent.start(args.record_socket)
        results["first_registration_seconds"] = agent.wait_registered(agent.registrations(), 120)

        step("pods")
        pods = {name: cri.run_pod(name) for name in ("nri-a", "nri-b")}
        pods["nri-plain"] = cri.run_pod("nri-plain", host_network=True)
        for name in ("nri-a", "nri-b"):
            pod = pods[name]
            rec = record_of(args.state_dir, pod["id"])
            pod["record"] = rec
            rxe = "rxe_" + name[-1]
            # Soft-RoCE on the pod's VF, created inside the pod's namespace (a VF moved after
            # the rxe was made would destroy it), by the VF's pod-side name eth0.
            netns = rec["netns"] if rec else "/nonexistent"
            made = subprocess.run(
                ["nsenter", f"--net={netns}", "rdma", "link", "add", rxe, "type", "rxe", "netdev", "eth0"],
                capture_output=True,
                text=True,
                check=False,
            )
            pod["rxe"] = rxe
            pod["rxe_add"] = {"rc": made.returncode, "err": made.stderr.strip()}
            pod["uverbs"] = uverbs_of(rxe)
        # A decoy in pod A: a veth of its own with an rxe on it, inside its namespace. Not a VF:
        # its device must never be injected, whatever the pod names things.
        netns_a = (pods["nri-a"]["record"] or {}).get("netns", "/nonexistent")
        decoy = []
        for command in (
            ["ip", "link", "add", "eth0-1", "type", "veth", "peer", "name", "decoy1"],
            ["ip", "link", "set", "eth0-1", "up"],
            ["rdma", "link", "add", "rxe_decoy", "type", "rxe", "netdev", "eth0-1"],
        ):
            done = subprocess.run(
                ["nsenter", f"--net={netns_a}", *command], capture_output=True, text=True, check=False
            )
            decoy.append({"command": " ".join(command), "rc": done.returncode, "err": done.stderr.strip()})
        results["decoy"] = {"steps": decoy, "uverbs": uverbs_of("rxe_decoy")}
        results["rdma_cm"] = read_sysfs("/sys/class/misc/rdma_cm/dev")
        results["pods"] = {n: {k: v for k, v in p.items() if k != "config"} for n, p in pods.items()}

        def other_own(name: str) -> list[str]:
            other = pods["nri-b" if name == "nri-a" else "nri-a"]["uverbs"]
            own = pods[name].get("uverbs")
            return [other[1] if other else "", own[1] if own else ""]

        containers: dict[str, Any] = {}
        results["containers"] = containers
        step("containers with the agent registered")
        containers["a1"] = cri.run_container(pods["nri-a"], "a1", other_own("nri-a"))
        containers["b1"] = cri.run_container(pods["nri-b"], "b1", other_own("nri-b"))
        containers["plain1"] = cri.run_container(pods["nri-plain"], "plain1", other_own("nri-a")[:1])

        step("agent restarted on the runtime's socket")
        agent.stop()
        before = agent.registrations()
        agent.start(args.nri_socket)
        results["restart_registration_seconds"] = agent.wait_registered(before, 120)
        containers["b2"] = cri.run_container(pods["nri-b"], "b2", other_own("nri-b"))

        step("containerd restarted under the running agent")
        runtime = Containerd(args)
        pid = agent.proc.pid if agent.proc else None
        before = agent.registrations()
        offset = agent.log_size()
        restart: dict[str, Any] = {"agent_pid_before": pid, "old_containerd_pid": runtime.pid}
        results["containerd_restart"] = restart
        restart["stop_seconds"] = runtime.stop(60)
        restart["agent_registrations_while_down"] = agent.registrations()[0] - before[0]
        runtime.start()
        restart["new_containerd_pid"] = runtime.pid
        started = now()
        cri, restart["cri_ready_seconds"] = wait_cri(args.cri_socket, 120)
        # From containerd's start: the agent, never told, must find the new socket and register again.
        waited = agent.wait_registered(before, 90)
        restart["reregistration_seconds"] = None if waited is None else round(now() - started, 2)
        restart["agent_pid_after"] = agent.proc.pid if agent.proc else None
        restart["agent_running"] = agent.proc is not None and agent.proc.poll() is None
        restart["version"] = cri.version()
        agent_log = agent.log_since(offset)
        restart["agent_log"] = agent_log
        synced = [line for line in agent_log.splitlines() if "NRI: synchronized with the runtime" in line]
        restart["synchronized"] = synced[-1] if synced else None
        containers["b3_containerd"] = cri.run_container(pods["nri-b"], "b3-containerd", other_own("nri-b"))

        step("agent frozen")
        before = agent.registrations()
        agent.signal(signal.SIGSTOP)
        containers["a2_frozen"] = cri.run_container(pods["nri-a"], "a2-frozen", other_own("nri-a"))
        agent.signal(signal.SIGCONT)
        # If the runtime dropped the frozen plugin, the agent reconnects; either way it must serve again.
        results["thawed_reregistration_seconds"] = agent.wait_registered(before, 60)
        containers["a3_thawed"] = cri.run_container(pods["nri-a"], "a3-thawed", other_own("nri-a"))

        step("agent stopped")
        agent.stop()
        containers["a4_stopped"] = cri.run_container(pods["nri-a"], "a4-stopped", other_own("nri-a"))
        step("done")
    except Exception as exc:  # reported to the host; the tests say which fact is missing
        results["error"] = f"{type(exc).__name__}: {exc}"
        print(f"nri driver: {results['error']}", file=sys.stderr, flush=True)
    finally:
        agent.stop()
        with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The NRI plugin: on CreateContainer, a pod with rdma-cni attachments gets exactly its own RDMA char devices.

Which devices are the pod's is decided by the kernel and the node's records,
never by the pod: the records whose CNI_CONTAINERID is the sandbox id NRI
reports, each VF proven to sit in the pod by identity (see
:mod:`rdma_cni.kernel.identity`), a VF claimed by two records trusted for
neither, and the RDMA devices the kernel ties to such a VF at that moment:
those whose PCI parent it is (sysfs), and soft devices (rxe, siw) whose port's
netdev it is (RDMA netlink asked from inside the pod's namespace). Their
character devices (uverbs, umad, issm, and the node's rdma_cm) are injected
with the device-cgroup rule the runtime derives from each (``rwm``), and
RLIMIT_MEMLOCK is raised so memory registration works without IPC_LOCK.

NRI's timeouts (containerd/nri ``pkg/api/timeouts.go``): registration must
finish within 5 s and each request be answered within 2 s, or the runtime
drops the plugin and creates containers without it. Every answer here is a
few sysfs reads and, per recorded VF, a netlink request for its ifindex in the
pod; a pod's links are walked only when that misses, within a bound
(:mod:`rdma_cni.kernel.linkscan`), and all the proofs of one request stop
after :data:`PROOF_SECONDS`. Nothing waits on the node lock.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from rdma_cni.agent.nri import mux, ttrpc
from rdma_cni.agent.nri import nri_api_pb2 as api
from rdma_cni.agent.takeover import FileLock, take_over
from rdma_cni.cni.errors import CniError
from rdma_cni.kernel import sysfs
from rdma_cni.node.nristate import REGISTERED
from rdma_cni.node.record import Attachment, RecordStore, write_atomic

log = logging.getLogger("rdma_cni.agent.nri")

DEFAULT_SOCKET = "/var/run/nri/nri.sock"
PLUGIN_NAME = "rdma-cni"
PLUGIN_INDEX = "50"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
EVENT_CREATE_CONTAINER = api.CREATE_CONTAINER
REGISTRATION_TIMEOUT = 5.0
RLIM_INFINITY = (1 << 64) - 1
RECONNECT_DELAY = 2.0
# After a connection the agent was registered on ends (the runtime restarting, most likely), it
# tries this often for FAST_RETRY_SECONDS: the runtime adjusts only containers created while a
# plugin is connected, so every tenth of a second of waiting is a window of pods without devices.
FAST_RETRY_DELAY = 0.1
FAST_RETRY_SECONDS = 30.0
# The state after the runtime's Shutdown request (containerd sends it when it stops).
SHUT_DOWN = "shut down by the runtime"
# A runtime that stops inside a frame must not hang the plugin: give up on the connection.
STALL_TIMEOUT = 10.0
DEV_DIR = "/dev/infiniband"
# What one CreateContainer may spend proving its pod's VFs before it gives up on the rest (each
# proof is itself bounded: see prove_in_pod). Well inside NRI's 2 s per request.
PROOF_SECONDS = 1.0


@dataclass(frozen=True)
class CharDevice:
    path: str
    major: int
    minor: int
    mode: int = 0o666


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _char(cls_dir: str, name: str) -> CharDevice | None:
    text = _read(os.path.join(cls_dir, name, "dev"))
    if not text:
        return None
    major, _, minor = text.partition(":")
    try:
        return CharDevice(os.path.join(DEV_DIR, name), int(major), int(minor))
    except ValueError:
        return None


def char_devices(pci: str, rdma_devices: Sequence[str]) -> list[CharDevice]:
    """The char devices (uverbsN, umadN, issmN) of VF ``pci``'s RDMA devices.

    A char device is the VF's when its ``device`` link is the VF (the kernel
    parents them on the RDMA device's parent, so this holds while exclusive
    mode hides the RDMA device itself from the host's sysfs in the pod's
    namespace); only one without that link is matched by its ``ibdev`` among
    ``rdma_devices``, which were proven to sit on the VF.
    """
    want = os.path.realpath(sysfs.pci_dir(pci))
    out = []
    for cls in ("infiniband_verbs", "infiniband_mad"):
        cls_dir = os.path.join(sysfs.root(), "class", cls)
        try:
            names = sorted(os.listdir(cls_dir))
        except OSError:
            continue
        for name in names:
            if not name.startswith(("uverbs", "umad", "issm")):
                continue
            parent = os.path.join(cls_dir, name, "device")
            if os.path.islink(parent):
                # Names can repeat across namespaces in exclusive mode; the parent cannot.
                if os.path.realpath(parent) != want:
                    continue
            elif _read(os.path.join(cls_dir, name, "ibdev")) not in rdma_devices:
                continue
            dev = _char(cls_dir, name)
            if dev is not None:
                out.append(dev)
    return out


def rdma_cm_device() -> CharDevice | None:
    """``/dev/infiniband/rdma_cm`` (shared by every RDMA user of the node), if the kernel has it."""
    return _char(os.path.join(sysfs.root(), "class", "misc"), "rdma_cm")


def vf_rdma_devices(pci: str) -> list[str]:
    """RDMA devices whose parent is PCI function ``pci``: listed under it and pointing back to it."""
    want = os.path.realpath(sysfs.pci_dir(pci))
    out = []
    for dev in sysfs.pci_rdma_devices(pci):
        parent = os.path.join(sysfs.root(), "class", "infiniband", dev, "device")
        if os.path.realpath(parent) == want:
            out.append(dev)
    return out


# (attachment, its VFs) -> the VFs proven in the pod, each with the soft RDMA devices on its netdev.
Prover = Callable[[Attachment, list[str]], dict[str, list[str]]]


def netdev_rdma_devices(netns_fd: int) -> dict[int, list[str]]:
    """Netdev ifindex in the namespace ``netns_fd`` -> the RDMA devices with a port on that netdev.

    Soft devices (rxe, siw) are not children of the VF's PCI device: the only
    tie is their port's netdev. The socket is opened inside the pod's
    namespace (by fd) because the kernel reports a port's NDEV_INDEX only to
    a socket in the netdev's own namespace (``fill_port_info``): an index
    here is one of the pod's links, to be compared with the VF's link there.
    The netdev's name (NDEV_NAME, the pod's to choose) is not used.
    """
    from rdma_cni.kernel import rdma
    from rdma_cni.kernel.nlsock import NetlinkError

    try:
        with rdma.RdmaClient(netns_fd) as client:
            ports = client.list_ports()
    except rdma.RdmaUnsupported:
        return {}  # no RDMA stack: no soft devices either
    except NetlinkError as exc:
        log.warning("NRI: cannot list RDMA ports in the pod's namespace (%s); soft devices left out", exc)
        return {}
    out: dict[int, list[str]] = {}
    for port in ports:
        if port.netdev_index is not None and port.dev_name not in out.get(port.netdev_index, []):
            out.setdefault(port.netdev_index, []).append(port.dev_name)
    return out


def prove_in_pod(att: Attachment, pcis: list[str]) -> dict[str, list[str]]:
    """Of ``pcis``, the VFs the kernel shows in the attachment's pod namespace (by identity).

    Each VF is asked for at the ifindex, then under the name, ADD left it
    with (its record's ``pod_index`` and ``pod_name``), and proven by what
    the kernel reports; the pod's links are walked only for VFs both miss,
    once and within :class:`rdma_cni.kernel.linkscan.Bound` (records from
    before ``pod_index``, a VF the pod moved away): a pod with any number of
    links costs a few requests, and a VF beyond the bound is not proven, so
    its devices are not injected. Each comes with the soft RDMA devices
    whose port's netdev is that VF's link in the pod
    (:func:`netdev_rdma_devices`). The ports are read before the links are
    proven, so a port's netdev index is checked against the links as they
    are at or after the moment the kernel named it.
    """
    from rdma_cni.kernel.identity import VfFinder
    from rdma_cni.kernel.netlink import Rtnl
    from rdma_cni.kernel.netns import Netns

    pod = Netns.open_optional(att.netns)
    if pod is None:
        return {}
    try:
        soft = netdev_rdma_devices(pod.fd)
        hints = {vf.pci: (vf.pod_index, vf.pod_name) for vf in att.vfs}
        with Rtnl() as host:
            proven = VfFinder(host, pod).vfs_in_pod(pcis, hints)
        return {pci: soft.get(link.index, []) for pci, link in proven.items()}
    finally:
        pod.close()


class PodDevices:
    """Sandbox id -> the char devices of that pod's own RDMA devices."""

    def __init__(self, state_dirs: Sequence[str], prove: Prover = prove_in_pod) -> None:
        self.stores = [RecordStore(d) for d in dict.fromkeys(state_dirs)]
        self.prove = prove

    def __call__(self, sandbox_id: str) -> list[CharDevice]:
        records: list[Attachment] = []
        for store in self.stores:
            records.extend(store.all(errors=[]))
        claims: dict[str, set[str]] = {}
        for att in records:
            for vf in att.vfs:
                claims.setdefault(vf.pci, set()).add(att.container_id)
        devices: dict[str, CharDevice] = {}
        deadline = time.monotonic() + PROOF_SECONDS
        for att in records:
            if att.container_id != sandbox_id or att.state != "ready":
                continue
            if time.monotonic() > deadline:
                log.error(
                    "NRI: proving the VFs of pod sandbox %s took over %g s; the devices of %s/%s are not "
                    "injected",
                    sandbox_id,
                    PROOF_SECONDS,
                    att.container_id,
                    att.ifname,
                )
                continue
            pcis = []
            for vf in att.vfs:
                if claims[vf.pci] != {sandbox_id}:
                    log.error(
                        "VF %s is claimed by several pods' records; injecting none of its devices", vf.pci
                    )
                    continue
                pcis.append(vf.pci)
            if not pcis:
                continue
            proven = self.prove(att, pcis)
            for pci in sorted(set(proven) & set(pcis)):
                names = vf_rdma_devices(pci) + [n for n in proven[pci] if n]
                for dev in char_devices(pci, names):
                    devices[dev.path] = dev
        if devices:
            cm = rdma_cm_device()
            if cm is not None:
                devices[cm.path] = cm
        return [devices[p] for p in sorted(devices)]


def adjustment(devices: Sequence[CharDevice], memlock: int | None) -> api.ContainerAdjustment:
    """A ContainerAdjustment: the devices (the runtime adds an ``rwm`` cgroup rule to each) and rlimit."""
    adjust = api.ContainerAdjustment()
    for d in devices:
        dev = adjust.linux.devices.add(path=d.path, type="c", major=d.major, minor=d.minor)
        # Present even when 0: an absent file_mode would leave the mode to the runtime.
        dev.file_mode.SetInParent()
        dev.file_mode.value = d.mode
    if memlock is not None:
        adjust.rlimits.add(type="RLIMIT_MEMLOCK", hard=memlock, soft=memlock)
    return adjust


class NriPlugin:
    """One NRI plugin connection at a time; :meth:`run` reconnects whenever the runtime goes away."""

    def __init__(
        self,
        socket_path: str,
        devices_for: Callable[[str], list[CharDevice]],
        *,
        memlock: int | None = RLIM_INFINITY,
        name: str = PLUGIN_NAME,
        index: str = PLUGIN_INDEX,
        state_file: str | None = None,
        lock_file: str | None = None,
    ) -> None:
        self.socket_path = socket_path
        # One agent per node registers: two would both claim the same devices, and the runtime
        # fails a container whose devices two plugins adjust. See rdma_cni/agent/takeover.py.
        self.lock_file = lock_file
        self.state_file = state_file
        self.devices_for = devices_for
        self.memlock = memlock
        self.name = name
        self.index = index
        self._state = ""
        self.state = "not connected"
        self.injected = 0
        self._said_missing = False

    @property
    def state(self) -> str:
        """Where the plugin stands: "registered", "not injecting: ...", ..."""
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        if value == self._state:
            return
        self._state = value
        if self.state_file:
            # STATUS, run by the runtime in another process, reads it to say whether pods get devices.
            try:
                write_atomic(
                    os.path.dirname(self.state_file),
                    os.path.basename(self.state_file),
                    value + "\n",
                    "NRI state file",
                    sync_dir=False,
                )
            except CniError as exc:
                log.debug("NRI: %s", exc.msg)

    # The Plugin service's requests the plugin reads; every other method's (Shutdown, the events
    # it did not subscribe to) is parsed as Empty, which checks it is well-formed and keeps it all unknown.
    REQUESTS: dict[str, type[Message]] = {
        "Configure": api.ConfigureRequest,
        "Synchronize": api.SynchronizeRequest,
        "CreateContainer": api.CreateContainerRequest,
    }

    def handle(self, req: ttrpc.Request) -> ttrpc.Response:
        """Answer one call of the Plugin service; errors become a status, never an exception."""
        if req.service != PLUGIN_SERVICE:
            return ttrpc.Response(ttrpc.UNIMPLEMENTED, f"service {req.service} is not served", b"")
        request_type = self.REQUESTS.get(req.method, api.Empty)
        msg = request_type()
        try:
            # A broken message (also invalid UTF-8 in a string, or a broken pod or container
            # inside) is the runtime's error to hear about, not a reason to drop the connection.
            msg.ParseFromString(req.payload)
        except DecodeError as exc:
            return ttrpc.Response(ttrpc.INVALID_ARGUMENT, f"{req.method}: {exc}", b"")
        if isinstance(msg, api.ConfigureRequest):
            log.info(
                "NRI: configured by %s %s (registration timeout %d ms, request timeout %d ms)",
                msg.runtime_name,
                msg.runtime_version,
                msg.registration_timeout,
                msg.request_timeout,
            )
            events = api.ConfigureResponse(events=1 << (EVENT_CREATE_CONTAINER - 1))
            return ttrpc.Response(ttrpc.OK, "", events.SerializeToString())
        if isinstance(msg, api.SynchronizeRequest):
            # Devices cannot be added to running containers; only later ones get theirs. The
            # runtime sends events only once this is answered: the moment injection starts.
            log.info(
                "NRI: synchronized with the runtime (%d pods, %d containers); injecting into "
                "containers created from now on",
                len(msg.pods),
                len(msg.containers),
            )
            # A runtime that splits the synchronization (more=true) expects "more" back until the last.
            return ttrpc.Response(ttrpc.OK, "", api.SynchronizeResponse(more=msg.more).SerializeToString())
        if isinstance(msg, api.CreateContainerRequest):
            return self._create_container(msg)
        if req.method == "Shutdown":
            self.state = SHUT_DOWN
            return ttrpc.Response(ttrpc.OK, "", b"")
        # Events not subscribed to: an empty answer is a valid "no change" for every one of them.
        return ttrpc.Response(ttrpc.OK, "", b"")

    def _create_container(self, req: api.CreateContainerRequest) -> ttrpc.Response:
        pod, container = req.pod, req.container
        sandbox = pod.id or container.pod_sandbox_id
        if not sandbox:
            return ttrpc.Response(ttrpc.OK, "", b"")
        try:
            devices = self.devices_for(sandbox)
        except Exception:  # a failure here must not fail the pod's container
            log.exception("NRI: cannot work out the RDMA devices of pod sandbox %s; injecting none", sandbox)
            devices = []
        if not devices:
            return ttrpc.Response(ttrpc.OK, "", b"")
        self.injected += 1
        log.info(
            "NRI: container %s of pod %s/%s gets %s",
            container.name,
            pod.namespace,
            pod.name,
            ", ".join(d.path for d in devices),
        )
        answer = api.CreateContainerResponse(adjust=adjustment(devices, self.memlock))
        return ttrpc.Response(ttrpc.OK, "", answer.SerializeToString())

    def session(self, sock: socket.socket, stop: threading.Event) -> None:
        """Register on a connected socket and serve it until it closes; Closed/ProtocolError end it."""
        sock.settimeout(STALL_TIMEOUT)
        register = api.RegisterPluginRequest(plugin_name=self.name, plugin_idx=self.index).SerializeToString()
        call = ttrpc.encode_request(ttrpc.Request(RUNTIME_SERVICE, "RegisterPlugin", register))
        mux.send_frame(sock, mux.RUNTIME_CONN, ttrpc.encode_message(1, ttrpc.TYPE_REQUEST, call))
        deadline: float | None = time.monotonic() + REGISTRATION_TIMEOUT
        readers = {mux.PLUGIN_CONN: ttrpc.Reader(), mux.RUNTIME_CONN: ttrpc.Reader()}
        self.state = "registering"
        while not stop.is_set():
            if deadline is not None and time.monotonic() > deadline:
                raise ttrpc.ProtocolError("the runtime did not answer RegisterPlugin in time")
            ready, _, _ = select.select([sock], [], [], 0.2)
            if not ready:
                continue
            conn_id, payload = mux.read_frame(sock)
            reader = readers.get(conn_id)
            if reader is None:
                continue  # a connection the plugin never opened: dropped, as NRI's multiplexer does
            for msg in reader.feed(payload):
                if conn_id == mux.PLUGIN_CONN and msg.type == ttrpc.TYPE_REQUEST:
                    resp = self.handle(ttrpc.decode_request(msg.payload))
                    out = ttrpc.encode_message(msg.stream, ttrpc.TYPE_RESPONSE, ttrpc.encode_response(resp))
                    mux.send_frame(sock, mux.PLUGIN_CONN, out)
                    if self.state == SHUT_DOWN:
                        return
                elif conn_id == mux.RUNTIME_CONN and msg.type == ttrpc.TYPE_RESPONSE and msg.stream == 1:
                    resp = ttrpc.decode_response(msg.payload)
                    if resp.code != ttrpc.OK:
                        raise ttrpc.ProtocolError(f"the runtime refused registration: {resp.message}")
                    if deadline is not None:
                        log.info(
                            "NRI: registered with the runtime at %s as %s-%s",
                            self.socket_path,
                            self.index,
                            self.name,
                        )
                    deadline = None
                    self.state = REGISTERED
                else:
                    log.debug(
                        "NRI: ignoring message type %d on connection %d stream %d",
                        msg.type,
                        conn_id,
                        msg.stream,
                    )

    def run(self, stop: threading.Event) -> None:
        """Connect, serve, reconnect, until ``stop``; a missing socket is logged once.

        With a ``lock_file``, only once this agent holds it: the other agent's plugin lets go on stop.
        """
        lock = FileLock(self.lock_file) if self.lock_file else None
        try:
            if lock is not None:
                taken = take_over("nri", lock.try_acquire, stop, poll=0.05, max_poll=0.2)
                if not taken and stop.is_set():
                    return
                # Not taken and not stopped: the lock file cannot be opened (logged); register all the same.
            self._serve(stop)
        finally:
            if lock is not None:
                lock.release()

    def _serve(self, stop: threading.Event) -> None:
        fast_until = 0.0  # the end of the fast retries after a registered connection ended
        while not stop.is_set():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(self.socket_path)
            except OSError as exc:
                sock.close()
                self.state = f"not injecting: no NRI socket at {self.socket_path} ({exc.strerror})"
                if not self._said_missing:
                    log.warning(
                        "NRI: %s; pods get no RDMA devices from rdma-cni (enable NRI in the runtime, "
                        "or use the RDMA shared device plugin)",
                        self.state,
                    )
                    self._said_missing = True
                stop.wait(reconnect_delay(time.monotonic(), fast_until))
                continue
            self._said_missing = False
            try:
                self.session(sock, stop)
            except (mux.Closed, ttrpc.ProtocolError) as exc:
                log.warning("NRI: connection to %s ended: %s; reconnecting", self.socket_path, exc)
            finally:
                sock.close()
            if self.state in (REGISTERED, SHUT_DOWN):
                fast_until = time.monotonic() + FAST_RETRY_SECONDS
            self.state = "not connected"
            stop.wait(reconnect_delay(time.monotonic(), fast_until))


def reconnect_delay(now: float, fast_until: float) -> float:
    """Seconds before the next connection attempt: short while ``now`` is before ``fast_until``.

    Only a connection the agent was registered on starts the fast retries, so a runtime that
    refuses or garbles every session is retried at the slow pace.
    """
    return FAST_RETRY_DELAY if now < fast_until else RECONNECT_DELAY


CAP_SYS_RESOURCE = 24  # linux/capability.h


def grantable_memlock(
    memlock: int | None, status: str = "/proc/self/status", hard: int | None = None
) -> tuple[int | None, str]:
    """``memlock``, or None (the container's limit kept) when the runtime cannot grant it; and why.

    Raising a hard limit takes CAP_SYS_RESOURCE, and runc sets a container's rlimits with the
    capabilities it has. The agent runs privileged, so its bounding set (``status``' CapBnd) is
    what the runtime has to give: a host without CAP_SYS_RESOURCE there (a sandboxed or nested
    node) makes runc fail every container whose memlock the plugin raises above the limit it
    already has (``hard``, the agent's own: the one runc would leave), "error setting rlimit type
    8: operation not permitted", and the pod never starts. Seen under containerd 2.4 on such a
    host (the node tier, docs/devices.md).
    """
    if memlock is None:
        return None, ""
    try:
        with open(status) as f:
            bounding = next(int(line.split()[1], 16) for line in f if line.startswith("CapBnd:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return memlock, ""  # unknown: as configured
    if bounding & (1 << CAP_SYS_RESOURCE):
        return memlock, ""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1] if hard is None else hard
    if limit == resource.RLIM_INFINITY or memlock <= limit:
        return memlock, ""
    return None, (
        f"the runtime cannot raise RLIMIT_MEMLOCK here (no CAP_SYS_RESOURCE in the bounding set): "
        f"containers keep their memlock limit ({limit} bytes) instead of --memlock"
    )


def parse_memlock(text: str) -> int | None:
    """``--memlock``: "unlimited", a number of bytes, or "off" (None: the container's limit is kept)."""
    value = text.strip().lower()
    if value == "unlimited":
        return RLIM_INFINITY
    if value == "off":
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"--memlock {text!r}: expected 'unlimited', 'off' or a number of bytes") from None
    if number <= 0:
        raise ValueError(f"--memlock {text!r}: must be positive")
    return number

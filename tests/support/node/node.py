"""One real node next to the tier's control plane, brought up the way an operator would.

In order (:func:`bring_up`): the node's mount namespace (tests/support/node/host.py); the
control plane on the run's loopback address with the DaemonSet controller; conf/'s RBAC,
NetworkAttachmentDefinition CRD and network, metrics Services and rdma-scheduler's objects
applied as shipped; the simulated node's sysfs and veth VFs; the images; containerd 2.x;
the node's default network (Debian's ``bridge`` and ``host-local``) in
``/etc/cni/net.d``; kubelet; Multus' own thick-plugin manifest; conf/base/node/daemonset.yaml with only its
image changed; rdma-scheduler from conf/base/extender/scheduler-extender.yaml (as the cluster tier runs it).
:func:`tear_down` undoes it all, the pods' cgroups, the sysctls kubelet set and the bridge
included.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import yaml

from tests.support.kube.applyconf import apply_file
from tests.support.kube.controlplane import REPO, Binary, ControlPlane
from tests.support.kube.process import ComponentFailed
from tests.support.kube.rdmascheduler import RdmaScheduler, start_rdma_scheduler
from tests.support.node import capture, host, images, multus
from tests.support.node.runtime import Containerd, Kubelet
from tests.support.simnode import SimNode, SimPf, ip
from tests.support.waiting import wait_for

BUILD_SCRIPT = os.path.join(REPO, "scripts", "build_components.sh")
NODE_COMPONENTS = (
    "kubelet",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "crictl",
    "pause",
    *images.MULTUS_BINARIES,
)
DEBIAN_PLUGINS = "/usr/lib/cni"  # containernetworking-plugins (make deps)
SIM_ROOT = "/run/rdma-cni/simnode"  # inside a directory the DaemonSet mounts, at the same path
STATE_DIR = "/var/lib/cni/rdma-cni"  # the plugin's default stateDir, on the node
SHIPPED_IMAGE = (
    "localhost/rdma-cni:0.1.0"  # conf/base/node/daemonset.yaml's image: conf/Containerfile's build
)
IMAGE = "localhost/rdma-cni-simnode:0.1.0"  # that image, plus the simulated node's environment
MULTUS_IMAGE = "localhost/multus-cni:node-thick"
# conf/ files the node needs: RBAC, the CRD and sample network, metrics Services, rdma-scheduler's
# objects (kube-scheduler reads its ConfigMap back). daemonset.yaml goes in with its image changed.
CONF_FILES = (
    "network-attachment-definition-crd.yaml",
    "base/node/rbac.yaml",
    "base/node/metrics.yaml",
    "base/extender/scheduler-extender.yaml",
    "network-attachment-definition.yaml",
)
# A second rdma-cni network beside conf/'s rdma-net (a second rail): its NAD is conf/'s with
# another name and subnet, and rdma-scheduler's --networks lists both.
SECOND_NETWORK = "rdma-rail-b"
SECOND_SUBNET = "192.168.144.0/20"
# A third, whose delegate records what Multus passes it (tests/support/node/capture.py).
CAPTURE_NETWORK = "rdma-capture"
CAPTURE_SUBNET = "192.168.160.0/20"
NETWORKS = f"default/rdma-net,default/{SECOND_NETWORK},default/{CAPTURE_NETWORK}"
VFS_PER_PF = 20
PF_SPEED = 100000  # Mbit/s


def node_binaries() -> dict[str, Binary]:
    """The node's components ``make node-components`` builds, by name; raises when one is missing."""
    out = subprocess.run(
        ["bash", BUILD_SCRIPT, "--list", "--node"], check=True, capture_output=True, text=True
    ).stdout
    found = {}
    for line in out.splitlines():
        name, version, path = line.split()
        if not os.access(path, os.X_OK):
            raise ComponentFailed(f"{name} {version} is not built ({path}): run `make node-components`")
        found[name] = Binary(name, version, path)
    missing = set(NODE_COMPONENTS) - set(found)
    assert not missing, f"scripts/build_components.sh --list --node names no {sorted(missing)}"
    return found


@dataclass
class Node:
    """The running node and what the tests read of it."""

    root: str
    addresses: host.Addresses
    bins: dict[str, Binary]
    cp: ControlPlane
    sim: SimNode
    containerd: Containerd
    kubelet: Kubelet | None  # made once the control plane's certificates exist
    cgroup_root: str
    bridge: str
    scheduler: RdmaScheduler | None = None
    sysctls: dict[str, str] = field(default_factory=dict)
    daemonset_text: str = ""  # conf/base/node/daemonset.yaml as applied
    image_shim: str = ""  # the shim copied out of the image conf/Containerfile built
    multus_images_replaced: list[str] = field(default_factory=list)
    # The simulated RDMA character devices: VF netdev -> (major, minor) of its uverbs node.
    rdma_devices: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The Node's name (its address, as kubelet registers it)."""
        assert self.kubelet is not None
        return self.kubelet.name

    # -- the API's view -------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.cp.kubectl(*args, input=input, check=check)

    def get(self, *args: str) -> Any:
        return self.cp.get(*args)

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod's object, None when the API has none."""
        got = self.kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
        return json.loads(got.stdout) if got.returncode == 0 else None

    def agent_pods(self) -> list[dict[str, Any]]:
        """The rdma-cni DaemonSet's pods, oldest first."""
        pods = self.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/name=rdma-cni")["items"]
        return sorted(pods, key=lambda p: p["metadata"]["creationTimestamp"])

    # -- the node's view ------------------------------------------------------------

    def records(self) -> list[str]:
        """The plugin's allocation records on the node (its default stateDir)."""
        d = os.path.join(STATE_DIR, "attachments")
        return sorted(n for n in os.listdir(d) if n.endswith(".json")) if os.path.isdir(d) else []

    def record_docs(self) -> list[dict[str, Any]]:
        out = []
        for name in self.records():
            with open(os.path.join(STATE_DIR, "attachments", name)) as f:
                out.append(json.load(f))
        return out

    def leases(self, network: str) -> list[str]:
        """Addresses host-local holds for ``network`` (its default dataDir)."""
        d = os.path.join("/var/lib/cni/networks", network)
        if not os.path.isdir(d):
            return []
        return sorted(n for n in os.listdir(d) if n[0].isdigit() and not n.startswith("last_reserved_ip"))

    def vfs_home(self) -> set[str]:
        """The VF netdevs in the host under their own names."""
        host_links = SimNode.host_links()
        return {self.sim.vf_netdev(k, i) for k, i in self.sim.all_vfs()} & host_links

    def all_vfs(self) -> set[str]:
        return {self.sim.vf_netdev(k, i) for k, i in self.sim.all_vfs()}

    def vfs_back_from_gone_namespaces(self, vfs: list[tuple[int, int]], *, reboot: bool) -> None:
        """Wait until the namespaces holding ``vfs`` are gone, then bring each VF back to the host
        as the kernel would: a veth dies with its namespace (its wire too), a real VF comes back,
        under a name of the kernel's (here one the node never uses) or, after a reboot, under
        the name its driver gives it at boot (its host name)."""
        wires = {self.sim.vf_wire(k, i) for k, i in vfs}
        wait_for(
            lambda: not wires & SimNode.host_links(), 60, "the pods' namespaces gone, their VFs with them"
        )
        for k, i in vfs:
            if reboot:
                self.sim.make_vf_netdev(k, i)
            else:
                name, wire = f"{self.sim.prefix}h{k}x{i}", self.sim.vf_wire(k, i)
                ip("link", "add", name, "type", "veth", "peer", "name", wire)
                ip("link", "set", wire, "up")

    def vfs_of(self, sandbox: str) -> list[tuple[int, int]]:
        """The simulated VFs (PF index, VF index) the records of ``sandbox`` hold."""
        pfs = [pf.name for pf in self.sim.pfs]
        return [
            (pfs.index(v["pf"]), int(v["vf"]))
            for r in self.record_docs()
            if r["container_id"] == sandbox
            for v in r["vfs"]
        ]

    def mark_as_an_earlier_boot(self) -> None:
        """What a reboot would change in the plugin's state directory: the kernel's boot id. Every
        record, and the note of the last boot whose records were checked (``boot-checked``: once
        per boot), now name another boot, so the next check releases those records."""
        earlier = str(uuid.uuid4())
        for path in glob.glob(os.path.join(STATE_DIR, "attachments", "*.json")):
            with open(path) as f:
                record = json.load(f)
            record["boot_id"] = earlier
            with open(path, "w") as f:
                json.dump(record, f)
        checked = os.path.join(STATE_DIR, "boot-checked")
        if os.path.exists(checked):
            with open(checked, "w") as f:
                f.write(earlier + "\n")

    def pf_settings(self) -> dict[str, dict[str, Any]]:
        """PF-side settings per ``pf/vf``, from the simulated node's VF control file."""
        return {
            f"{pf}/{vf}": s
            for pf, table in self.sim.vf_state().get("pfs", {}).items()
            for vf, s in table.items()
        }

    def sandbox(self, namespace: str, name: str) -> dict[str, Any]:
        """``crictl inspectp`` of the pod's ready sandbox."""
        found = self.containerd.crictl_json(
            "pods", "--namespace", namespace, "--name", f"^{name}$", "--state", "Ready"
        )
        (item,) = found["items"]
        return dict(self.containerd.crictl_json("inspectp", item["id"]))

    def netns(self, namespace: str, name: str) -> str:
        """The path of the pod's network namespace, as containerd made it."""
        spec = self.sandbox(namespace, name)["info"]["runtimeSpec"]
        (path,) = [n["path"] for n in spec["linux"]["namespaces"] if n["type"] == "network"]
        return str(path)

    def exec(self, namespace: str, pod: str, container: str, *argv: str) -> str:
        """Run ``argv`` in the pod's container through the CRI (crictl exec)."""
        found = self.containerd.crictl_json(
            "ps",
            "--namespace",
            namespace,
            "--pod",
            self.sandbox(namespace, pod)["status"]["id"],
            "--name",
            container,
        )
        (item,) = found["containers"]
        return self.containerd.crictl("exec", item["id"], *argv).stdout

    def agent_log(self) -> str:
        """The agent containers' logs (every agent pod's, through the CRI), for failure messages."""
        out = []
        for item in self.containerd.crictl_json("ps", "-a", "--name", "^install$")["containers"]:
            got = self.containerd.crictl("logs", "--tail", "200", item["id"], check=False)
            out.append(got.stdout + got.stderr)
        return "\n".join(out)


def prepare(root: str) -> Node:
    """Enter the node's namespace and make the node's parts, nothing started yet."""
    bins = node_binaries()
    addresses = host.Addresses.for_run()
    host.enter_node_namespace(os.path.join(root, "node"))
    admin_cert = os.path.join(root, "cluster", "pki", "admin")
    cp = ControlPlane(
        os.path.join(root, "cluster"),
        address=addresses.apiserver,
        api_port=443,
        apiserver_args=[
            f"--service-cluster-ip-range={addresses.service_range}",
            # kubectl logs/exec through kubelet: kube-apiserver presents the admin's certificate.
            f"--kubelet-client-certificate={admin_cert}.crt",
            f"--kubelet-client-key={admin_cert}.key",
        ],
        # The node lifecycle controller lifts the not-ready taint admission puts on a new Node.
        extra_controllers=["daemonset-controller", "node-lifecycle-controller"],
        service_account_credentials=True,
    )
    prefix = f"n{os.getpid() % 10000:04d}"
    sim = SimNode(SIM_ROOT, [SimPf(f"{prefix}p{k}", VFS_PER_PF, PF_SPEED) for k in range(2)], prefix=prefix)
    os.makedirs(os.path.join(root, "logs"), exist_ok=True)
    return Node(
        root,
        addresses,
        bins,
        cp,
        sim,
        Containerd(root, bins),
        None,
        cgroup_root=f"rdma-cni-node-{os.getpid()}",
        bridge=f"rcnibr{os.getpid() % 100000}",
        sysctls=host.read_sysctls(),
    )


def bring_up(node: Node) -> None:
    """Everything in the module's docstring, in order; the caller tears it down (even half up)."""
    cp, sim, containerd, root, addresses = node.cp, node.sim, node.containerd, node.root, node.addresses
    cgroup_root = node.cgroup_root
    cp.start()
    for namespace in ("default", "kube-system"):
        wait_for(
            lambda ns=namespace: (
                cp.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0
            ),
            60,
            f"the default service account of {namespace}",
        )
    for name in CONF_FILES:
        apply_file(cp, name)
    cp.kubectl("apply", "-f", "-", input=json.dumps(second_network()))
    cp.kubectl(
        "apply", "-f", "-", input=json.dumps(second_network(CAPTURE_NETWORK, CAPTURE_SUBNET, capture.TYPE))
    )

    sim.up()
    node.rdma_devices = give_rdma_devices(sim)

    build_images(node)
    containerd.start()
    for archive in ("pause.tar", "busybox.tar", "multus.tar", "rdma-cni.tar"):
        containerd.import_image(os.path.join(root, "images", archive))

    os.makedirs("/opt/cni/bin", exist_ok=True)
    for plugin in os.listdir(DEBIAN_PLUGINS):
        shutil.copy2(os.path.join(DEBIAN_PLUGINS, plugin), os.path.join("/opt/cni/bin", plugin))
    capture.install()
    os.makedirs("/etc/cni/net.d", exist_ok=True)
    with open("/etc/cni/net.d/10-node-default.conf", "w") as f:
        json.dump(default_network(node.bridge, addresses), f)

    host.make_cgroup_root(cgroup_root)
    node.kubelet = Kubelet(root, node.bins["kubelet"], cp, addresses.node, cgroup_root)
    node.kubelet.start()
    wait_for(
        lambda: cp.kubectl("get", "node", node.name, check=False).returncode == 0, 60, "the Node registered"
    )

    docs, node.multus_images_replaced = multus.thick_manifest(MULTUS_IMAGE)
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    wait_for(lambda: os.path.exists("/etc/cni/net.d/00-multus.conf"), 180, "Multus' 00-multus.conf")

    node.daemonset_text = shipped_daemonset(IMAGE)
    apply_daemonset(node)
    wait_agent_ready(node)
    wait_for(lambda: node_state(node) is not None, 120, "the agent's node state on its Node")
    node.scheduler = start_rdma_scheduler(cp, networks=NETWORKS)


def apply_daemonset(node: Node) -> None:
    """Apply conf/base/node/daemonset.yaml as the tier applies it (server-side, as an operator would)."""
    node.kubectl(
        "apply", "--server-side", "--field-manager=rdma-cni-operator", "-f", "-", input=node.daemonset_text
    )


def shipped_daemonset(image: str) -> str:
    """conf/base/node/daemonset.yaml's text with its image, and nothing else, changed to ``image``."""
    with open(os.path.join(REPO, "conf", "base", "node", "daemonset.yaml")) as f:
        text = f.read()
    line = f"image: {SHIPPED_IMAGE}"
    assert text.count(line) == 1, (
        f"conf/base/node/daemonset.yaml no longer names its image once as {SHIPPED_IMAGE}"
    )
    return text.replace(line, f"image: {image}")


def second_network(
    name: str = SECOND_NETWORK, subnet: str = SECOND_SUBNET, plugin: str = "rdma-cni"
) -> dict[str, Any]:
    """conf/'s NetworkAttachmentDefinition as ``name``, on ``subnet``, run by ``plugin``."""
    with open(os.path.join(REPO, "conf", "network-attachment-definition.yaml")) as f:
        (nad,) = [d for d in yaml.safe_load_all(f) if d]
    config = json.loads(nad["spec"]["config"])
    config["name"] = name
    config["type"] = plugin
    config["ipam"]["ranges"] = [[{"subnet": subnet}]]
    nad["metadata"]["name"] = name
    nad["spec"]["config"] = json.dumps(config)
    return dict(nad)


def default_network(bridge: str, addresses: host.Addresses) -> dict[str, Any]:
    """The node's default network from Debian's plugins: a bridge of the run's own, no address on the
    host side, no route, no masquerade (nothing reaches the machine's network), host-local addresses.

    A single-plugin configuration, not a list: Multus v4.3.0 gives a list's DEL a copy stripped of
    everything but each plugin's type and IPAM type (k8snetworkplumbingwg/multus-cni#1449), so
    bridge's DEL fails ("no IP ranges specified") and every pod's address leaks.
    """
    second = int(addresses.prefix.split(".")[2])
    return {
        "cniVersion": "1.0.0",
        "name": "node-default",
        "type": "bridge",
        "bridge": bridge,
        "isGateway": False,
        "ipMasq": False,
        "ipam": {"type": "host-local", "ranges": [[{"subnet": f"10.244.{second}.0/24"}]]},
    }


def give_rdma_devices(sim: SimNode) -> dict[str, tuple[int, int]]:
    """A fake RDMA device and uverbs character device for every VF, and the node's rdma_cm, in the
    simulated sysfs as the kernel shows them (the numbers are the real majors, unused here)."""
    out = {}
    for n, (k, i) in enumerate(sim.all_vfs()):
        vf_dir = os.path.join(sim.sysfs, "bus", "pci", "devices", sim.vf_pci(k, i))
        dev = f"mlx5_{n}"
        os.makedirs(os.path.join(vf_dir, "infiniband", dev), exist_ok=True)
        ib = os.path.join(sim.sysfs, "class", "infiniband", dev)
        os.makedirs(ib, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.symlink(vf_dir, os.path.join(ib, "device"))
        verbs = os.path.join(sim.sysfs, "class", "infiniband_verbs", f"uverbs{n}")
        os.makedirs(verbs, exist_ok=True)
        with open(os.path.join(verbs, "ibdev"), "w") as f:
            f.write(dev + "\n")
        with open(os.path.join(verbs, "dev"), "w") as f:
            f.write(f"231:{192 + n}\n")
        out[sim.vf_netdev(k, i)] = (231, 192 + n)
    cm = os.path.join(sim.sysfs, "class", "misc", "rdma_cm")
    os.makedirs(cm, exist_ok=True)
    with open(os.path.join(cm, "dev"), "w") as f:
        f.write("10:58\n")
    return out


def build_images(node: Node) -> None:
    """Every image the node runs, as archives in ``<root>/images`` (see tests/support/node/images.py)."""
    out = os.path.join(node.root, "images")
    os.makedirs(out, exist_ok=True)
    images.pause_archive(os.path.join(out, "pause.tar"), node.bins["pause"].path)
    images.busybox_archive(os.path.join(out, "busybox.tar"))
    images.multus_archive(
        os.path.join(out, "multus.tar"), MULTUS_IMAGE, {b: node.bins[b].path for b in images.MULTUS_BINARIES}
    )
    builder = images.ImageBuilder(os.path.join(node.root, "podman"))
    try:
        node.image_shim = images.rdma_cni_image(
            builder, REPO, SHIPPED_IMAGE, IMAGE, node.sim.env(), os.path.join(out, "rdma-cni.tar")
        )
    finally:
        builder.close()


def node_state(node: Node) -> str | None:
    """The agent's node-state annotation on its Node, None until published."""
    from rdma_cni.shared import nodestate

    doc = node.get("node", node.name)
    return (doc["metadata"].get("annotations") or {}).get(nodestate.ANNOTATION)


def wait_agent_ready(node: Node, timeout: float = 180) -> dict[str, Any]:
    """Wait until one agent pod runs Ready on the node; returns it."""

    def ready() -> dict[str, Any] | None:
        for pod in node.agent_pods():
            conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
            if conditions.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp"):
                return pod
        return None

    try:
        return wait_for(ready, timeout, "an rdma-cni agent pod Ready")  # type: ignore[no-any-return]
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{node.agent_log()}") from None


def tear_down(node: Node, machine: int, before: dict[str, tuple[int, int, int] | None]) -> list[str]:
    """Stop everything the node runs and remove what it made; returns what could not be undone.

    Pods first, through kubelet and the CNI (their VFs go home), then kubelet, the pods' sandboxes
    the CRI still knows, containerd, every process left in the node's namespace or cgroups, the
    cgroups, the bridge, the simulated node, and the sysctls kubelet set. Then the machine's own
    plugin state must be as ``before``.
    """
    problems: list[str] = []

    def step(what: str, action: Any) -> None:
        try:
            action()
        except Exception as exc:  # teardown goes on: each failure is reported
            problems.append(f"{what}: {exc}")

    if node.scheduler is not None:
        step("rdma-scheduler", node.scheduler.stop)
    if node.kubelet is not None and node.kubelet.component is not None and node.kubelet.component.alive():
        step("test pods", lambda: delete_test_pods(node))
        step("kubelet", node.kubelet.stop)
    if node.containerd.component is not None and node.containerd.component.alive():
        step("sandboxes", lambda: remove_sandboxes(node))
    step("containerd", node.containerd.stop)
    step(
        "processes",
        lambda: host.kill_and_wait(host.processes_in_my_namespace() + host.cgroup_tasks(node.cgroup_root)),
    )
    step("control plane", node.cp.stop)
    left = host.remove_cgroup_root(node.cgroup_root)
    if left:
        problems.append(f"cgroups left: {left}")
    step("bridge", lambda: ip("link", "del", node.bridge, check=False))
    step("simulated node", node.sim.down)
    if node.sysctls:
        step("sysctls", lambda: host.restore_sysctls(node.sysctls))
    after = host.host_plugin_state(machine)
    if after != before:
        problems.append(f"the machine's own plugin state changed: {before} -> {after}")
    return problems


def delete_test_pods(node: Node) -> None:
    """Delete every pod outside kube-system and wait until kubelet has let them go."""
    node.kubectl(
        "delete",
        "pods",
        "--all",
        "--all-namespaces",
        "--field-selector=metadata.namespace!=kube-system",
        "--wait=true",
        "--timeout=120s",
        check=False,
    )


def remove_sandboxes(node: Node) -> None:
    """Stop and remove every sandbox the CRI knows, the system pods' last (the agent serves the DELs)."""
    sandboxes = node.containerd.crictl_json("pods")["items"]
    system = [s["id"] for s in sandboxes if s["metadata"]["namespace"] == "kube-system"]
    others = [s["id"] for s in sandboxes if s["id"] not in system]
    for ids in (others, system):
        for sid in ids:
            node.containerd.crictl("stopp", sid, check=False, timeout=120)
            node.containerd.crictl("rmp", "-f", sid, check=False, timeout=120)
    time.sleep(0.5)

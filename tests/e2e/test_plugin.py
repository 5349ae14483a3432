"""The plugin on a real (emulated) SR-IOV NIC: the e2e issue's six scenarios and a decoy swap.

One guest boot runs every scenario (``scenarios/plugin.sh``; a boot costs ~20 s of
both host cores); each test here asserts on one scenario's files. The plugin is the
built ``dist/rdma-cni``, driven by ``cnirun`` (libcni) with ``K8S_POD_NAMESPACE`` and
``K8S_POD_NAME``, so the pod's request comes from the annotation served by the HTTPS
API stand-in running in the guest. Nothing is faked: PF-side VF settings go to igb
over rtnetlink and RDMA devices are soft-RoCE over RDMA netlink.

Every assertion reads the kernel's own view, dumped by the guest around each step:
``ip -d -j link`` (names, PCI parent, alias), the PF's ``vfinfo_list`` (rates, MACs),
``rdma -j dev``/``rdma -j link``, ``ip netns``, plus the plugin's allocation records and
host-local's lease files.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
from guest import BootFn, GuestRun

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCENARIOS = HERE / "scenarios"
BINARY = REPO / "dist" / "rdma-cni"
APISERVER = REPO / "tests" / "support" / "apiserver.py"

# igb VFs: offset 0x80, stride 2 behind the root port's bus 1 (see test_smoke.py).
EXPECTED_VFS = ["0000:01:10.0", "0000:01:10.2", "0000:01:10.4", "0000:01:10.6"]
PF_PCI = "0000:01:00.0"
# Must match RC_SUBNET in scenarios/plugin_lib.sh.
SUBNET = ipaddress.ip_network("10.77.0.0/24")
ANNOTATION = "rdma_interfaces_required"

#: Pod name -> its annotation, served by the API stand-in (namespace "default").
PODS: dict[str, list[dict[str, int]]] = {
    "rates": [{"max_tx_rate": 100}, {"max_tx_rate": 200}],
    # The refused min_tx_rate is on the second interface, so that the rollback has a
    # fully attached first VF (rate, move, lease, addresses) to undo.
    "minrate": [{"max_tx_rate": 300}, {"min_tx_rate": 100, "max_tx_rate": 200}],
    "gone": [{"max_tx_rate": 150}, {}],
    **{f"par{i}": [{"max_tx_rate": 50}] for i in range(5)},
    "rxe-required": [{"max_tx_rate": 100}],
    "rxe-auto": [{"max_tx_rate": 100}],
    # Also scenario 6's allocated state: a rate the inventory must show.
    "rxe-shared": [{"max_tx_rate": 300}],
    "decoy": [{"max_tx_rate": 100}],
    "stale": [{"max_tx_rate": 100}],
}

PARALLEL_PODS = [f"par{i}" for i in range(5)]

#: Every scenario the boot runs, as rc_run names them (their directory under out/).
SCENARIO_NAMES = [
    "s5_rdma_exclusive",
    "s6_inventory",
    "s1_rates",
    "s2_min_rate",
    "s3_netns_gone",
    "s4_parallel",
    "s5_rdma_shared",
    "s7_decoy",
    "s8_stale",
]


def pod_uid(name: str) -> str:
    """The pod's UID, as rc_cni (scenarios/plugin_lib.sh) passes it: 32 hex digits, as a static pod's."""
    return hashlib.md5(name.encode()).hexdigest()


def _pods_json() -> bytes:
    """The stand-in's --pods file."""
    pods = [
        {
            "namespace": "default",
            "name": name,
            "uid": pod_uid(name),
            "annotations": {ANNOTATION: json.dumps(request)},
        }
        for name, request in PODS.items()
    ]
    return json.dumps(pods, indent=1).encode()


# -- reading what the guest left ---------------------------------------------


def _json_lines(text: str) -> Any:
    """JSON from iproute2/rdma; empty output (no devices) reads as an empty list."""
    return json.loads(text) if text.strip() else []


class Dump:
    """One ``rc_dump`` directory: the kernel's view plus the plugin's state at one moment."""

    def __init__(self, path: Path) -> None:
        if not path.is_dir():
            raise AssertionError(f"the guest left no dump {path}")
        self.path = path

    def _read(self, name: str) -> str:
        file = self.path / name
        if not file.exists():
            raise AssertionError(f"{file} is missing")
        return file.read_text()

    @cached_property
    def links(self) -> list[dict[str, Any]]:
        """``ip -d -j link`` in the host namespace."""
        return _json_lines(self._read("links.json"))

    @cached_property
    def vf_links(self) -> dict[str, dict[str, Any]]:
        """Host-namespace VF netdevs by PCI address (the kernel's ``parentdev``)."""
        return {link["parentdev"]: link for link in self.links if link.get("parentdev") in EXPECTED_VFS}

    @cached_property
    def vf_names(self) -> dict[str, str]:
        """PCI address -> host netdev name, for VFs whose netdev is in the host."""
        return {pci: link["ifname"] for pci, link in self.vf_links.items()}

    @cached_property
    def vf_sysfs_net(self) -> dict[str, list[str]]:
        """PCI address -> the netdev names the host's sysfs lists under the VF's device."""
        rows = (line.split() for line in self._read("vf-sysfs-net.txt").splitlines() if line.strip())
        return {row[0]: row[1:] for row in rows}

    @cached_property
    def vfinfo(self) -> dict[int, dict[str, Any]]:
        """The PF's ``vfinfo_list`` by VF index."""
        (pf,) = (link for link in self.links if link.get("parentdev") == PF_PCI)
        return {vf["vf"]: vf for vf in pf["vfinfo_list"]}

    @cached_property
    def rates(self) -> dict[str, tuple[int, int]]:
        """PCI address -> (min_tx, max_tx) from the PF's VF table."""
        return {
            EXPECTED_VFS[vf]: (info["rate"]["min_tx"], info["rate"]["max_tx"])
            for vf, info in self.vfinfo.items()
        }

    @cached_property
    def rdma_devices(self) -> list[str]:
        """RDMA devices the host namespace sees (``rdma -j dev``)."""
        return sorted(dev["ifname"] for dev in _json_lines(self._read("rdma-dev.json")))

    @cached_property
    def rdma_links(self) -> dict[str, str | None]:
        """RDMA device -> its netdev, as ``rdma -j link`` reports it."""
        return {link["ifname"]: link.get("netdev") for link in _json_lines(self._read("rdma-link.json"))}

    @cached_property
    def rxe_parents(self) -> dict[str, str]:
        """RDMA device -> ``/sys/class/infiniband/<dev>/parent``."""
        out = {}
        for line in self._read("rxe-parents.txt").splitlines():
            dev, _, parent = line.partition(" ")
            out[dev] = parent
        return out

    @cached_property
    def rdma_mode(self) -> str:
        """``shared`` or ``exclusive``, from ``rdma system``."""
        match = re.search(r"\bnetns (\w+)", self._read("rdma-system.txt"))
        assert match, f"no netns mode in {self.path / 'rdma-system.txt'}"
        return match.group(1)

    @cached_property
    def netns(self) -> list[str]:
        """Names from ``ip netns list``."""
        return [line.split()[0] for line in self._read("netns.txt").splitlines() if line.strip()]

    @cached_property
    def records(self) -> list[dict[str, Any]]:
        """The plugin's allocation records (``stateDir/attachments``)."""
        return [json.loads(p.read_text()) for p in sorted((self.path / "records").glob("*.json"))]

    @cached_property
    def ipam_files(self) -> list[str]:
        """Every file under host-local's dataDir, relative to it."""
        return self._read("leases.txt").split()

    @cached_property
    def leases(self) -> list[str]:
        """host-local's lease files: one per allocated address, named after it."""
        out = []
        for rel in self.ipam_files:
            try:
                ipaddress.ip_address(Path(rel).name)
            except ValueError:
                continue
            out.append(rel)
        return out

    def pod_links(self, ns: str) -> dict[str, dict[str, Any]]:
        """``ip -n NS -d -j addr`` by interface name (link details and ``addr_info``)."""
        return {link["ifname"]: link for link in _json_lines(self._read(f"netns-{ns}.json"))}

    def pod_addrs(self, ns: str) -> dict[str, list[str]]:
        """Interface name -> its addresses in CIDR form, inside NS."""
        return {
            name: [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])]
            for name, link in self.pod_links(ns).items()
        }


class Scenario:
    """One scenario's directory under out/ (results, dumps, trace, plugin log)."""

    def __init__(self, run: GuestRun, name: str) -> None:
        self.run = run
        self.name = name
        self.path = run.out / name

    def text(self, name: str) -> str:
        return (self.path / name).read_text()

    def rc(self, label: str) -> int:
        """Exit status of one cnirun call (LABEL.rc)."""
        return int(self.text(f"{label}.rc"))

    def cni(self, label: str) -> dict[str, Any]:
        """What one cnirun call printed: the result, or the error object."""
        return json.loads(self.text(f"{label}.json"))

    def call(self, label: str) -> str:
        """A cnirun call's output and stderr, for assertion messages."""
        rc = self.text(f"{label}.rc").strip()
        return f"{label}: rc {rc}\n{self.text(f'{label}.json')}\n{self.text(f'{label}.err')}"

    def dump(self, label: str) -> Dump:
        """``dump-LABEL`` of this scenario."""
        return Dump(self.path / f"dump-{label}")

    @property
    def plugin_log(self) -> str:
        """The plugin's log files for this scenario's networks, concatenated."""
        return "".join(p.read_text() for p in sorted(self.path.glob("plugin-*.log")))


def _scenario(run: GuestRun, name: str) -> Scenario:
    """The scenario's results, or a failure carrying its trace when it did not complete."""
    scn = Scenario(run, name)
    status = scn.path / "status"
    if not status.exists():
        pytest.fail(f"scenario {name} never ran (see test_boot_completed)", pytrace=False)
    if status.read_text().strip() != "0":
        trace = (scn.path / "trace.log").read_text(errors="replace")
        pytest.fail(
            f"scenario {name} did not complete (exit {status.read_text().strip()}):\n{trace}", pytrace=False
        )
    return scn


# -- fixtures ----------------------------------------------------------------


@pytest.fixture(scope="module")
def plugin_run(e2e_boot_module: BootFn) -> GuestRun:
    """The one boot all scenarios share."""
    if not BINARY.is_file():
        pytest.fail(f"{BINARY} is missing: run `make build` (make e2e does)", pytrace=False)
    files = {
        "rdma-cni": BINARY,
        "apiserver.py": APISERVER,
        "pods.json": _pods_json(),
        "scenarios": SCENARIOS,
    }
    run = e2e_boot_module((SCENARIOS / "plugin.sh").read_text(), files=files, timeout=900.0)
    times = {name: _read_or(run.out / name / "seconds", "?").strip() for name in SCENARIO_NAMES}
    print(
        f"\nplugin guest: wall {run.wall_seconds:.1f} s, scenarios from guest uptime "
        f"{run.guest_times.get('scenario_start')} s to {run.guest_times.get('scenario_end')} s; "
        + ", ".join(f"{name} {secs} s" for name, secs in times.items())
    )
    return run


def _read_or(path: Path, default: str) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return default


@pytest.fixture(scope="module")
def original_names(plugin_run: GuestRun) -> dict[str, str]:
    """PCI address -> the VF netdev name the kernel gave it at setup (eth1..eth4)."""
    names = plugin_run.read_text("vf-netdevs.txt").split()
    assert plugin_run.read_text("vf-pci.txt").split() == EXPECTED_VFS
    # Kernel names (the guest has no udev): what "restored" means in every scenario.
    assert names == ["eth1", "eth2", "eth3", "eth4"]
    return dict(zip(EXPECTED_VFS, names, strict=True))


@pytest.fixture(scope="module")
def node_env(plugin_run: GuestRun) -> dict[str, str]:
    """Facts rc_node_facts recorded: PF name, its speed, the capacity configured, rxe."""
    pairs = (line.partition("=") for line in plugin_run.read_text("node.env").splitlines())
    return {key: value for key, _, value in pairs}


@pytest.fixture(scope="module")
def rxe(node_env: dict[str, str]) -> None:
    """The RDMA scenarios need soft-RoCE; its absence is a broken guest, not a skip."""
    assert node_env["rxe"] == "1", "rdma_rxe could not be loaded in the guest"


@pytest.fixture(scope="module")
def baseline(plugin_run: GuestRun, original_names: dict[str, str]) -> Dump:
    """The shared-mode node every scenario from s1 on starts from and must return to."""
    dump = Dump(plugin_run.out / "dump-baseline")
    assert dump.vf_names == original_names
    assert dump.rdma_mode == "shared"
    assert dump.rdma_devices == [] and dump.records == [] and dump.leases == []
    return dump


# -- shared assertions -------------------------------------------------------


def _link_identity(link: dict[str, Any]) -> dict[str, Any]:
    """What DEL must give back about a VF netdev: name, MAC, MTU, up/down, no alias."""
    return {
        "ifname": link["ifname"],
        "address": link["address"],
        "mtu": link["mtu"],
        "up": "UP" in link["flags"],
        "ifalias": link.get("ifalias"),
    }


def assert_node_restored(before: Dump, after: Dump, original: dict[str, str]) -> None:
    """The node as it was: VF names and links, the PF's VF table, RDMA, no record, no lease."""
    assert after.vf_names == original, "VF netdevs are not all back under their original names"
    assert {pci: _link_identity(link) for pci, link in after.vf_links.items()} == {
        pci: _link_identity(link) for pci, link in before.vf_links.items()
    }
    assert all(rate == (0, 0) for rate in after.rates.values()), f"rates not reset: {after.rates}"
    assert after.vfinfo == before.vfinfo, "the PF's vfinfo_list differs from before"
    assert after.rdma_devices == before.rdma_devices
    assert after.rdma_links == before.rdma_links
    assert after.records == [], f"allocation records left: {after.records}"
    assert after.leases == [], f"IPAM leases left: {after.leases}"


def assert_pod_empty(dump: Dump, ns: str) -> None:
    """Nothing but loopback in a pod's netns."""
    assert list(dump.pod_links(ns)) == ["lo"]


def _pod_vfs(dump: Dump, ns: str, names: list[str]) -> dict[str, str]:
    """Pod interface name -> VF PCI address, from the kernel's view inside the pod."""
    links = dump.pod_links(ns)
    assert sorted(links) == sorted(["lo", *names]), f"interfaces in {ns}: {sorted(links)}"
    return {name: links[name]["parentdev"] for name in names}


# -- the tests -----------------------------------------------------------------


def test_boot_completed(plugin_run: GuestRun) -> None:
    # The one place a failed boot is reported with its console log.
    plugin_run.check()
    missing = [name for name in SCENARIO_NAMES if not (plugin_run.out / name / "status").exists()]
    assert not missing, f"scenarios that never ran: {missing}"


def test_s1_two_rate_capped_interfaces(
    plugin_run: GuestRun, original_names: dict[str, str], baseline: Dump
) -> None:
    """ADD gives two VFs with max_tx_rate 100/200 as net1/net1-1; CHECK passes; DEL restores."""
    s = _scenario(plugin_run, "s1_rates")
    during, after = s.dump("after-add"), s.dump("after-del")

    assert s.rc("add") == 0, s.call("add")
    result = s.cni("add")
    assert result["cniVersion"] == "1.0.0"
    assert [i["name"] for i in result["interfaces"]] == ["net1", "net1-1"]
    assert {i["sandbox"] for i in result["interfaces"]} == {"/run/netns/rates"}
    ips = {ip["interface"]: ip["address"] for ip in result["ips"]}
    assert sorted(ips) == [0, 1]
    assert all(ipaddress.ip_interface(a).ip in SUBNET for a in ips.values())

    # Inside the pod: two real VFs, marked with the plugin's alias, up, with their IPs.
    vfs = _pod_vfs(during, "rates", ["net1", "net1-1"])
    assert len(set(vfs.values())) == 2 and set(vfs.values()) <= set(EXPECTED_VFS)
    pod_links = during.pod_links("rates")
    addrs = during.pod_addrs("rates")
    for n, name in enumerate(["net1", "net1-1"]):
        assert pod_links[name]["ifalias"] == f"rdma-cni:{vfs[name]}"
        assert "UP" in pod_links[name]["flags"]
        assert ips[n] in addrs[name]
    # ... and gone from the host, and from what the host's sysfs lists under their PCI devices,
    # which lists each VF at home under the name rtnetlink gives it (the sysfs proof of ADD).
    assert not set(vfs.values()) & set(during.vf_names)
    for dump in (during, after):
        assert dump.vf_sysfs_net == {
            pci: [dump.vf_names[pci]] if pci in dump.vf_names else [] for pci in EXPECTED_VFS
        }
    assert all(during.vf_sysfs_net[pci] == [] for pci in vfs.values())

    # The PF's VF table carries the caps on exactly the chosen VFs.
    assert during.rates[vfs["net1"]] == (0, 100)
    assert during.rates[vfs["net1-1"]] == (0, 200)
    assert all(during.rates[pci] == (0, 0) for pci in EXPECTED_VFS if pci not in vfs.values())

    (record,) = during.records
    assert record["state"] == "ready"
    assert record["pod"] == {"namespace": "default", "name": "rates", "uid": pod_uid("rates")}
    assert [(v["pci"], v["pod_name"], v["host_name"], v["max_tx_rate"]) for v in record["vfs"]] == [
        (vfs["net1"], "net1", original_names[vfs["net1"]], 100),
        (vfs["net1-1"], "net1-1", original_names[vfs["net1-1"]], 200),
    ]
    assert len(during.leases) == 2

    assert s.rc("check") == 0, s.call("check")

    assert s.rc("del") == 0, s.call("del")
    assert_node_restored(baseline, after, original_names)
    assert_pod_empty(after, "rates")


def test_s1_ran_in_the_warm_server(plugin_run: GuestRun) -> None:
    """By s1 the launcher's warm server is up: it served ADD, CHECK and DEL on the real VFs."""
    log = _scenario(plugin_run, "s1_rates").plugin_log
    for verb in ("ADD", "CHECK", "DEL"):
        assert re.search(rf"{verb} \S+ done in [0-9.]+ ms \(warm start\)", log), f"{verb}:\n{log}"
    # The guest's sysfs was proven to show the host's namespace: ADD proved its VFs by sysfs.
    assert "are not those of this network namespace" not in log


def test_s2_min_tx_rate_refused_by_igb_rolls_back(
    plugin_run: GuestRun, original_names: dict[str, str], baseline: Dump
) -> None:
    """igb answers EINVAL to min_tx_rate: code 103 naming it, and the node exactly as before."""
    s = _scenario(plugin_run, "s2_min_rate")
    after = s.dump("after-add")

    assert s.rc("add") == 1, s.call("add")
    error = s.cni("add")
    assert error["code"] == 103, error
    assert "min_tx_rate" in error["msg"] and "refused" in error["msg"], error
    # The driver's own answer (EINVAL), not a guess.
    assert "Invalid argument" in error["msg"], error

    # The plugin's rollback alone (no DEL has run) restored everything.
    assert_node_restored(baseline, after, original_names)
    assert_pod_empty(after, "minrate")
    # host-local did hand out an address (to the first interface) and the rollback gave
    # it back: its last_reserved_ip file stays behind, the lease does not.
    assert any(f.startswith("s2_min_rate/last_reserved_ip") for f in after.ipam_files), after.ipam_files


def test_s3_del_after_netns_deleted(
    plugin_run: GuestRun, original_names: dict[str, str], baseline: Dump
) -> None:
    """VFs come back as net1/net1-1 when the netns dies; DEL restores names and rates."""
    s = _scenario(plugin_run, "s3_netns_gone")
    during, gone, after = s.dump("after-add"), s.dump("netns-deleted"), s.dump("after-del")
    assert s.rc("add") == 0, s.call("add")
    vfs = _pod_vfs(during, "gone", ["net1", "net1-1"])
    assert during.rates[vfs["net1"]] == (0, 150)

    # The kernel's behaviour DEL has to cope with, seen before DEL runs: the VFs are
    # back in the host under their pod-side names, still carrying the plugin's alias
    # and their rates, and the record still holds them.
    assert "gone" not in gone.netns
    assert gone.vf_names[vfs["net1"]] == "net1"
    assert gone.vf_names[vfs["net1-1"]] == "net1-1"
    for name, pci in vfs.items():
        assert gone.vf_links[pci].get("ifalias") == f"rdma-cni:{pci}", name
    assert gone.rates[vfs["net1"]] == (0, 150)
    assert len(gone.records) == 1

    assert s.rc("del") == 0, s.call("del")
    assert_node_restored(baseline, after, original_names)


def test_s4_five_parallel_adds_on_four_vfs(
    plugin_run: GuestRun, original_names: dict[str, str], baseline: Dump
) -> None:
    """Exactly four of five concurrent ADDs succeed, each with its own VF; the fifth gets 100."""
    s = _scenario(plugin_run, "s4_parallel")
    during, after = s.dump("after-add"), s.dump("after-del")
    rcs = {pod: s.rc(f"{pod}/add") for pod in PARALLEL_PODS}
    granted = [pod for pod, rc in rcs.items() if rc == 0]
    refused = [pod for pod, rc in rcs.items() if rc != 0]
    assert len(granted) == 4 and len(refused) == 1, "\n".join(s.call(f"{p}/add") for p in PARALLEL_PODS)

    (loser,) = refused
    error = s.cni(f"{loser}/add")
    assert error["code"] == 100, error
    assert f"default/{loser}" in error["msg"], error
    assert_pod_empty(during, loser)

    # The kernel's view: four distinct VFs in four distinct pods, none left in the host.
    held = {pod: _pod_vfs(during, pod, ["net1"])["net1"] for pod in granted}
    assert sorted(held.values()) == EXPECTED_VFS, held
    assert during.vf_names == {}
    assert all(during.rates[pci] == (0, 50) for pci in EXPECTED_VFS)
    results = {pod: s.cni(f"{pod}/add") for pod in granted}
    assert all(r["interfaces"][0]["sandbox"] == f"/run/netns/{pod}" for pod, r in results.items())
    assert len({r["ips"][0]["address"] for r in results.values()}) == 4
    records = {r["pod"]["name"]: [v["pci"] for v in r["vfs"]] for r in during.records}
    assert records == {pod: [pci] for pod, pci in held.items()}
    assert len(during.leases) == 4

    # Every DEL succeeds, the refused pod's included (a runtime sends it after a failed ADD).
    for pod in PARALLEL_PODS:
        assert s.rc(f"{pod}/del") == 0, s.call(f"{pod}/del")
    assert_node_restored(baseline, after, original_names)
    for pod in PARALLEL_PODS:
        assert_pod_empty(after, pod)


def test_s5_rdma_netns_mode_switch_needs_no_other_netns(plugin_run: GuestRun) -> None:
    """The kernel rule the boot's order is built around: EBUSY while another netns exists."""
    s = _scenario(plugin_run, "s5_rdma_exclusive")
    assert "netns shared" in s.text("mode-initial.txt")
    assert s.text("ebusy.rc").strip() != "0"
    assert "Device or resource busy" in s.text("ebusy.err")
    assert s.dump("before").rdma_mode == "exclusive"


@pytest.mark.parametrize("isolation", ["required", "auto"])
def test_s5_exclusive_mode_refuses_to_move_rxe(
    plugin_run: GuestRun, original_names: dict[str, str], rxe: None, isolation: str
) -> None:
    """In exclusive mode the kernel cannot move rxe (EOPNOTSUPP): code 105 and a full rollback.

    ``auto`` moves RDMA devices whenever the system is in exclusive mode
    (rdma_cni/node/isolation.py decide()), so a refused move fails it like ``required``.
    """
    s = _scenario(plugin_run, "s5_rdma_exclusive")
    before, after = s.dump("before"), s.dump(f"after-add-{isolation}")
    assert before.rdma_mode == "exclusive"
    assert before.rdma_devices == ["rxe0", "rxe1", "rxe2", "rxe3"]
    assert before.vf_names == original_names

    assert s.rc(f"{isolation}/add") == 1, s.call(f"{isolation}/add")
    error = s.cni(f"{isolation}/add")
    assert error["code"] == 105, error
    assert re.search(r"cannot move RDMA device rxe\d", error["msg"]), error
    assert "cannot be moved" in error["msg"], error
    # 95 is both EOPNOTSUPP and ENOTSUP on Linux; Python names it ENOTSUP.
    assert re.search(r"\[(EOPNOTSUPP|ENOTSUP)\]", error["msg"]), error

    # Rolled back by ADD itself: VF name, rate, no record, no lease, rxe still in the host
    # on the same netdev.
    assert_node_restored(before, after, original_names)
    assert_pod_empty(after, f"rxe-{isolation}")
    assert after.rxe_parents == before.rxe_parents


def test_s5_shared_mode_leaves_rxe_shared(
    plugin_run: GuestRun, original_names: dict[str, str], baseline: Dump, rxe: None
) -> None:
    """Shared mode with auto: ADD succeeds and the record says "shared"; the kernel destroys
    the rxe device on the VF that left the host, and nothing brings it back."""
    s = _scenario(plugin_run, "s5_rdma_shared")
    before, during, after = s.dump("before"), s.dump("after-add"), s.dump("after-del")
    assert before.rdma_mode == "shared"
    assert before.vf_names == original_names
    rxe_on = {parent: dev for dev, parent in before.rxe_parents.items()}
    assert sorted(rxe_on) == sorted(original_names[pci] for pci in EXPECTED_VFS[:2])

    assert s.rc("add") == 0, s.call("add")
    (pci,) = _pod_vfs(during, "rxe-shared", ["net1"]).values()
    (record,) = during.records
    (vf,) = record["vfs"]
    assert vf["pci"] == pci
    # Placement takes the lowest free VF, which carries an rxe device.
    device = rxe_on.get(original_names[pci])
    assert device, f"the pod got {pci}, which had no rxe device: {before.rxe_parents}"
    assert vf["rdma_action"] == "shared"
    assert vf["rdma_device"] == device
    assert f"RDMA device {device} of VF {pci} stays shared" in s.plugin_log

    # Observed kernel behaviour in shared mode: the rxe device followed its netdev's
    # unregistration from the host namespace and is gone; the bystander is untouched.
    bystanders = sorted(dev for dev in before.rdma_devices if dev != device)
    assert during.rdma_devices == bystanders
    assert during.rdma_mode == "shared"

    assert s.rc("del") == 0, s.call("del")
    assert after.vf_names == original_names
    assert after.vfinfo == baseline.vfinfo
    assert after.records == [] and after.leases == []
    # DEL does not (cannot) recreate a destroyed rxe device: whoever made it must.
    assert after.rdma_devices == bystanders


def _assert_inventory_matches(inv: dict[str, Any], dump: Dump, pf_name: str, capacity: int) -> None:
    """``rdma-cni inventory`` against the kernel's view of the same moment."""
    (pf,) = inv["pfs"]
    assert pf["name"] == pf_name
    assert pf["pci_address"] == PF_PCI
    assert pf["capacity_vfs"] == 4 and pf["total_vfs"] == 7
    assert pf["capacity_tx_rate"] == capacity
    assert [v["vf"] for v in pf["vfs"]] == [0, 1, 2, 3]
    assert [v["pci_address"] for v in pf["vfs"]] == EXPECTED_VFS
    devices_on: dict[str, list[str]] = {}
    for dev, parent in dump.rxe_parents.items():
        devices_on.setdefault(parent, []).append(dev)
    for v in pf["vfs"]:
        kernel = dump.vfinfo[v["vf"]]
        pci = v["pci_address"]
        netdev = dump.vf_names.get(pci)
        where = f"VF {v['vf']} ({pci}): inventory {v}, kernel {kernel}"
        assert v["mac"] == kernel["address"], where
        assert v["max_tx_rate"] == kernel["rate"]["max_tx"], where
        assert v["min_tx_rate"] == kernel["rate"]["min_tx"], where
        assert v["spoof_check"] == kernel["spoofchk"], where
        assert v["trust"] == kernel["trust"], where
        assert v["link_state"] == kernel["link_state"], where
        assert v["vlan"] == (kernel.get("vlan_list") or [{}])[0].get("vlan", 0), where
        assert v["netdev"] == netdev, where
        assert v["driver"] == "igbvf", where
        assert sorted(v["rdma_devices"]) == sorted(devices_on.get(netdev, []) if netdev else []), where
    assert inv["rdma_netns_mode"] == dump.rdma_mode


def _inventory(s: Scenario, name: str) -> dict[str, Any]:
    assert s.text(f"{name}.rc").strip() == "0", s.text(f"{name}.err")
    return json.loads(s.text(name))


def test_s6_inventory_matches_kernel_exclusive_idle(
    plugin_run: GuestRun, original_names: dict[str, str], node_env: dict[str, str], rxe: None
) -> None:
    """Idle node in exclusive mode, rxe on every VF, no --config: the kernel's view."""
    s = _scenario(plugin_run, "s6_inventory")
    dump = s.dump("exclusive")
    assert dump.rdma_mode == "exclusive"
    assert sorted(dump.rxe_parents.values()) == sorted(original_names.values())
    inv = _inventory(s, "inventory-exclusive.json")
    # Without --config the capacity is the PF's link speed.
    _assert_inventory_matches(inv, dump, node_env["pf"], int(node_env["pf_speed"]))
    (pf,) = inv["pfs"]
    assert pf["used_vfs"] == 0 and pf["free_vfs"] == 4 and pf["used_tx_rate"] == 0
    assert [v["rdma_devices"] for v in pf["vfs"]] == [["rxe0"], ["rxe1"], ["rxe2"], ["rxe3"]]
    assert all(r["netns"] == "host" for v in pf["vfs"] for r in v["rdma"])


def test_s6_inventory_matches_kernel_allocated(
    plugin_run: GuestRun, original_names: dict[str, str], node_env: dict[str, str], rxe: None
) -> None:
    """Shared mode, pod default/rxe-shared holding a VF capped at 300 Mbit/s (--config)."""
    s = _scenario(plugin_run, "s5_rdma_shared")
    assert s.rc("add") == 0, s.call("add")
    dump = s.dump("after-add")
    (pci,) = _pod_vfs(dump, "rxe-shared", ["net1"]).values()
    inv = _inventory(s, "inventory.json")
    _assert_inventory_matches(inv, dump, node_env["pf"], int(node_env["capacity"]))
    (pf,) = inv["pfs"]
    assert pf["used_vfs"] == 1 and pf["free_vfs"] == 3
    by_pci = {v["pci_address"]: v for v in pf["vfs"]}
    held = by_pci[pci]
    assert held["max_tx_rate"] == 300 and dump.rates[pci] == (0, 300)
    assert held["allocated"] is True and held["netdev"] is None
    assert held["owner"]["pod"] == "default/rxe-shared" and held["owner"]["pod_ifname"] == "net1"
    assert held["owner"]["rdma"] == "shared"
    # The record names the rxe device the kernel destroyed: the inventory says it is absent.
    assert held["rdma"] == [{"device": held["owner"]["rdma_device"], "netns": "absent"}]
    assert all(not v["allocated"] for other, v in by_pci.items() if other != pci)


def test_s7_decoy_in_the_pod_is_ignored_and_the_real_vf_comes_home(
    plugin_run: GuestRun, original_names: dict[str, str], baseline: Dump
) -> None:
    """A pod-side veth named and aliased like the VF is not the VF: the parent device decides."""
    s = _scenario(plugin_run, "s7_decoy")
    during, swapped, after = s.dump("after-add"), s.dump("swapped"), s.dump("after-del")
    assert s.rc("add") == 0, s.call("add")
    (pci,) = _pod_vfs(during, "decoy", ["net1"]).values()

    # The swap as the kernel sees it: the real VF is hidden0; net1 is a veth carrying the VF's alias.
    links = swapped.pod_links("decoy")
    assert links["hidden0"]["parentdev"] == pci
    assert links["net1"].get("ifalias") == f"rdma-cni:{pci}" and "parentdev" not in links["net1"]

    assert s.rc("check") == 1 and s.cni("check")["code"] == 106, s.call("check")
    assert "is not VF" in s.cni("check")["msg"], s.call("check")

    assert s.rc("del") == 0, s.call("del")
    # The decoy stays with its pod; the real VF is home under its name, rate reset, lease gone.
    left = after.pod_links("decoy")
    assert sorted(left) == ["decoyp", "lo", "net1"]
    assert "parentdev" not in left["net1"]
    assert_node_restored(baseline, after, original_names)


def _vlan(info: dict[str, Any]) -> int:
    """A VF's VLAN in iproute2's JSON: IFLA_VF_VLAN_LIST's first entry, no "vlan" key when it is 0."""
    return int(((info.get("vlan_list") or [{}])[0]).get("vlan", info.get("vlan", 0)))


def test_s8_a_vf_left_on_a_vlan_and_trusted_gives_its_pod_the_defaults(
    plugin_run: GuestRun, original_names: dict[str, str], baseline: Dump
) -> None:
    """On igb: VLAN 42 and trust, left on every VF, are not the next pod's; DEL puts them back."""
    s = _scenario(plugin_run, "s8_stale")
    during, after, reset = s.dump("after-add"), s.dump("after-del"), s.dump("reset")
    assert s.rc("add") == 0, s.call("add")
    (pci,) = _pod_vfs(during, "stale", ["net1"]).values()
    index = EXPECTED_VFS.index(pci)
    for vf, info in during.vfinfo.items():
        held = vf == index
        assert _vlan(info) == (0 if held else 42), (vf, info)
        assert info["trust"] is (not held), (vf, info)
    assert during.rates[pci] == (0, 100)
    assert s.rc("del") == 0, s.call("del")
    assert all(_vlan(info) == 42 and info["trust"] is True for info in after.vfinfo.values()), after.vfinfo
    assert_node_restored(baseline, reset, original_names)

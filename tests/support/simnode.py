"""A simulated SR-IOV node for tests and the demo: a fake sysfs tree whose VFs are veth devices.

Needs root (veth, network namespaces). The tree mirrors the real layout the
plugin reads (``class/net/<pf>/device -> bus/pci/devices/<pci>``,
``sriov_numvfs``, ``virtfnN``, ``net/<netdev>``, ``driver``, ``speed``,
``numa_node``, ``infiniband/``), and PF-side VF settings live in the JSON file
the plugin's ``RDMA_CNI_FAKE_VF_CONTROL`` seam reads. Each VF netdev is one
end of a real veth pair (the other end stays in the host as its "wire"), so
netns moves, renames, addresses and routes are real kernel operations. The
wire is the VF's identity: ``bus/pci/devices/<pci>/rdma_cni_sim_wire`` names
it, and the plugin (with ``RDMA_CNI_FAKE_VF_IDENTITY`` set) takes a netdev
for that VF only when the kernel reports the wire as its peer, which a pod
cannot forge (see rdma_cni.kernel.identity).

Test code may use ``ip`` freely; only the plugin is held to netlink.

CLI (used by ``make demo``)::

    python3 -m tests.support.simnode up DIR [--pfs sim0:4:25000,sim1:4:10000]
    python3 -m tests.support.simnode down DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip`` (test code only)."""
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@dataclass
class SimPf:
    name: str
    num_vfs: int
    speed: int | None = 25000
    numa_node: int = 0
    rdma: bool = False  # give each VF a fake PCI RDMA device (mlx5_N) in sysfs
    # The PCIe root complex (``pci0000:3a``) the PF and its VFs sit under: their devices then live in
    # ``devices/<root>/`` with ``bus/pci/devices`` linking there, as on a real host; None: no root.
    pcie_root: str | None = None


@dataclass
class SimNode:
    """A fake node under ``root``; ``prefix`` keeps parallel runs' interface names apart."""

    root: str
    pfs: list[SimPf] = field(default_factory=lambda: [SimPf("simpf0", 4)])
    prefix: str = "sv"

    @property
    def sysfs(self) -> str:
        return os.path.join(self.root, "sys")

    @property
    def vfcontrol(self) -> str:
        return os.path.join(self.root, "vfcontrol.json")

    def env(self) -> dict[str, str]:
        """Environment the plugin needs to see this node."""
        return {
            "RDMA_CNI_SYSFS_ROOT": self.sysfs,
            "RDMA_CNI_FAKE_VF_CONTROL": self.vfcontrol,
            "RDMA_CNI_FAKE_VF_IDENTITY": "veth-peer",
        }

    def pf_pci(self, k: int) -> str:
        return f"0000:{0x5E + k:02x}:00.0"

    def vf_pci(self, k: int, i: int) -> str:
        return f"0000:{0x5E + k:02x}:{1 + i // 8:02x}.{i % 8}"

    def vf_netdev(self, k: int, i: int) -> str:
        return f"{self.prefix}{k}v{i}"

    def vf_wire(self, k: int, i: int) -> str:
        return f"{self.prefix}{k}w{i}"

    def all_vfs(self) -> list[tuple[int, int]]:
        return [(k, i) for k, pf in enumerate(self.pfs) for i in range(pf.num_vfs)]

    # -- building -----------------------------------------------------------

    def up(self) -> SimNode:
        """Create the sysfs tree and the veth devices."""
        os.makedirs(self.root, exist_ok=True)
        shutil.rmtree(self.sysfs, ignore_errors=True)
        os.makedirs(os.path.join(self.sysfs, "bus", "pci", "devices"))
        drivers = os.path.join(self.sysfs, "bus", "pci", "drivers")
        os.makedirs(os.path.join(self.sysfs, "class", "net"))
        os.makedirs(os.path.join(self.sysfs, "class", "infiniband"))
        os.makedirs(os.path.join(drivers, "simvf"))
        os.makedirs(os.path.join(drivers, "simpf"))
        for k, pf in enumerate(self.pfs):
            pf_dir = self._pci_device(pf, self.pf_pci(k))
            self._write(pf_dir, "sriov_numvfs", pf.num_vfs)
            self._write(pf_dir, "sriov_totalvfs", max(pf.num_vfs, 8))
            self._write(pf_dir, "numa_node", pf.numa_node)
            os.symlink(os.path.join(drivers, "simpf"), os.path.join(pf_dir, "driver"))
            net_dir = os.path.join(self.sysfs, "class", "net", pf.name)
            os.makedirs(net_dir)
            os.symlink(pf_dir, os.path.join(net_dir, "device"))
            self._write(net_dir, "speed", pf.speed if pf.speed is not None else -1)
            for i in range(pf.num_vfs):
                vf_dir = self._pci_device(pf, self.vf_pci(k, i))
                os.makedirs(os.path.join(vf_dir, "net", self.vf_netdev(k, i)))
                self._write(vf_dir, "rdma_cni_sim_wire", self.vf_wire(k, i))
                os.symlink(vf_dir, os.path.join(pf_dir, f"virtfn{i}"))
                os.symlink(pf_dir, os.path.join(vf_dir, "physfn"))
                os.symlink(os.path.join(drivers, "simvf"), os.path.join(vf_dir, "driver"))
                if pf.rdma:
                    os.makedirs(os.path.join(vf_dir, "infiniband", f"mlx5_{k * 16 + i}"))
                self.make_vf_netdev(k, i)
        with open(self.vfcontrol, "w", encoding="utf-8") as f:
            json.dump({"pfs": {}, "calls": []}, f)
        return self

    def _pci_device(self, pf: SimPf, pci: str) -> str:
        """Make PCI function ``pci``'s directory (under the PF's root complex, if any); its bus path."""
        bus_path = os.path.join(self.sysfs, "bus", "pci", "devices", pci)
        if pf.pcie_root is None:
            os.makedirs(bus_path)
            return bus_path
        real = os.path.join(self.sysfs, "devices", pf.pcie_root, pci)
        os.makedirs(real)
        os.symlink(os.path.relpath(real, os.path.dirname(bus_path)), bus_path)
        return bus_path

    def set_speed(self, k: int, speed: int | None) -> None:
        """Set PF ``k``'s link speed in sysfs (None: unknown, -1), as a renegotiated link changes it."""
        self.pfs[k].speed = speed
        self._write(
            os.path.join(self.sysfs, "class", "net", self.pfs[k].name),
            "speed",
            speed if speed is not None else -1,
        )

    def set_num_vfs(self, k: int, count: int) -> None:
        """Show only the first ``count`` of PF ``k``'s VFs as enabled (``sriov_numvfs``)."""
        pf_dir = os.path.join(self.sysfs, "bus", "pci", "devices", self.pf_pci(k))
        self._write(pf_dir, "sriov_numvfs", count)

    @staticmethod
    def _write(directory: str, name: str, value: object) -> None:
        with open(os.path.join(directory, name), "w", encoding="ascii") as f:
            f.write(f"{value}\n")

    def make_vf_netdev(self, k: int, i: int) -> None:
        """(Re)create VF (k, i)'s veth, e.g. after its pod's netns took it down with it."""
        name, wire = self.vf_netdev(k, i), self.vf_wire(k, i)
        ip("link", "del", wire, check=False)
        ip("link", "add", name, "type", "veth", "peer", "name", wire)
        ip("link", "set", wire, "up")

    def down(self) -> None:
        """Remove every veth this node made (and whatever moved with them)."""
        for k, i in self.all_vfs():
            ip("link", "del", self.vf_wire(k, i), check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- inspection ---------------------------------------------------------

    def vf_state(self) -> dict[str, object]:
        """The fake PF-side VF table and call log."""
        with open(self.vfcontrol, encoding="utf-8") as f:
            return json.load(f)

    def refuse(self, key: str, errno_: int) -> None:
        """Make the fake PF refuse a setting: ``"min_tx_rate"`` or ``"<pf>/<vf>"``."""
        doc = self.vf_state()
        doc.setdefault("refuse", {})[key] = errno_
        with open(self.vfcontrol, "w", encoding="utf-8") as f:
            json.dump(doc, f)

    @staticmethod
    def host_links() -> set[str]:
        out = ip("-j", "link", "show").stdout
        return {link["ifname"] for link in json.loads(out)}


def add_netns(name: str) -> str:
    """Create a named netns (a pod stand-in); returns its path."""
    ip("netns", "add", name)
    return f"/run/netns/{name}"


def del_netns(name: str) -> None:
    ip("netns", "del", name, check=False)


def netns_links(name: str) -> dict[str, dict[str, object]]:
    """Links in a named netns as ``ip -j -d`` reports them, by name."""
    out = subprocess.run(
        ["ip", "-n", name, "-j", "-d", "addr", "show"], check=True, capture_output=True, text=True
    ).stdout
    return {link["ifname"]: link for link in json.loads(out)}


def _parse_pfs(spec: str) -> list[SimPf]:
    out = []
    for item in spec.split(","):
        name, count, speed = [*item.split(":"), "25000"][:3]
        out.append(SimPf(name, int(count), int(speed)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="simnode", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("dir")
    parser.add_argument("--pfs", default="simpf0:4:25000", help="name:numvfs:speed[,...]")
    parser.add_argument("--prefix", default="dv")
    args = parser.parse_args(argv)
    node = SimNode(os.path.abspath(args.dir), _parse_pfs(args.pfs), args.prefix)
    if args.action == "up":
        with contextlib.suppress(Exception):
            node.down()
        node.up()
        print(json.dumps(node.env()))
    else:
        node.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())

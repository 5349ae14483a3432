"""Read-only access to the SR-IOV topology in sysfs.

The root is ``/sys`` unless ``RDMA_CNI_SYSFS_ROOT`` says otherwise (tests and
the demo build a fake tree whose VF netdevs are veth devices). This is the one
place that variable is read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_PCI_ADDR = re.compile(r"[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


def root() -> str:
    """The sysfs root in force."""
    return os.environ.get("RDMA_CNI_SYSFS_ROOT") or "/sys"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


# The host's links as the kernel shows them: the real sysfs, never RDMA_CNI_SYSFS_ROOT's tree.
HOST_NET_CLASS = "/sys/class/net"


def host_ifindex(netdev: str) -> int | None:
    """The ifindex of host link ``netdev`` in the real sysfs (no rtnetlink, so no RTNL lock), or None
    when it does not show it (no such link, or a sysfs mounted in another network namespace)."""
    return _read_int(f"{HOST_NET_CLASS}/{netdev}/ifindex")


def host_net_names() -> list[str]:
    """The host's link names in the real sysfs (see :data:`HOST_NET_CLASS`)."""
    return _listdir(HOST_NET_CLASS)


@dataclass(frozen=True)
class NetdevFiles:
    """A netdev as its sysfs directory shows it: read without rtnetlink, so without the RTNL lock."""

    ifindex: int
    iflink: int  # the ifindex of its lower device or veth peer; its own for a device of its own
    address: str
    mtu: int
    flags: int  # IFF_* (IFF_UP is 0x1)


def netdev_files(path: str) -> NetdevFiles | None:
    """The netdev whose sysfs directory is ``path``, or None when it is not there or not whole.

    Six small reads, not one atomic one: the ifindex is read first and last, and a netdev
    renamed, moved or replaced under that name in between answers None, as one not there does.
    """
    ifindex = _read_int(f"{path}/ifindex")
    iflink = _read_int(f"{path}/iflink")
    address = _read(f"{path}/address")
    mtu = _read_int(f"{path}/mtu")
    flags = _read(f"{path}/flags")
    if ifindex is None or iflink is None or address is None or mtu is None or flags is None:
        return None
    if _read_int(f"{path}/ifindex") != ifindex:
        return None
    try:
        return NetdevFiles(ifindex, iflink, address, mtu, int(flags, 16))
    except ValueError:
        return None


def _one_name(name: str) -> bool:
    # A path part, never a path: what reaches here came from the kernel, but a record can be edited.
    return bool(name) and "/" not in name and name not in (".", "..")


def host_netdev(name: str) -> NetdevFiles | None:
    """Host link ``name`` in the real sysfs, or None when the sysfs does not show it."""
    return netdev_files(f"{HOST_NET_CLASS}/{name}") if _one_name(name) else None


def net_devices() -> list[str]:
    """Netdev names in ``class/net``."""
    return _listdir(os.path.join(root(), "class", "net"))


# The paths below are formed by hand, not with os.path.join: a 64-VF scan under the node lock
# forms ~500 of them, and join was the scan's largest cost in Python. Their parts are names the
# kernel gave (netdevs, PCI addresses: never empty, never with a "/"), so both forms are the same.


def pf_device_dir(netdev: str) -> str:
    return f"{root()}/class/net/{netdev}/device"


def num_vfs(netdev: str) -> int:
    """``sriov_numvfs`` of a netdev's PCI device (0 when not an SR-IOV PF)."""
    return _read_int(os.path.join(pf_device_dir(netdev), "sriov_numvfs")) or 0


def total_vfs(netdev: str) -> int:
    return _read_int(os.path.join(pf_device_dir(netdev), "sriov_totalvfs")) or 0


def _target_name(path: str) -> str:
    """The name of the directory ``path`` stands for: the last component of its resolved path.

    sysfs links (``device``, ``virtfnN``, ``driver``) point straight at the
    directory they name, so the last component of the link's own target is
    that name: one readlink instead of realpath's lstat of every component
    of the path (~70% of a 64-VF scan's CPU, under the node lock). A path
    that is no link, and a link whose target ends in ``..`` or in another
    link, are resolved in full, so the answer is always realpath's.
    """
    try:
        target = os.readlink(path)
    except OSError:
        target = ""
    name = os.path.basename(target)
    if name in ("", ".", "..") or os.path.islink(os.path.join(os.path.dirname(path), target)):
        name = os.path.basename(os.path.realpath(path))
    return name


def pci_address(device_dir: str) -> str:
    """The PCI address a device directory (or symlink to one) stands for."""
    name = _target_name(device_dir)
    return name if _PCI_ADDR.fullmatch(name) else ""


def numa_node(netdev: str) -> int | None:
    """The PF's NUMA node; None when the platform has none (-1)."""
    node = _read_int(os.path.join(pf_device_dir(netdev), "numa_node"))
    return node if node is not None and node >= 0 else None


def speed_mbps(netdev: str) -> int | None:
    """Link speed in Mbit/s, or None when unknown (-1, missing, link down)."""
    speed = _read_int(os.path.join(root(), "class", "net", netdev, "speed"))
    return speed if speed is not None and speed > 0 else None


def vf_pci(pf_netdev: str, vf: int) -> str:
    """The PCI address of VF ``vf`` of a PF."""
    return pci_address(f"{pf_device_dir(pf_netdev)}/virtfn{vf}")


def pci_dir(pci: str) -> str:
    return f"{root()}/bus/pci/devices/{pci}"


def pci_netdevs(pci: str) -> list[str]:
    """Netdev names the host sees under a PCI device (empty while it lives in a pod)."""
    return _listdir(f"{pci_dir(pci)}/net")


def pci_netdev(pci: str, name: str) -> NetdevFiles | None:
    """Netdev ``name`` under PCI device ``pci``, or None: its parent is that device only if it is there."""
    return netdev_files(f"{pci_dir(pci)}/net/{name}") if _one_name(name) and _one_name(pci) else None


def pci_driver(pci: str) -> str:
    """The bound driver's name, or "" when unbound."""
    link = f"{pci_dir(pci)}/driver"
    return _target_name(link) if os.path.islink(link) else ""


def pci_rdma_devices(pci: str) -> list[str]:
    """RDMA devices of a PCI function (mlx5, mlx4, ...), from its ``infiniband`` directory."""
    return _listdir(f"{pci_dir(pci)}/infiniband")


def rdma_devices() -> list[str]:
    """Every RDMA device in ``class/infiniband``."""
    return _listdir(os.path.join(root(), "class", "infiniband"))


def rdma_parent_netdev(device: str) -> str:
    """The netdev a software RDMA device (rxe, siw) sits on, from its ``parent`` file."""
    return _read(os.path.join(root(), "class", "infiniband", device, "parent")) or ""


def pcie_root(pci: str) -> str | None:
    """The PCIe root complex of a PCI function, ``pci<domain>:<bus>``, or None when sysfs does not show one.

    As Kubernetes' standard ``resource.kubernetes.io/pcieRoot`` attribute is
    read (k8s.io/dynamic-resource-allocation, deviceattribute): the link
    ``bus/pci/devices/<pci>`` points into ``devices/pci<domain>:<bus>/...``,
    and the first component under ``devices`` is the root.
    """
    link = pci_dir(pci)
    try:
        target = os.readlink(link)
    except OSError:
        return None
    if not os.path.isabs(target):
        target = os.path.normpath(os.path.join(os.path.dirname(link), target))
    devices = os.path.join(root(), "devices") + os.sep
    if not target.startswith(devices) or os.path.basename(target) != pci:
        return None
    first = target[len(devices) :].split(os.sep, 1)[0]
    return first if re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", first) else None

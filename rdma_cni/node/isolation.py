"""RDMA device isolation policy (netconf ``rdmaIsolation``) on top of :mod:`rdma_cni.kernel.rdma`.

- ``off``: never touch RDMA devices.
- ``auto``: in exclusive netns mode, the VF's RDMA device follows its netdev
  into the pod; in shared mode (or with no RDMA stack) it stays where it is,
  visible to every namespace, and the log and the record say so.
- ``required``: anything short of moving the device (shared mode, no RDMA
  stack, a VF without an RDMA device, a refused move) fails the ADD.

Note for shared mode: the kernel destroys a software RoCE (rxe) device when
its netdev leaves the host namespace; PCI RDMA devices are unaffected.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from rdma_cni.cni.errors import RdmaError

if TYPE_CHECKING:
    from rdma_cni.kernel.netns import Netns

log = logging.getLogger("rdma_cni.isolation")


class RdmaIsolation:
    """Decides and performs RDMA device moves for one invocation."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._probed = False
        self._system: str | None = None
        self._why_unknown = ""

    def system_mode(self) -> str | None:
        """The kernel's RDMA netns mode, or None without an RDMA stack (asked once)."""
        if not self._probed:
            from rdma_cni.kernel import rdma

            self._probed = True
            try:
                with rdma.RdmaClient() as client:
                    self._system = client.netns_mode()
            except rdma.RdmaUnsupported as exc:
                self._why_unknown = str(exc)
            except rdma.NetlinkError as exc:
                self._why_unknown = str(exc)
                if self.mode == "required":
                    raise RdmaError(f"cannot read the RDMA netns mode: {exc}") from exc
        return self._system

    def decide(self, pci: str, devices: list[str]) -> tuple[str, str]:
        """(device, action) for a VF: action "move", "shared" or "" (nothing to do)."""
        if self.mode == "off":
            return "", ""
        device = devices[0] if devices else ""
        if len(devices) > 1:
            log.warning("VF %s has several RDMA devices %s; isolating %s", pci, devices, device)
        system = self.system_mode()
        if self.mode == "required":
            if system is None:
                raise RdmaError(
                    f"rdmaIsolation is required but RDMA netlink is unavailable: {self._why_unknown}"
                )
            if system != "exclusive":
                raise RdmaError(
                    "rdmaIsolation is required but the RDMA subsystem is in shared netns mode: set "
                    "`rdma system set netns exclusive` (or ib_core netns_mode=0) on the node"
                )
            if not device:
                raise RdmaError(f"rdmaIsolation is required but VF {pci} has no RDMA device")
            return device, "move"
        if not device or system is None:
            return device, ""
        if system == "shared":
            log.info(
                "RDMA device %s of VF %s stays shared: the system is in shared netns mode, every "
                "namespace sees it",
                device,
                pci,
            )
            return device, "shared"
        return device, "move"

    def move_in(self, device: str, pod: Netns) -> None:
        """Move ``device`` from the host into the pod's namespace."""
        from rdma_cni.kernel import rdma

        try:
            with rdma.RdmaClient() as client:
                dev = client.find_by_name(device)
                if dev is None:
                    raise RdmaError(f"RDMA device {device} is not in the host network namespace")
                client.move_to_netns(dev.index, pod.fd)
        except rdma.NetlinkError as exc:
            raise RdmaError(f"cannot move RDMA device {device} into {pod.path}: {exc}") from exc

    def move_out(self, device: str, pod: Netns | None) -> None:
        """Return ``device`` to the host; fine if it is already there (the pod's netns died)."""
        from rdma_cni.kernel import rdma

        try:
            if pod is not None:
                with rdma.RdmaClient(pod.fd) as client:
                    dev = client.find_by_name(device)
                    if dev is not None:
                        from rdma_cni.kernel.netns import host_netns_fd

                        hostfd = host_netns_fd()
                        try:
                            client.move_to_netns(dev.index, hostfd)
                        finally:
                            os.close(hostfd)
                        return
            with rdma.RdmaClient() as client:
                if client.find_by_name(device) is None:
                    log.warning("RDMA device %s is neither in the pod nor in the host", device)
        except rdma.NetlinkError as exc:
            raise RdmaError(f"cannot return RDMA device {device} to the host: {exc}") from exc

    def where(self, device: str, pod: Netns) -> str:
        """ "pod", "host" or "" (nowhere visible), for CHECK."""
        from rdma_cni.kernel import rdma

        with rdma.RdmaClient(pod.fd) as client:
            if client.find_by_name(device) is not None:
                return "pod"
        with rdma.RdmaClient() as client:
            return "host" if client.find_by_name(device) is not None else ""

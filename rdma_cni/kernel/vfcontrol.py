"""PF-side VF settings (rate, VLAN, MAC, trust, spoofchk, link state): the one test seam.

:class:`KernelVfControl` talks rtnetlink to the PF. No kernel on a machine
without SR-IOV hardware accepts these calls (a veth answers EOPNOTSUPP), so
the integration tier sets ``RDMA_CNI_FAKE_VF_CONTROL=<file>`` to swap in
:class:`FileVfControl`, which keeps the VF table in a JSON file and records
every call. Everything else (netns moves, renames, addresses, IPAM) stays
real in that tier; the real PF path is covered by the QEMU tier. The fake
announces itself in the log on every use so it cannot hide in production.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from typing import Any, Protocol

from rdma_cni.cni.errors import KernelError
from rdma_cni.kernel import sysfs
from rdma_cni.kernel.netlink import Rtnl, VfInfo, neutral_vf_settings
from rdma_cni.kernel.nlsock import NetlinkError
from rdma_cni.shared.atomicfile import write_atomic

log = logging.getLogger("rdma_cni.vfcontrol")

FAKE_ENV = "RDMA_CNI_FAKE_VF_CONTROL"


def describe(settings: dict[str, Any]) -> str:
    """Human form of a settings dict, for error messages."""
    parts = []
    for key, val in settings.items():
        if key == "rate":
            parts.append(f"min_tx_rate {val[0]} max_tx_rate {val[1]} Mbit/s")
        elif key == "vlan":
            parts.append(f"vlan {val[0]} qos {val[1]}")
        else:
            parts.append(f"{key} {val}")
    return ", ".join(parts)


class VfControl(Protocol):
    def read(self, pf: str) -> dict[int, VfInfo] | None:
        """The PF's VF table by VF index, or None when the PF reports none."""
        ...

    def apply(self, pf: str, vf: int, settings: dict[str, Any]) -> None:
        """Apply PF-side settings to one VF; raise KernelError naming what was refused."""
        ...


def _refused(pf: str, vf: int, settings: dict[str, Any], code: int, text: str) -> KernelError:
    hint = ""
    if code == errno.EINVAL and settings.get("rate", [0, 0])[0]:
        hint = " (many drivers, Intel's among them, support max_tx_rate but not min_tx_rate)"
    return KernelError(
        f"PF {pf} refused VF {vf} settings [{describe(settings)}]: {text}{hint}",
        f"errno {code}",
    )


class KernelVfControl:
    """The real thing: IFLA_VFINFO_LIST on the PF over rtnetlink, in the host namespace."""

    def __init__(self, rtnl: Rtnl) -> None:
        self._rtnl = rtnl

    def read(self, pf: str) -> dict[int, VfInfo] | None:
        link = self._rtnl.get_link(name=pf, vfs=True)
        if link is None or not link.vfs:
            return None
        return {v.vf: v for v in link.vfs}

    def apply(self, pf: str, vf: int, settings: dict[str, Any]) -> None:
        link = self._rtnl.get_link(name=pf)
        if link is None:
            raise KernelError(f"PF {pf} does not exist in the host network namespace")
        try:
            self._rtnl.set_vf(link.index, vf, settings)
        except NetlinkError as exc:
            raise _refused(pf, vf, settings, exc.errno or 0, exc.strerror or str(exc)) from exc


class FileVfControl:
    """Test stand-in: the VF table lives in a JSON file; calls are appended to it.

    File shape: ``{"pfs": {pf: {vf: settings}}, "calls": [...], "refuse": {...}}``.
    ``refuse`` maps ``"min_tx_rate"`` (any non-zero min rate) or ``"<pf>/<vf>"``
    to an errno, to reproduce drivers that refuse a setting.

    A change is read, modified and written under an ``flock`` of ``<path>.lock``: verbs of
    different attachments set their VFs at once (outside the node lock), as the kernel
    takes settings of different VFs at once.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        log.warning("PF-side VF settings are simulated in %s (%s is set): not for production", path, FAKE_ENV)

    def _load(self) -> dict[str, Any]:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    def _save(self, doc: dict[str, Any]) -> None:
        # Compact, so json's C encoder writes it (indent takes the pure-Python one), and no
        # directory fsync: the kernel's own VF settings cost a netlink call, and a stand-in that
        # cost milliseconds more per VF, growing with its call log, skewed every benchmark on
        # the simulated node (a crash of the test machine loses the test, not a node's state).
        write_atomic(
            self.path, json.dumps(doc, sort_keys=True, separators=(",", ":")), mode=0o644, sync_dir=False
        )

    def read(self, pf: str) -> dict[int, VfInfo] | None:
        table = self._load().get("pfs", {}).get(pf, {})
        out = {}
        for vf in range(sysfs.num_vfs(pf)):
            out[vf] = VfInfo.from_settings(vf, {**neutral_vf_settings(), **table.get(str(vf), {})})
        return out

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def apply(self, pf: str, vf: int, settings: dict[str, Any]) -> None:
        with self._exclusive():
            self._apply(pf, vf, settings)

    def _apply(self, pf: str, vf: int, settings: dict[str, Any]) -> None:
        doc = self._load()
        doc.setdefault("calls", []).append({"pf": pf, "vf": vf, "settings": settings})
        refuse = doc.get("refuse", {})
        code = refuse.get(f"{pf}/{vf}")
        if code is None and settings.get("rate", [0, 0])[0] and "min_tx_rate" in refuse:
            code = refuse["min_tx_rate"]
        if code:
            self._save(doc)
            raise _refused(pf, vf, settings, code, os.strerror(code))
        entry = doc.setdefault("pfs", {}).setdefault(pf, {}).setdefault(str(vf), {})
        entry.update(settings)
        self._save(doc)


def vf_control(rtnl: Rtnl) -> VfControl:
    """The VF control in force: the kernel, unless the test seam is switched on."""
    fake = os.environ.get(FAKE_ENV)
    if fake:
        return FileVfControl(fake)
    return KernelVfControl(rtnl)

"""rtnetlink operations the data path needs: links, addresses, routes, PF-side VF settings.

Each :class:`Rtnl` is bound to one network namespace and talks through the shared
transport, :class:`rdma_cni.kernel.nlsock.NlSocket`.
Messages are pyroute2's ``ifinfmsg``/``ifaddrmsg``/``rtmsg``.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any

from rdma_cni.kernel.nlsock import (
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_DUMP,
    NLM_F_EXCL,
    NLM_F_REQUEST,
    NetlinkError,
    NlSocket,
    pyroute2_module,
)

RTM_NEWLINK = 16
RTM_GETLINK = 18
RTM_NEWADDR = 20
RTM_GETADDR = 22
RTM_NEWROUTE = 24
RTM_GETROUTE = 26
RTM_GETNSID = 90
IFF_UP = 0x1
RTEXT_FILTER_VF = 1
LINK_STATES = {"auto": 0, "enable": 1, "disable": 2}
LINK_STATE_NAMES = {v: k for k, v in LINK_STATES.items()}

_msgs: dict[str, Any] = {}


def _cls(name: str) -> Any:
    """pyroute2 message classes, imported on first use."""
    if not _msgs:
        _msgs["ifinfmsg"] = pyroute2_module("pyroute2.netlink.rtnl.ifinfmsg").ifinfmsg
        _msgs["ifaddrmsg"] = pyroute2_module("pyroute2.netlink.rtnl.ifaddrmsg").ifaddrmsg
        _msgs["rtmsg"] = pyroute2_module("pyroute2.netlink.rtnl.rtmsg").rtmsg
        _msgs["nsidmsg"] = pyroute2_module("pyroute2.netlink.rtnl.nsidmsg").nsidmsg
    return _msgs[name]


def neutral_vf_settings() -> dict[str, Any]:
    """A VF's PF-side settings as the kernel gives a new VF (a fresh dict each call: values are lists).

    The one definition: ADD takes a setting the driver does not report to be
    this, and resets ``vlan`` and ``trust`` to it; the integration tier's VF
    table (:class:`~rdma_cni.kernel.vfcontrol.FileVfControl`) starts from it.
    The keys are :meth:`VfInfo.settings`' and :meth:`Rtnl.set_vf`'s.
    """
    return {
        "rate": [0, 0],
        "vlan": [0, 0],
        "spoofchk": True,
        "trust": False,
        "link_state": "auto",
        "mac": "00:00:00:00:00:00",
    }


@dataclass(frozen=True)
class VfInfo:
    """A VF's PF-side settings as the kernel reports them (IFLA_VF_INFO)."""

    vf: int
    mac: str | None = None
    vlan: int | None = None
    qos: int | None = None
    min_tx_rate: int | None = None
    max_tx_rate: int | None = None
    spoofchk: bool | None = None
    trust: bool | None = None
    link_state: str | None = None

    def settings(self) -> dict[str, Any]:
        """The subset that :meth:`Rtnl.set_vf` can apply back, for restoring on DEL."""
        out: dict[str, Any] = {}
        if self.min_tx_rate is not None or self.max_tx_rate is not None:
            out["rate"] = [self.min_tx_rate or 0, self.max_tx_rate or 0]
        if self.vlan is not None:
            out["vlan"] = [self.vlan, self.qos or 0]
        for key in _PLAIN_SETTINGS:
            val = getattr(self, key)
            if val is not None:
                out[key] = val
        return out

    @classmethod
    def from_settings(cls, vf: int, settings: dict[str, Any]) -> VfInfo:
        """The inverse of :meth:`settings`: a VF reporting exactly ``settings`` (the file stand-in's)."""
        rate = settings.get("rate")
        vlan = settings.get("vlan")
        return cls(
            vf=vf,
            vlan=vlan[0] if vlan else None,
            qos=vlan[1] if vlan else None,
            min_tx_rate=rate[0] if rate else None,
            max_tx_rate=rate[1] if rate else None,
            **{key: settings[key] for key in _PLAIN_SETTINGS if key in settings},
        )


# Settings that are one VfInfo field each, under the same name (rate and vlan are pairs).
_PLAIN_SETTINGS = ("mac", "spoofchk", "trust", "link_state")


@dataclass(frozen=True)
class Link:
    """A network interface as one netlink dump entry describes it."""

    index: int
    name: str
    mac: str
    mtu: int
    up: bool
    alias: str = ""
    parent_dev: str = ""  # the device under the netdev (a VF's PCI address), as the kernel reports it
    parent_bus: str = ""  # that device's bus ("pci")
    link_index: int = 0  # IFLA_LINK: a veth's peer, a VLAN's lower device (0: none)
    link_netnsid: int | None = None  # IFLA_LINK_NETNSID: the namespace of link_index, when not this one
    vfs: tuple[VfInfo, ...] | None = field(default=None, compare=False)


def _decode_vfs(msg: Any) -> tuple[VfInfo, ...] | None:
    vflist = msg.get("IFLA_VFINFO_LIST")
    if vflist is None:
        return None
    out = []
    for info in vflist.get_attrs("IFLA_VF_INFO"):
        mac = info.get("IFLA_VF_MAC")
        vlan = info.get("IFLA_VF_VLAN")
        rate = info.get("IFLA_VF_RATE")
        spoof = info.get("IFLA_VF_SPOOFCHK")
        trust = info.get("IFLA_VF_TRUST")
        state = info.get("IFLA_VF_LINK_STATE")
        index = (mac or vlan or rate or {"vf": len(out)})["vf"]
        out.append(
            VfInfo(
                vf=index,
                mac=mac["mac"] if mac else None,
                vlan=vlan["vlan"] if vlan else None,
                qos=vlan["qos"] if vlan else None,
                min_tx_rate=rate["min_tx_rate"] if rate else None,
                max_tx_rate=rate["max_tx_rate"] if rate else None,
                # The kernel reports -1 (as u32) for "not supported by the driver".
                spoofchk=bool(spoof["spoofchk"]) if spoof and spoof["spoofchk"] != 0xFFFFFFFF else None,
                trust=bool(trust["trust"]) if trust and trust["trust"] != 0xFFFFFFFF else None,
                link_state=LINK_STATE_NAMES.get(state["link_state"]) if state else None,
            )
        )
    return tuple(out)


def _to_link(msg: Any) -> Link:
    return Link(
        index=msg["index"],
        name=msg.get("IFLA_IFNAME") or "",
        mac=msg.get("IFLA_ADDRESS") or "",
        mtu=msg.get("IFLA_MTU") or 0,
        up=bool(msg["flags"] & IFF_UP),
        alias=msg.get("IFLA_IFALIAS") or "",
        parent_dev=msg.get("IFLA_PARENT_DEV_NAME") or "",
        parent_bus=msg.get("IFLA_PARENT_DEV_BUS_NAME") or "",
        link_index=msg.get("IFLA_LINK") or 0,
        link_netnsid=msg.get("IFLA_LINK_NETNSID"),
        vfs=_decode_vfs(msg),
    )


class Rtnl:
    """rtnetlink in one network namespace (``netns``: a path or fd; None = this process's)."""

    def __init__(self, netns: str | int | None = None) -> None:
        self._nl = NlSocket(socket.NETLINK_ROUTE, netns)

    def close(self) -> None:
        self._nl.close()

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- links ------------------------------------------------------------

    def get_link(
        self, *, name: str | None = None, index: int | None = None, vfs: bool = False
    ) -> Link | None:
        """One link by name or index, or None if it does not exist."""
        msg = _cls("ifinfmsg")()
        msg["family"] = socket.AF_UNSPEC
        attrs: list[Any] = []
        if index is not None:
            msg["index"] = index
        elif name is not None:
            attrs.append(("IFLA_IFNAME", name))
        if vfs:
            attrs.append(("IFLA_EXT_MASK", RTEXT_FILTER_VF))
        msg["attrs"] = attrs
        try:
            replies = self._nl.request(msg, RTM_GETLINK, NLM_F_REQUEST)
        except NetlinkError as exc:
            if exc.errno in (errno.ENODEV, errno.EINVAL):  # how the kernel says: no such link
                return None
            raise
        return _to_link(replies[0]) if replies else None

    def links(self) -> list[Link]:
        """Every link in the namespace."""
        msg = _cls("ifinfmsg")()
        msg["family"] = socket.AF_UNSPEC
        return [_to_link(m) for m in self._nl.request(msg, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP)]

    def nsid_of(self, netns_fd: int) -> int | None:
        """The id this namespace gives the namespace ``netns_fd`` (None when it has none)."""
        msg = _cls("nsidmsg")()
        msg["attrs"] = [("NETNSA_FD", netns_fd)]
        replies = self._nl.request(msg, RTM_GETNSID, NLM_F_REQUEST)
        nsid = replies[0].get("NETNSA_NSID") if replies else None
        # The kernel answers NETNSA_NSID_NOT_ASSIGNED (-1, as u32) for "no id yet".
        return None if nsid is None or nsid == 0xFFFFFFFF else int(nsid)

    def set_link(
        self,
        index: int,
        *,
        name: str | None = None,
        mtu: int | None = None,
        mac: str | None = None,
        alias: str | None = None,
        up: bool | None = None,
        netns_fd: int | None = None,
    ) -> None:
        """Change a link in one RTM_NEWLINK.

        With ``netns_fd`` the kernel moves the link first and applies the other
        attributes in the target namespace. Not atomically: when the link's
        current name is free in the target it is moved under that name and
        renamed afterwards, so a clash with ``name`` there (EEXIST) can leave
        it moved but not renamed; an undo finds it by kernel identity wherever
        it is, under whatever name (:mod:`rdma_cni.kernel.identity`).
        """
        msg = _cls("ifinfmsg")()
        msg["family"] = socket.AF_UNSPEC
        msg["index"] = index
        attrs: list[Any] = []
        if netns_fd is not None:
            attrs.append(("IFLA_NET_NS_FD", netns_fd))
        if name is not None:
            attrs.append(("IFLA_IFNAME", name))
        if mtu is not None:
            attrs.append(("IFLA_MTU", mtu))
        if mac is not None:
            attrs.append(("IFLA_ADDRESS", mac))
        if alias is not None:
            attrs.append(("IFLA_IFALIAS", alias))
        msg["attrs"] = attrs
        if up is not None:
            msg["flags"] = IFF_UP if up else 0
            msg["change"] = IFF_UP
        self._nl.request(msg, RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK)

    # -- PF-side VF settings ----------------------------------------------

    def set_vf(self, pf_index: int, vf: int, settings: dict[str, Any]) -> None:
        """Apply PF-side settings to VF ``vf`` in one IFLA_VFINFO_LIST.

        Keys: ``rate`` [min, max] (always sent together, as IFLA_VF_RATE),
        ``vlan`` [vlan, qos], ``mac``, ``spoofchk``, ``trust``, ``link_state``.
        """
        cfg: list[Any] = []
        if "mac" in settings:
            cfg.append(("IFLA_VF_MAC", {"vf": vf, "mac": settings["mac"]}))
        if "vlan" in settings:
            vlan, qos = settings["vlan"]
            cfg.append(("IFLA_VF_VLAN", {"vf": vf, "vlan": vlan, "qos": qos}))
        if "rate" in settings:
            lo, hi = settings["rate"]
            cfg.append(("IFLA_VF_RATE", {"vf": vf, "min_tx_rate": lo, "max_tx_rate": hi}))
        if "spoofchk" in settings:
            cfg.append(("IFLA_VF_SPOOFCHK", {"vf": vf, "spoofchk": int(bool(settings["spoofchk"]))}))
        if "trust" in settings:
            cfg.append(("IFLA_VF_TRUST", {"vf": vf, "trust": int(bool(settings["trust"]))}))
        if "link_state" in settings:
            cfg.append(("IFLA_VF_LINK_STATE", {"vf": vf, "link_state": LINK_STATES[settings["link_state"]]}))
        if not cfg:
            return
        msg = _cls("ifinfmsg")()
        msg["family"] = socket.AF_UNSPEC
        msg["index"] = pf_index
        msg["attrs"] = [("IFLA_VFINFO_LIST", {"attrs": [("IFLA_VF_INFO", {"attrs": cfg})]})]
        self._nl.request(msg, RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK)

    # -- addresses and routes -------------------------------------------

    def add_address(self, index: int, cidr: str) -> None:
        """Add an address (CIDR) to a link; an identical existing one is fine."""
        iface = ipaddress.ip_interface(cidr)
        msg = _cls("ifaddrmsg")()
        msg["family"] = socket.AF_INET6 if iface.version == 6 else socket.AF_INET
        msg["prefixlen"] = iface.network.prefixlen
        msg["index"] = index
        attrs: list[Any] = [("IFA_LOCAL", str(iface.ip)), ("IFA_ADDRESS", str(iface.ip))]
        if iface.version == 4:
            attrs.append(("IFA_BROADCAST", str(iface.network.broadcast_address)))
        msg["attrs"] = attrs
        try:
            self._nl.request(msg, RTM_NEWADDR, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)
        except NetlinkError as exc:
            if exc.errno != errno.EEXIST:
                raise

    def addresses(self, index: int) -> list[str]:
        """The link's addresses in CIDR form (link-local IPv6 excluded)."""
        out = []
        for family in (socket.AF_INET, socket.AF_INET6):
            msg = _cls("ifaddrmsg")()
            msg["family"] = family
            for reply in self._nl.request(msg, RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP):
                if reply["index"] != index:
                    continue
                addr = reply.get("IFA_ADDRESS") or reply.get("IFA_LOCAL")
                iface = ipaddress.ip_interface(f"{addr}/{reply['prefixlen']}")
                if iface.version == 6 and iface.ip.is_link_local:
                    continue
                out.append(str(iface))
        return out

    def add_route(
        self, index: int, dst: str, gw: str = "", priority: int | None = None, table: int | None = None
    ) -> bool:
        """Add a route through link ``index``. Returns False if an equal route already exists."""
        net = ipaddress.ip_network(dst, strict=False)
        msg = _cls("rtmsg")()
        msg["family"] = socket.AF_INET6 if net.version == 6 else socket.AF_INET
        msg["dst_len"] = net.prefixlen
        msg["table"] = table if table is not None and table < 256 else 254
        msg["proto"] = 3  # RTPROT_BOOT, as `ip route add` does
        msg["scope"] = 0 if gw else 253  # universe via a gateway, else link
        msg["type"] = 1  # RTN_UNICAST
        attrs: list[Any] = [("RTA_OIF", index)]
        if net.prefixlen:
            attrs.append(("RTA_DST", str(net.network_address)))
        if gw:
            attrs.append(("RTA_GATEWAY", gw))
        if priority is not None:
            attrs.append(("RTA_PRIORITY", priority))
        if table is not None and table >= 256:
            attrs.append(("RTA_TABLE", table))
        msg["attrs"] = attrs
        try:
            self._nl.request(msg, RTM_NEWROUTE, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)
        except NetlinkError as exc:
            if exc.errno == errno.EEXIST:
                return False
            raise
        return True

    def routes(self, index: int) -> list[tuple[str, str]]:
        """(dst CIDR, gateway) of the main-table routes through link ``index``."""
        out = []
        for family in (socket.AF_INET, socket.AF_INET6):
            msg = _cls("rtmsg")()
            msg["family"] = family
            for reply in self._nl.request(msg, RTM_GETROUTE, NLM_F_REQUEST | NLM_F_DUMP):
                if reply.get("RTA_OIF") != index or reply["table"] != 254:
                    continue
                dst = reply.get("RTA_DST")
                zero = "::" if family == socket.AF_INET6 else "0.0.0.0"
                out.append((f"{dst or zero}/{reply['dst_len']}", reply.get("RTA_GATEWAY") or ""))
        return out

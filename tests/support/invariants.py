"""The node's promises, checked from the kernel's view (the fault tier's oracle).

A simulated VF is one end of a veth pair whose other end, its "wire", never
leaves the host; the kernel reports a veth's peer, and a pod cannot forge
that. So a VF is wherever the netdev whose peer is its wire is, whatever the
netdev is called or labelled. Against that, the records, host-local's leases
and the host's own links are judged:

* every VF is in exactly one place: home in the host under its own name, or
  in one pod's namespace, listed by exactly one record naming that
  namespace (a VF at home listed by a record is held hostage);
* no VF is listed by two records;
* no lease is empty, and every lease belongs to a recorded attachment (or a
  remembered pending IPAM release);
* nothing of the host changed (links that are not test veths), and no decoy
  arrived under a simulated node's name.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from tests.support.hostview import changed_links, host_links


def _links(ns: str | None) -> list[dict[str, Any]]:
    cmd = ["ip", "-j", "-d", "link", "show"] if ns is None else ["ip", "-n", ns, "-j", "-d", "link", "show"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []


def locate_vfs(node: Any, namespaces: list[str]) -> dict[tuple[int, int], list[tuple[str, str]]]:
    """Where each VF of ``node`` is: ``[("host"|<netns name>, ifname), ...]`` (one place when sane)."""
    host = _links(None)
    wires = {node.vf_wire(k, i): (k, i) for k, i in node.all_vfs()}
    by_index = {link["ifindex"]: wires[link["ifname"]] for link in host if link["ifname"] in wires}
    found: dict[tuple[int, int], list[tuple[str, str]]] = {vf: [] for vf in node.all_vfs()}
    for link in host:
        if link.get("link") in wires and "link_netnsid" not in link and link["ifname"] not in wires:
            found[wires[link["link"]]].append(("host", link["ifname"]))
    for ns in namespaces:
        for link in _links(ns):
            if "link_netnsid" in link and link.get("link_index") in by_index:
                found[by_index[link["link_index"]]].append((ns, link["ifname"]))
    return found


def _records(state_dir: str) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    d = os.path.join(state_dir, "attachments")
    out, bad = [], []
    if not os.path.isdir(d):
        return out, bad
    for name in sorted(os.listdir(d)):
        if not name.endswith(".json") or "@" not in name or name.startswith("."):
            continue
        try:
            with open(os.path.join(d, name)) as f:
                out.append((name, json.load(f)))
        except (OSError, ValueError):
            bad.append(name)
    return out, bad


def _pending_network(state_dir: str, name: str) -> str | None:
    """The network a pending release belongs to (None when unreadable)."""
    try:
        with open(os.path.join(state_dir, "ipam-pending", name)) as f:
            network = json.load(f).get("network")
    except (OSError, ValueError, AttributeError):
        return None
    return network if isinstance(network, str) else None


def pending_releases(state_dir: str) -> list[str]:
    """The IPAM releases the plugin still keeps pending (rdma_cni.node.ipam_pending), by file name."""
    d = os.path.join(state_dir, "ipam-pending")
    return (
        sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith("."))
        if os.path.isdir(d)
        else []
    )


def violations(
    cluster: Any,
    namespaces: list[str],
    host_before: dict[str, tuple[Any, ...]],
    *,
    settled: bool,
) -> list[str]:
    """Every broken promise on ``cluster``'s node; ``settled``: every pod was DELeted, nothing may be held."""
    node = cluster.node
    problems: list[str] = []
    records, unreadable = _records(cluster.state_dir)
    problems += [f"record {n} is unreadable yet not set aside" for n in unreadable]
    if settled and records:
        problems.append(f"records remain after every DEL: {[n for n, _ in records]}")
    owners: dict[str, list[tuple[str, str]]] = {}
    for name, rec in records:
        for vf in rec.get("vfs", []):
            owners.setdefault(vf.get("pci", ""), []).append((name, rec.get("netns", "")))
    for (k, i), places in locate_vfs(node, namespaces).items():
        pci = node.vf_pci(k, i)
        held = owners.get(pci, [])
        if len(held) > 1:
            problems.append(f"VF {pci} is listed by {len(held)} records: {[h[0] for h in held]}")
        if len(places) != 1:
            problems.append(f"VF {pci} is in {len(places)} places: {places}")
            continue
        where, ifname = places[0]
        if where == "host":
            if ifname != node.vf_netdev(k, i):
                problems.append(
                    f"VF {pci} is in the host as {ifname}, not under its name {node.vf_netdev(k, i)}"
                )
            if held and settled:
                problems.append(f"VF {pci} is at home but still held by record {held[0][0]}")
        elif settled:
            problems.append(f"VF {pci} is still in pod {where} as {ifname} after every DEL")
        elif len(held) != 1 or os.path.basename(held[0][1]) != where:
            problems.append(
                f"VF {pci} is in pod {where} as {ifname} without exactly one record naming it ({held})"
            )
    # Decoys: a host veth under this node's prefix that is neither a wire nor a VF at home.
    names = {node.vf_wire(k, i) for k, i in node.all_vfs()} | {
        node.vf_netdev(k, i) for k, i in node.all_vfs()
    }
    for link in _links(None):
        if link["ifname"].startswith(node.prefix) and link["ifname"] not in names:
            problems.append(f"unknown link {link['ifname']} in the host under the node's prefix (a decoy?)")
    # Leases.
    attached = {
        (rec.get("container_id"), vf.get("pod_name")) for _, rec in records for vf in rec.get("vfs", [])
    }
    attached |= {(rec.get("container_id"), rec.get("ifname")) for _, rec in records}
    pending = pending_releases(cluster.state_dir)
    pending_ids = {p.split("@")[0] for p in pending}
    lease_dir = os.path.join(cluster.tmp, "ipam", "rdma-net")
    for lease in sorted(os.listdir(lease_dir)) if os.path.isdir(lease_dir) else []:
        if not lease[0].isdigit() or lease.startswith("last_reserved_ip"):
            continue
        with open(os.path.join(lease_dir, lease)) as f:
            lines = f.read().split()
        if not lines:
            problems.append(f"lease {lease} is empty (an IPAM write was cut)")
            continue
        holder = (lines[0], lines[1] if len(lines) > 1 else "")
        if holder not in attached and (settled or holder[0] not in pending_ids):
            problems.append(f"lease {lease} of {holder} belongs to no attachment")
    # A release of the cluster's own network (whose IPAM config works) must be finished by the
    # runtime's DELs and GC. A fuzzed network whose IPAM config host-local refuses keeps its
    # release pending, remembered and reported, until an operator fixes that config: by design.
    ours = [p for p in pending if _pending_network(cluster.state_dir, p) in (None, "rdma-net")]
    if settled and ours:
        problems.append(f"IPAM releases still pending after every DEL: {ours}")
    problems += changed_links(host_before, host_links(node.prefix + "\0"))  # the host's own links only
    return problems

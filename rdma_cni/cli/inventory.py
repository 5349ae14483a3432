"""``rdma-cni inventory``: print the node's SR-IOV and RDMA state as JSON, for operators."""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from rdma_cni.cni.errors import CniError
from rdma_cni.launch.startup import quiet_pydantic


def _rdma_view(node_doc: dict[str, Any]) -> None:
    """Add the RDMA netns mode and, per VF device, where the device is now."""
    from rdma_cni.kernel import rdma

    try:
        with rdma.RdmaClient() as client:
            node_doc["rdma_netns_mode"] = client.netns_mode()
            in_host = {d.name for d in client.list_devices()}
    except rdma.NetlinkError as exc:
        node_doc["rdma_netns_mode"] = None
        node_doc["rdma_error"] = str(exc)
        in_host = None
    for pf in node_doc["pfs"]:
        for vf in pf["vfs"]:
            owner = vf.get("owner") or {}
            devices = list(vf["rdma_devices"])
            if owner.get("rdma_device") and owner["rdma_device"] not in devices:
                # A device moved into a pod is gone from the host's sysfs; the record names it.
                devices.append(owner["rdma_device"])
            vf["rdma"] = []
            for dev in devices:
                if in_host is None:
                    where = "unknown"
                elif dev in in_host:
                    where = "host"
                else:
                    where = "pod" if owner.get("rdma") == "moved" else "absent"
                vf["rdma"].append({"device": dev, "netns": where})


def main(argv: list[str], out: TextIO) -> int:
    """Entry point of ``rdma-cni inventory``."""
    parser = argparse.ArgumentParser(prog="rdma-cni inventory", description=__doc__)
    parser.add_argument("--pretty", action="store_true", help="indent the JSON for humans")
    parser.add_argument(
        "--config", help="a network config (JSON) whose pfs, capacityMbps and stateDir to use"
    )
    args = parser.parse_args(argv)
    quiet_pydantic()
    try:
        doc = _collect(args.config)
    except CniError as exc:
        out.write(json.dumps({"error": exc.msg, "code": exc.code, "details": exc.details}) + "\n")
        return 1
    out.write(json.dumps(doc, indent=2 if args.pretty else None, sort_keys=args.pretty) + "\n")
    return 0


def _collect(config_path: str | None) -> dict[str, Any]:
    from rdma_cni.cni.config import DEFAULT_STATE_DIR, load_netconf
    from rdma_cni.cni.protocol import decode_stdin
    from rdma_cni.kernel.identity import VfFinder
    from rdma_cni.kernel.netlink import Rtnl
    from rdma_cni.kernel.vfcontrol import vf_control
    from rdma_cni.node.inventory import report, scan
    from rdma_cni.node.prepared import holdings
    from rdma_cni.node.record import RecordStore

    pfs: list[str] | None = None
    capacity: dict[str, int] = {}
    state_dir = DEFAULT_STATE_DIR
    if config_path:
        try:
            with open(config_path, "rb") as f:
                conf = load_netconf(decode_stdin(f.read()))
        except OSError as exc:
            raise CniError(f"cannot read --config {config_path}: {exc.strerror}") from exc
        pfs, capacity, state_dir = conf.pfs, dict(conf.capacityMbps), conf.stateDir
    # Read as ADD reads the node: an unreadable record holds nothing (it is
    # reported, not set aside: inventory changes nothing), and a VF no record
    # holds is free only when the kernel proves it home in the host.
    unreadable: list[str] = []
    attachments = RecordStore(state_dir).all(unreadable)
    try:
        # DRA preparations hold their VFs too (node/prepared); first, so that an attached VF shows its
        # attachment as owner.
        attachments = holdings(state_dir) + attachments
    except CniError as exc:
        unreadable.append(exc.msg)
    with Rtnl() as host:
        node = scan(
            pfs=pfs,
            capacity=capacity,
            attachments=attachments,
            vfctl=vf_control(host),
            home=VfFinder(host).in_host,
        )
    doc = report(node)
    if unreadable:
        doc["unreadable_records"] = unreadable
    _rdma_view(doc)
    return doc

"""STATUS: can this node serve an ADD right now?

A corrupt record, a record set aside, or a pending IPAM release does not stop
the node (ADD sets corrupt records aside and judges their VFs from the
kernel's view): STATUS still succeeds, and says so in its log as a warning.
It fails (50) only when nothing can be served: no usable state directory, no
SR-IOV PF, or an IPAM plugin that reports itself unavailable.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rdma_cni.cni.config import NetConf
from rdma_cni.cni.errors import CniError, PluginUnavailable
from rdma_cni.cni.protocol import CniEnv
from rdma_cni.node.inventory import scan
from rdma_cni.node.ipam_pending import PendingStore
from rdma_cni.node.record import RecordStore
from rdma_cni.verbs.common import ipam_for

log = logging.getLogger("rdma_cni.status")


def run(env: CniEnv, conf: NetConf, doc: dict[str, Any]) -> None:
    """Raises code 50 with the reason when ADD could not be served."""
    store = RecordStore(conf.stateDir)
    try:
        store.ensure()
        if not os.access(store.dir, os.W_OK):
            raise PluginUnavailable(f"state directory {store.dir} is not writable")
        corrupt: list[str] = []
        attachments = store.all(corrupt)
        node = scan(pfs=conf.pfs, capacity=conf.capacityMbps, attachments=attachments, vfctl=None)
        if not node.pfs:
            which = f"among pfs {', '.join(conf.pfs)}" if conf.pfs else "on this node"
            raise PluginUnavailable(f"no SR-IOV PF with VFs enabled {which}")
        ipam = ipam_for(conf, doc, env)
        if ipam is not None:
            ipam.status()
        report_degraded(corrupt, store.quarantined(), PendingStore(conf.stateDir).count())
        report_nri(conf.lockFile)
    except PluginUnavailable:
        raise
    except CniError as exc:
        raise PluginUnavailable(f"rdma-cni cannot serve ADD: {exc.msg}", exc.details) from exc
    return None


def report_degraded(corrupt: list[str], set_aside: list[str], pending: int) -> None:
    """Warn about what needs an operator although ADD can still be served."""
    if corrupt:
        log.warning(
            "%d corrupt allocation record(s), set aside by the next ADD, DEL or GC; their VFs count as held "
            "until the kernel shows them home: %s",
            len(corrupt),
            " | ".join(corrupt),
        )
    if set_aside:
        log.warning(
            "%d record(s) set aside in the quarantine directory for an operator to inspect: %s",
            len(set_aside),
            ", ".join(set_aside),
        )
    if pending:
        log.warning(
            "%d attachment(s) have an IPAM release pending (IPAM DEL failed); DEL and GC retry them",
            pending,
        )


def report_nri(lock_file: str) -> None:
    """Warn when the node agent's NRI plugin injects no RDMA devices into pods (STATUS still succeeds)."""
    from rdma_cni.node.nristate import REGISTERED, read_state

    state = read_state(lock_file)
    if state is not None and state != REGISTERED:
        log.warning(
            "pods get no RDMA character devices from rdma-cni: the node agent's NRI plugin is %s", state
        )

"""STATUS: can this node serve an ADD right now?"""

from __future__ import annotations

import os
from typing import Any

from rdma_cni.commands.common import ipam_for
from rdma_cni.config import NetConf
from rdma_cni.errors import CniError, PluginUnavailable
from rdma_cni.inventory import scan
from rdma_cni.protocol import CniEnv
from rdma_cni.record import RecordStore


def run(env: CniEnv, conf: NetConf, doc: dict[str, Any]) -> None:
    """Raises code 50 with the reason when ADD could not be served."""
    store = RecordStore(conf.stateDir)
    try:
        store.ensure()
        if not os.access(store.dir, os.W_OK):
            raise PluginUnavailable(f"state directory {store.dir} is not writable")
        attachments = store.all()
        node = scan(pfs=conf.pfs, capacity=conf.capacityMbps, attachments=attachments, vfctl=None)
        if not node.pfs:
            which = f"among pfs {', '.join(conf.pfs)}" if conf.pfs else "on this node"
            raise PluginUnavailable(f"no SR-IOV PF with VFs enabled {which}")
        ipam = ipam_for(conf, doc, env)
        if ipam is not None:
            ipam.status()
    except PluginUnavailable:
        raise
    except CniError as exc:
        raise PluginUnavailable(f"rdma-cni cannot serve ADD: {exc.msg}", exc.details) from exc
    return None

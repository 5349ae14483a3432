"""The CNI verbs that need a full configuration: one module each, one flow each."""

from __future__ import annotations

import logging
from importlib import import_module
from typing import TYPE_CHECKING, Any

from rdma_cni.cni.protocol import CniEnv

if TYPE_CHECKING:
    from rdma_cni.cni.config import NetConf

_MODULES = {"ADD": "add", "DEL": "delete", "CHECK": "check", "STATUS": "status", "GC": "gc"}


def dispatch(env: CniEnv, doc: dict[str, Any]) -> dict[str, Any] | None:
    """Validate the config, set up logging, and run the verb; returns the document to print, if any."""
    from rdma_cni.launch.startup import defer_unused

    defer_unused()
    from rdma_cni.cni.config import load_netconf
    from rdma_cni.log import configure
    from rdma_cni.node import ipam

    conf = load_netconf(doc)
    configure(conf.logFile, conf.logLevel, f"{env.command} {env.container_id}/{env.ifname}")
    _previous_boot(env, conf, doc)
    ipam.start_verb()
    module = import_module(f"rdma_cni.verbs.{_MODULES[env.command]}")
    return module.run(env, conf, doc)


def _previous_boot(env: CniEnv, conf: NetConf, doc: dict[str, Any]) -> None:
    """Release the records of an earlier boot before the verb, if this boot's first verb (any verb).

    Every verb, so that the first one after a boot does it: on a node with a
    CNI 1.1 runtime that is its periodic STATUS, else the first DEL or ADD.
    After that, two small reads (:func:`rdma_cni.node.boot.checked`). It never
    fails the verb: what it could not do is logged, and the next verb tries again.
    """
    from rdma_cni.node import boot

    if boot.checked(conf.stateDir, boot.boot_id()):
        return
    from rdma_cni.cni.errors import CniError
    from rdma_cni.verbs.gc import OwnNetwork, release_previous_boot

    try:
        release_previous_boot(
            conf.stateDir, conf.lockFile, conf.lockTimeoutSeconds, own=OwnNetwork(conf, doc, env)
        )
    except CniError as exc:
        logging.getLogger("rdma_cni.gc").error(
            "records of earlier boots not released: %s%s", exc.msg, f" ({exc.details})" if exc.details else ""
        )

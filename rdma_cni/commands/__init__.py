"""The CNI verbs that need a full configuration: one module each, one flow each."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from rdma_cni.cni.protocol import CniEnv

_MODULES = {"ADD": "add", "DEL": "delete", "CHECK": "check", "STATUS": "status", "GC": "gc"}


def dispatch(env: CniEnv, doc: dict[str, Any]) -> dict[str, Any] | None:
    """Validate the config, set up logging, and run the verb; returns the document to print, if any."""
    from rdma_cni.startup import defer_unused

    defer_unused()
    from rdma_cni.cni.config import load_netconf
    from rdma_cni.log import configure
    from rdma_cni.node import ipam

    conf = load_netconf(doc)
    configure(conf.logFile, conf.logLevel, f"{env.command} {env.container_id}/{env.ifname}")
    ipam.start_verb()
    module = import_module(f"rdma_cni.commands.{_MODULES[env.command]}")
    return module.run(env, conf, doc)

"""The DRA side of the node agent, as the agent's loop drives it.

Built when the agent is given DRA networks (``"dra": true``): each pass of
the agent's loop that reads the node (a record or preparation changed, or
the period passed) also reads the DRA networks' devices
(:func:`.devices.read_devices`) and offers them to the slice publisher; each
tick lets the publisher write. The kubelet plugin (:mod:`.kubelet`) serves
in threads of grpcio's own, from :meth:`DraAgent.start` until the agent stops.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rdma_cni.agent.dra.devices import read_devices
from rdma_cni.agent.dra.prepare import Preparer
from rdma_cni.agent.dra.publish import SlicePublisher
from rdma_cni.agent.snapshot import NetworkView
from rdma_cni.cni.errors import CniError, IOFailure, TryAgainLater

if TYPE_CHECKING:
    from rdma_cni.agent.dra.kubelet import KubeletPlugin
    from rdma_cni.kube.client import ApiClient

log = logging.getLogger("rdma_cni.agent")

__all__ = ["DraAgent"]


class DraAgent:
    """Slices of the node's DRA networks, and the kubelet plugin that prepares their claims."""

    def __init__(
        self,
        views: Sequence[NetworkView],
        node: str,
        client: Callable[[], ApiClient],
        *,
        registry_dir: str | None = None,
        plugin_dir: str | None = None,
    ) -> None:
        self.views = [v for v in views if v.dra]
        self.node = node
        self.publisher = SlicePublisher(client, node)
        self.preparer = Preparer(self.views, node, client)
        self.registry_dir = registry_dir
        self.plugin_dir = plugin_dir
        self.plugin: KubeletPlugin | None = None
        self.refreshes = 0
        self.refresh_errors = 0

    @property
    def directories(self) -> list[str]:
        """What a change of shows in: each network's records and preparations."""
        return sorted(
            {os.path.join(v.state_dir, sub) for v in self.views for sub in ("attachments", "prepared")}
        )

    def refresh(self) -> bool:
        """Read the devices and offer them for publishing; False when the read must be retried soon."""
        try:
            devices = read_devices(self.views)
        except TryAgainLater as exc:
            log.info("DRA devices: %s; retrying", exc.msg)
            self.refresh_errors += 1
            return False
        except IOFailure as exc:
            # A record or preparation nobody can read: what the node may promise is unknown, so nothing.
            log.error("DRA devices: %s; publishing no devices until it is fixed", exc.msg)
            self.refresh_errors += 1
            self.publisher.offer([])
            return False
        except (CniError, OSError) as exc:
            log.error("DRA devices: cannot read the node: %s; retrying", getattr(exc, "msg", exc))
            self.refresh_errors += 1
            return False
        self.refreshes += 1
        self.publisher.offer(devices)
        return True

    def step(self) -> None:
        """Let the publisher write what is pending."""
        self.publisher.step()

    def start(self, stop: threading.Event) -> None:
        """Serve kubelet (when given its directories) until ``stop``; OSError/RuntimeError if it cannot."""
        if self.registry_dir is None or self.plugin_dir is None:
            log.info("DRA: no kubelet plugin (no --kubelet-registry-dir): claims are not prepared here")
            return
        from rdma_cni.agent.dra.kubelet import KubeletPlugin

        self.plugin = KubeletPlugin(self.preparer, registry_dir=self.registry_dir, plugin_dir=self.plugin_dir)
        self.plugin.start()
        plugin = self.plugin

        def stopper() -> None:
            stop.wait()
            plugin.stop()

        threading.Thread(target=stopper, name="dra-plugin-stop", daemon=True).start()

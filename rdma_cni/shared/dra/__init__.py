"""rdma-cni as a DRA driver: the names both halves share (driver, device class, capacities, attributes).

Dynamic Resource Allocation (``resource.k8s.io/v1``) is the other path to a
node's VFs beside the scheduler extender (docs/dra.md): the node agent
publishes the PFs of its DRA networks as ResourceSlices (:mod:`.slices`),
kube-scheduler's allocator hands claims parts of their bandwidth (consumable
capacity, KEP-5075), and the node agent's kubelet plugin proves and prepares
each allocation before the CNI ADD applies it. ``rdma-cni claim`` renders a
pod's annotation as the ResourceClaimTemplate asking for the same
(:mod:`.claims`). Standard library only, but for :mod:`.claims`, which
validates with pydantic as the annotation's parser does.
"""

from __future__ import annotations

__all__ = [
    "ATTR_LINK_SPEED",
    "ATTR_MAX_TX_RATE",
    "ATTR_NETWORK",
    "ATTR_PF",
    "ATTR_RAIL",
    "BANDWIDTH",
    "DEVICE_CLASS",
    "DRIVER",
    "NUMA_NODE",
    "PCIE_ROOT",
    "RESOURCE_API",
    "VFS",
]

# The driver's name: a DNS subdomain of ours, and the domain of its attributes and capacities.
DRIVER = "rdma-cni.io"
# conf/dra.yaml's DeviceClass, which selects this driver's devices; claims name it.
DEVICE_CLASS = "vf.rdma-cni.io"
RESOURCE_API = "resource.k8s.io/v1"

# Capacities, in the driver's domain (published unqualified, so claims request them by these names).
# Mbit/s, the unit of the annotation's rates and of `ip link set vf rate`; a request consumes its
# min_tx_rate (the requestPolicy's default is 0: an interface without a guarantee consumes none).
BANDWIDTH = "bandwidth"
# VFs: every allocation consumes exactly one (requestPolicy default 1, the only valid value).
VFS = "vfs"

# Attributes of ours (unqualified: the driver's domain). The network and PF are the device's
# identity on the node; rail is the operator's label from the network's pfs entries.
ATTR_NETWORK = "network"
ATTR_PF = "pf"
ATTR_RAIL = "rail"
# The link's speed in Mbit/s, as sysfs reports it (absent when unknown).
ATTR_LINK_SPEED = "linkSpeed"
# The largest max_tx_rate a VF here may get: the PF's capacity as placement counts it (capacityMbps,
# else the link speed); absent when unknown, where placement allows any cap.
ATTR_MAX_TX_RATE = "maxTxRate"

# Kubernetes' standard attributes (k8s.io/dynamic-resource-allocation/deviceattribute): the PCIe root
# complex as "pci<domain>:<bus>", which a claim matches against another driver's devices (GPUs) with
# a matchAttribute constraint; and the NUMA node, left out when the platform reports none (-1).
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"

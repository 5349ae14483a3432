"""The typed CNI errors, under the CNI edge's name: they are defined in :mod:`rdma_cni.shared.errors`.

The classes and their codes live one layer down so that ``shared/`` (the pod
request parser) can raise them without importing ``cni/``; this module keeps
the name every caller on the node side knows.
"""

from __future__ import annotations

from rdma_cni.shared.errors import (
    CheckFailed,
    CniError,
    DecodeFailure,
    GarbageCollectionFailed,
    IncompatibleVersion,
    InternalError,
    InvalidConfig,
    InvalidEnvironment,
    InvalidPodRequest,
    IOFailure,
    IpamError,
    KernelError,
    KubernetesError,
    NoCapacity,
    PluginUnavailable,
    RdmaError,
    StateError,
    TryAgainLater,
    UnknownContainer,
    UnsupportedField,
)

__all__ = [
    "CheckFailed",
    "CniError",
    "DecodeFailure",
    "GarbageCollectionFailed",
    "IOFailure",
    "IncompatibleVersion",
    "InternalError",
    "InvalidConfig",
    "InvalidEnvironment",
    "InvalidPodRequest",
    "IpamError",
    "KernelError",
    "KubernetesError",
    "NoCapacity",
    "PluginUnavailable",
    "RdmaError",
    "StateError",
    "TryAgainLater",
    "UnknownContainer",
    "UnsupportedField",
]

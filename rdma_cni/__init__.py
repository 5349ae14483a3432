"""rdma-cni: a CNI plugin that gives pods SR-IOV VFs with their RDMA devices.

Kept empty of imports on purpose: kubelet runs the binary for every pod, and
each verb imports only what it needs.
"""

__version__ = "0.1.0"

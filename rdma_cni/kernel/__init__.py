"""The kernel layer: netlink (rtnetlink and RDMA), namespaces, sysfs, VF identity, PF-side VF settings."""

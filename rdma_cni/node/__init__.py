"""Node logic: the inventory of PFs and VFs, attaching and releasing, RDMA isolation, records, IPAM."""

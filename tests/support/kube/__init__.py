"""The real control plane for the cluster tier: certificates, processes, conf/ applied, rdma-scheduler."""

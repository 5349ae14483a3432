"""The real Kubernetes control plane for the cluster tier: certificates, processes, conf/ applied, rdma-scheduler."""

"""A real node for the node tier: kubelet and containerd 2.x in a mount namespace of the tier's own."""

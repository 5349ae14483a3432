"""The node agent: publishes this node's RDMA state on its Node object.

Node side only (it reads the kernel and the allocation records); the cluster
side (:mod:`rdma_cni.extender`) reads what it publishes and never imports it.
``snapshot`` computes the state with the plugin's own inventory and record
code, ``publish`` writes it to the API server when it changed, ``loop`` ties
them to record changes and a period.
"""

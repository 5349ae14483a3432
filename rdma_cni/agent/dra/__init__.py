"""The node agent's DRA side: the ResourceSlices of the node's DRA networks and the kubelet plugin.

docs/dra.md says when to use it: ``devices`` reads what each DRA network may
promise (under the node lock, as ADD reads the node), ``publish`` keeps the
node's ResourceSlices equal to it, ``prepare`` proves a claim's allocation
against the node and records the VFs it chose (node/prepared), ``kubelet``
serves kubelet's DRA gRPC service (v1) and plugin registration over it, and
``service`` wires them into the agent's loop.
"""

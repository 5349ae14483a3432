"""The node agent's NRI plugin: each pod's own RDMA character devices, injected at CreateContainer.

Protocol: NRI's api.proto (containerd/nri ``pkg/api``) over ttrpc over NRI's
connection multiplexer, all on one unix socket. Only the few messages the
plugin handles are coded, by hand (:mod:`.pb`), so that google.protobuf stays
out of the executable the CNI plugin's cold start loads.
"""

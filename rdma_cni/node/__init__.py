"""Node logic: the inventory of PFs and VFs, attaching and releasing, RDMA isolation, records, IPAM.

``attach`` (the steps and the loops over them) acts through ``vfnetdev`` (a VF
netdev's kernel operations); ``ipam`` delegates to the IPAM plugin, each exec
under ``ipam_guard``'s guard process.
"""

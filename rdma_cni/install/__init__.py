"""``rdma-cni install``: the DaemonSet container's entry point.

It puts the plugin where kubelet's container runtime looks for it and gives
the plugin credentials to read pods:

- copies the executable into the host's CNI bin directory, atomically, so a
  runtime never executes a half-written file, and without clobbering a file
  it did not install itself (a sidecar marker remembers what it wrote);
- writes a JSON kubeconfig built from the pod's service account, with the
  token and CA embedded inline, because the secret's mount path exists only
  inside this container and not on the host where the plugin runs;
- optionally drops a network configuration into the CNI conf directory;
- with ``--watch``, keeps the kubeconfig in step with the token file, which
  kubelet rotates, until SIGTERM;
- with ``--watch --node-state``, also runs the node agent
  (:mod:`rdma_cni.agent`) in a thread: it publishes this node's RDMA state
  on its Node object for the scheduler extender.

- with ``--mode shim``, installs the static shim instead of the whole plugin
  and, with ``--watch``, serves the shim's calls (:mod:`rdma_cni.agent.cniserver`,
  which runs each verb as the plugin, a process per verb).

Standard library only: the installer must not pay for pydantic or requests
(the node agent imports them when it is switched on), and apart from the CNI
server's verbs it never starts another process.

The parts, one module each: :mod:`.command` (options, the install pass,
``--watch``, the agent thread), :mod:`.binary` (the executable and its
marker), :mod:`.kubeconfig` (rendered from the service account),
:mod:`.netconf` (the optional network configuration) and :mod:`.common`
(defaults, :class:`~.common.Options`, :class:`~.common.InstallError`, atomic
writes).
"""

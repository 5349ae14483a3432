"""The scheduler extender: kube-scheduler's filter, prioritize, preempt and bind verbs over HTTP.

Cluster side only: it reads node state from Node annotations (``rdma_cni.shared.nodestate``)
and shares placement with the plugin (``rdma_cni.shared.placement``), and never imports
the kernel layer. Modules: ``wire`` (the extender/v1 JSON), ``decide`` (pure
verdicts and scores), ``rules`` (the per-node admission rules), ``cache`` (node states
from a list + watch), ``reservations`` (pods bound but not yet published), ``bind``,
``preempt``, ``verbs`` (the four verbs on decoded documents), ``server`` (the HTTP reader
and its limits), ``listener`` (who may call), ``service`` (the parts wired together),
``options`` and ``main`` (the subcommand).
"""

"""The executable's entry points: the dispatcher (``main``) and the operator subcommands it runs.

``main`` reads a CNI verb from the environment or an operator subcommand from
argv and dispatches to every half (``verbs/``, ``agent/``, ``extender/``,
``install/``, ``launch/``), by design. ``inventory``, ``doctor`` and ``nodes``
are ``rdma-cni inventory``, ``doctor`` and ``nodes``. Kept empty: a CNI verb
imports this package on every cold start.
"""

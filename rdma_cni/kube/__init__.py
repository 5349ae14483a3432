"""Kubernetes API clients: the plugin's pod GET and the long-running client of the agent and the extender.

``credentials`` (kubeconfig or service account, redaction), ``tls`` (client TLS
and a warm server's context cache), ``status`` (the one status classifier),
``podget`` (the plugin's pod GET), ``client`` and ``pool`` (the long-running
client and its keep-alive connections), ``events`` (Events, queued).
"""

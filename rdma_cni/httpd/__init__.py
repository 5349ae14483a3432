"""The small HTTP serving the extender and both ``/metrics`` pages share (not the standard library's http).

``serve`` (the bounded HTTP/1.1 listener), ``head`` (a request's head, read by
h11), ``metricspage`` (``GET /metrics`` on that listener), ``exporter`` (what
the agent's and the extender's ``/metrics`` share). Never imported by a CNI verb.
"""

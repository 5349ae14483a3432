"""Kubernetes API clients: the plugin's pod GET and the long-running client of the agent and the extender."""

"""The CNI edge: the wire protocol, the network configuration, and the typed errors mapped to CNI codes."""

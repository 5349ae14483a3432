"""Pure modules both halves share: the placement algorithm, the node-state contract, the pod request."""

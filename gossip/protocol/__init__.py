"""The membership protocol, sans-IO: member table, control plane, detectors (SWIM), joins, the peer's life."""

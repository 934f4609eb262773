"""What a peer fails with."""

from __future__ import annotations

__all__ = ["PeerError"]


class PeerError(RuntimeError):
    """The node cannot take part (e.g. every peer runs a different model)."""

"""``gossip-node`` for a node of any size: one process, or a group of K under torchrun.

Three ways to start the same member:

- ``gossip-node --listen tcp://H:P ...``: one process, a group of one.
- ``gossip-node --nproc-per-node K --intra ddp|fsdp --listen tcp://H:P ...``: starts
  torchrun's elastic launcher for you, with K workers each running this module
  (``--max-restarts N``: a group whose rank died starts again, as a new life).
- ``torchrun --nproc-per-node K -m gossip.node --intra ddp|fsdp --listen tcp://H:P ...``:
  the same under a launcher of your own.

Every flag, TOML key, discovery option, checkpoint, output and signal behaves as
for a single node. The group's member id is ``H:P`` (rank 0's address); rank r
listens on ``H:P+r``. Rank 0 runs the member's protocol (:class:`~gossip.peer.group.GroupLeader`),
the other ranks follow it (:class:`~gossip.peer.group.GroupFollower`); the local
steps are the group's own collectives (DDP or FSDP).
"""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gossip.node`` (torchrun's workers run this): ``gossip-node``'s own main."""
    from gossip.cli import node_main

    return node_main(argv)


if __name__ == "__main__":
    sys.exit(main())

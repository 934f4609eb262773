"""Where a training loop of the user's own is in its data, on the cluster's clock.

Every member of a cluster that trains on equal shards (:class:`~gossip.training.sampler.ShardSampler`)
must read the same epoch at the same step, and the shards of one epoch must not
overlap. So an epoch's data is shared among the members of the round the epoch
begins in (the member list every member derives from the same schedule), and an
epoch is as long as one of those shards takes. When members change, the next
epoch is shared anew; within an epoch shards never move:

- a member that restarts in the middle of an epoch takes its own shard again
  and leaves out the batches of it the cluster has done;
- a node new to the cluster (not among the epoch's members) has no shard in that
  epoch: it takes part in the rounds without training until the epoch ends (then
  its loop runs that epoch's body over no batches, so that evaluations, collectives
  and a scheduler's step stay in step with the others), and has its own share from
  the next one;
- a member that left leaves the rest of its shard of that epoch untrained.

An :class:`EpochPlan` travels with a joiner's state and in checkpoints; a node
that was away for a while rolls it forward over the epochs that ended meanwhile
(:func:`roll_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["EpochPlan", "roll_forward"]


@dataclass(frozen=True)
class EpochPlan:
    """The cluster's current epoch: which of the loop's epochs (``index``, from 0), the
    cluster step it began at (its first batch is that step + 1), and the members that
    share its data (in member-list order; a member's shard is its place in it)."""

    index: int
    start: int
    members: tuple[str, ...]

    def to_list(self) -> list[Any]:
        """The plan as it travels (JSON)."""
        return [self.index, self.start, list(self.members)]

    @classmethod
    def from_list(cls, value: Any) -> "EpochPlan | None":
        """The plan a peer (or a checkpoint) sent, or None when it is malformed.

        >>> EpochPlan.from_list([2, 40, ["a:1", "b:2"]])
        EpochPlan(index=2, start=40, members=('a:1', 'b:2'))
        >>> EpochPlan.from_list([2, -1, []]) is None
        True
        """
        if not (isinstance(value, list) and len(value) == 3):
            return None
        index, start, members = value
        if not (type(index) is int and type(start) is int and index >= 0 and start >= 0 and isinstance(members, list)
                and members and len(members) <= 65536 and all(isinstance(m, str) and m for m in members)):
            return None
        return cls(index, start, tuple(members))

    def shard_of(self, node_id: str) -> tuple[int, int] | None:
        """``(rank, world_size)`` of ``node_id`` in this epoch, None if it has no shard."""
        if node_id not in self.members:
            return None
        return self.members.index(node_id), len(self.members)


def roll_forward(plan: EpochPlan, step: int, steps_of: Callable[[int], int],
                 members_at: Callable[[int], list[str]]) -> EpochPlan:
    """The epoch the cluster is in at ``step``: ``plan``, or one after it when
    epochs ended in between. ``steps_of(world_size)`` is an epoch's length for
    shards among that many members; ``members_at(step)`` the members sharing an
    epoch that begins at ``step``.

    >>> p = roll_forward(EpochPlan(0, 0, ("a", "b")), 25, lambda w: 20 // w, lambda s: ["a", "b", "c"])
    >>> p  # epochs of 10 steps (2 members), then of 6 (3): 0-10, 10-16, 16-22, 22-28
    EpochPlan(index=3, start=22, members=('a', 'b', 'c'))
    """
    while True:
        length = steps_of(len(plan.members))
        if length < 1:
            raise ValueError(f"an epoch must be at least one step long, got {length}")
        if step < plan.start + length:
            return plan
        end = plan.start + length
        plan = EpochPlan(plan.index + 1, end, tuple(members_at(end)))

"""The collectives across members for a group under torchrun (:class:`~gossip.groups.user_loop.GroupNode`):
``average``, ``all_gather`` and ``barrier`` on every rank of every member.

A group is one member, and only its rank 0 speaks for it. Each collective runs in three parts:

1. **Inside the group**, a torch.distributed collective over the group's K ranks: the
   weighted sums summed (``average``), every rank's value gathered (``all_gather``), or
   an all-reduce as a barrier. The ranks step together (DDP's or FSDP's collectives), so
   they reach it together.
2. **Across members**, rank 0 alone takes part in the members' collective of
   :class:`gossip.peer.collectives.Collectives`, exactly as a single-process member does:
   the same "average" messages, numbered alike (a joining group takes the count with its
   shard), waiting for each live member at most ``max(join_timeout, timeout)`` seconds and
   going on without one that sent nothing.
3. **Back inside the group**, rank 0 publishes the result in torchrun's store
   (:meth:`~gossip.groups.link.StoreLink.publish_result`) and ranks 1..K-1, which waited
   on the store, read it. No torch collective runs while rank 0 alone waits on the members,
   so none can time out (as for rank 0's decisions, docs/GROUPS.md); a rank > 0 waits for
   the result at most :func:`follower_wait` seconds (twice rank 0's bound, plus a minute),
   then raises. Every rank returns the same bytes: the same float everywhere.

What a group contributes:

- ``average(value, weight)``: every rank's ``weight * value`` and ``weight`` are summed in
  the group, and the member's pair goes to the members' mean, so the result is the weighted
  mean over every rank of every member (with weight 1 everywhere and groups of equal
  size, the mean of the ranks' values, as ``all_reduce`` then a division by the world
  size gives). A single-process member's pair is ``[w * v, w]``: the same message.
- ``all_gather(value)``: one entry per rank of every member, ``M * K`` tensors, in member
  id order and, within a member, in rank order (every member of a cluster of groups has
  the same K: the shard layout is in the model's fingerprint).
- ``barrier()``: returns once every rank of every live member reached it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from gossip.peer.collectives import Collectives, check_weight, flat_values, shaped_like

__all__ = ["GroupCollectives", "Intra", "TorchIntra", "follower_wait", "MARGIN"]

MARGIN = 60.0  # seconds a rank > 0 waits for rank 0's result beyond twice rank 0's own bound

_RESULT, _ERROR = b"R", b"E"


def follower_wait(join_timeout: float, timeout: float) -> float:
    """Seconds a rank > 0 waits on the store for rank 0's result of one collective: twice
    the longest rank 0 waits for a member (``max(join_timeout, timeout)``), plus
    :data:`MARGIN` for what rank 0 handles meanwhile."""
    return 2 * max(join_timeout, timeout) + MARGIN


class Intra(Protocol):
    """The group's own collectives over its K ranks, on flat float64 CPU tensors."""

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, values: torch.Tensor) -> list[torch.Tensor]: ...

    def barrier(self) -> None: ...


class TorchIntra:
    """:class:`Intra` over torch.distributed's default process group (the group's), with the
    tensors on ``device`` while they travel (NCCL needs them on the rank's GPU)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        x = values.to(self.device)
        dist.all_reduce(x)
        return x.cpu()

    def all_gather(self, values: torch.Tensor) -> list[torch.Tensor]:
        x = values.to(self.device)
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return [o.cpu() for o in out]

    def barrier(self) -> None:
        self.all_reduce_sum(torch.zeros(1, dtype=torch.float64))  # (any backend, any device)


class GroupCollectives:
    """The collectives across members on one rank of a group (see the module).

    Parameters
    ----------
    rank, size : this rank and the group's ranks
    link : the group's channel (:class:`~gossip.groups.link.StoreLink`: ``publish_result``
        on rank 0, ``result`` on the others)
    intra : the group's own collectives (:class:`TorchIntra`)
    across : rank 0's :class:`~gossip.peer.collectives.Collectives` (the members'); None on
        ranks 1..K-1
    wait : seconds a rank > 0 waits for rank 0's result (:func:`follower_wait`)
    """

    def __init__(self, rank: int, size: int, link: Any, intra: Intra, across: Collectives | None,
                 wait: float) -> None:
        if (rank == 0) != (across is not None):
            raise ValueError("rank 0 (and only rank 0) takes part in the members' collectives: give it across")
        self.rank, self.size = rank, size
        self.link, self.intra, self.across = link, intra, across
        self.wait = wait
        self.calls = 0  # the group's collectives so far, counted alike on every rank (the store's keys)

    def average(self, value: Any, weight: float = 1.0) -> Any:
        """The weighted mean of ``value`` (a float, a sequence of floats, or a tensor) over
        every rank of every member; the same result on every rank."""
        check_weight(weight)
        t = flat_values(value)
        sums = self.intra.all_reduce_sum(torch.cat([t * weight, torch.tensor([float(weight)],
                                                                               dtype=torch.float64)]))
        mean = self._run(lambda: self.across.mean_of(sums))  # type: ignore[union-attr]
        out = shaped_like(value, mean)
        return out.to(value.device) if isinstance(value, torch.Tensor) else out

    def all_gather(self, value: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``value`` (the same shape on every rank), ``M * K`` of them: in member
        id order, each member's in rank order."""
        t = torch.as_tensor(value).detach()
        rows = self.intra.all_gather(t.to(torch.float64).cpu().reshape(-1))

        def across() -> torch.Tensor:
            got = self.across.all_gather(torch.cat(rows))  # type: ignore[union-attr]
            return torch.cat([torch.tensor([float(len(got) * self.size)], dtype=torch.float64), *got])

        out = self._run(across)
        count, values = int(out[0]), out[1:]
        return [v.reshape(t.shape).to(dtype=t.dtype, device=t.device) for v in values.reshape(count, -1)]

    def barrier(self) -> None:
        """Return once every rank of every live member has reached its matching call."""
        self.intra.barrier()

        def across() -> torch.Tensor:
            self.across.barrier()  # type: ignore[union-attr]
            return torch.zeros(0, dtype=torch.float64)

        self._run(across)

    def _run(self, across: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Rank 0: the members' part, then its result (or its error) on the store for the
        others; ranks > 0: that result, read from the store. Returns flat float64."""
        self.calls += 1
        call = self.calls
        if self.rank == 0:
            try:
                result = across().to(torch.float64).contiguous()
            except Exception as e:  # the other ranks raise it too, instead of waiting it out
                self.link.publish_result(call, _ERROR + f"{type(e).__name__}: {e}".encode())
                raise
            self.link.publish_result(call, _RESULT + result.numpy().tobytes())
            return result
        data = self.link.result(call, self.wait)
        if data is None:
            raise RuntimeError(f"collective {call} across members: rank 0 published no result in {self.wait:g} s "
                               "(its wait for the members is bounded by half of that)")
        if data[:1] == _ERROR:
            raise RuntimeError(f"collective {call} across members failed on rank 0: {data[1:].decode()}")
        return torch.frombuffer(bytearray(data[1:]), dtype=torch.float64) if len(data) > 1 \
            else torch.zeros(0, dtype=torch.float64)

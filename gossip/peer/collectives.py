"""Collectives over a cluster's members for a training loop of the user's own: the mean
of a metric, the exact average of the models, a barrier, and the common starting point
of a fresh cluster. Every member calls them at the same point of its loop; members
that are gone are left out, so nobody waits for a dead one longer than
``join_timeout``.

Values travel as "average" messages (float64 as the bytes of twice as many float32);
every member numbers its calls alike, and each sums what it got in the order of the
member ids, so all get the same float.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Iterator

import torch

from gossip.compression import get_codec
from gossip.core.message import Message
from gossip.mixing.base import decode_payload

__all__ = ["Collectives", "check_weight", "flat_values", "shaped_like"]

log = logging.getLogger("gossip.user_loop")

OPS = ("avg", "model", "start", "barrier", "gather")


def check_weight(weight: Any) -> None:
    """A collective's weight is a positive finite number (``ValueError`` otherwise)."""
    if isinstance(weight, bool) or not (isinstance(weight, (int, float)) and weight > 0 and math.isfinite(weight)):
        raise ValueError(f"weight must be a positive number, got {weight!r}")


def flat_values(value: Any) -> torch.Tensor:
    """``value`` (a float, a sequence of floats, or a tensor) as a flat float64 CPU tensor."""
    return torch.as_tensor(value, dtype=torch.float64).detach().cpu().reshape(-1)


def shaped_like(value: Any, mean: torch.Tensor) -> Any:
    """``mean`` (flat float64) in the form ``value`` came in: a float, a tensor of its shape
    and dtype, or a list."""
    if isinstance(value, (int, float)):
        return float(mean[0])
    if isinstance(value, torch.Tensor):
        return mean.reshape(value.shape).to(value.dtype)
    return mean.tolist()


class Collectives:
    """The collectives of one :class:`~gossip.peer.driver.Peer` (see the module)."""

    def __init__(self, peer: Any) -> None:
        self.peer = peer
        self.got: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self.calls = 0  # collectives so far: every member numbers its calls alike
        self.consensus_distance: float | None = None  # of the last consensus_model() call
        peer.on_average = self.on_message

    def average(self, value: Any, weight: float = 1.0) -> Any:
        """The mean of ``value`` (a float, a sequence of floats, or a tensor) over the
        cluster's members, weighted by ``weight``; the same result on every member."""
        check_weight(weight)
        t = flat_values(value)
        return shaped_like(value, self.mean_of(torch.cat([t * weight, torch.tensor([float(weight)],
                                                                                   dtype=torch.float64)])))

    def mean_of(self, sums: torch.Tensor) -> torch.Tensor:
        """The members' weighted mean from this member's weighted sums: ``sums`` is float64
        ``[sum of weight * value ..., sum of weights]`` (a single node's ``[w*v..., w]``; a
        group's, summed over its ranks), and so is what every other member sends. Returns
        the mean as float64, the same float on every member."""
        got = self.gather("avg", sums)
        total = sum(got[k] for k in sorted(got))  # the same order everywhere: the same float result
        return total[:-1] / total[-1]

    def all_gather(self, value: torch.Tensor) -> list[torch.Tensor]:
        """Every live member's ``value`` (same shape everywhere), in member-id order."""
        t = torch.as_tensor(value).detach()
        got = self.gather("gather", t.to(torch.float64).cpu().reshape(-1))
        out = []
        for k in sorted(got):
            if got[k].numel() != t.numel():
                raise ValueError(f"all_gather: {k} sent {got[k].numel()} values, this node {t.numel()}")
            out.append(got[k].reshape(t.shape).to(dtype=t.dtype, device=t.device))
        return out

    def barrier(self) -> None:
        """Return once every live member has reached its matching call."""
        self.gather("barrier", torch.zeros(1, dtype=torch.float64))

    @contextlib.contextmanager
    def consensus_model(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``model`` with the exact average of all members' parameters inside the block."""
        node = self.peer.node
        assert node is not None
        own = node.state.snapshot().detach().cpu().to(torch.float64)
        got = self.gather("model", own)
        mean = sum(got[k] for k in sorted(got)) / len(got)
        self.consensus_distance = self.average(float(torch.sum((own - mean) ** 2)))
        node.state.load_(mean.to(node.state.flat.dtype).to(node.state.flat.device))
        try:
            yield model
        finally:
            node.state.load_(own.to(node.state.flat.dtype).to(node.state.flat.device))

    def gather(self, op: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Send ``values`` to every member, wait for theirs of the same call; by member id."""
        peer, node = self.peer, self.peer.node
        assert node is not None
        self.calls += 1
        call = self.calls
        # float64 travels as the bytes of twice as many float32 (the codecs carry no float64)
        wire_values = values.to(torch.float64).contiguous().view(torch.float32)
        msg = Message("average", peer.id, call, node.step, 0, get_codec("none").encode(wire_values), None,
                      {"inc": peer.incarnation, "op": op}, peer.fingerprint)
        for m in node.members:
            if m != peer.id:
                peer._send_message(m, msg)
        got = self.got.setdefault((op, call), {})
        got[peer.id] = values
        deadline = time.monotonic() + max(peer.cfg.timing.join_timeout, peer.cfg.timeout)
        while True:
            with peer.lock:
                missing = [m for m in node.members if m not in got and self._answers(m, node.round)]
            if not missing:
                break
            if time.monotonic() > deadline:
                log.warning("%s: %s call %d: no value from %s; going on without them", peer.id, op, call,
                            ", ".join(missing))
                break
            peer._service(0.05)
        del self.got[(op, call)]
        return got

    def _answers(self, mid: str, rnd: int) -> bool:
        """Whether member ``mid`` of round ``rnd`` can answer a call (``lock`` held): it is in
        the member table, in the life the schedule has train then. A restarted member's new
        life that waits for its join round cannot (its old life is dead, and the new one
        calls the collectives only once it trains): waiting for it held every call up to
        ``join_timeout``, call after call, until its join round, which the calls held back."""
        membership = self.peer.membership
        m = membership.members.get(mid)
        if m is None:
            return False
        _, life = membership.life_in(mid, rnd)
        return life is None or m.incarnation == life

    def on_message(self, msg: Message) -> None:
        """An "average" message from a member (checked: its op, size, values)."""
        peer = self.peer
        op = msg.extra.get("op")
        if op not in OPS or msg.data is None or msg.fingerprint != peer.fingerprint:
            peer.control.reject(str(msg.sender), "average", "a bad average message")
            return
        values = decode_payload(msg, torch.empty(0, dtype=torch.float32)).clone()
        if op != "start":
            if values.numel() % 2:
                peer.control.reject(str(msg.sender), "average", "an odd-sized average message")
                return
            values = values.view(torch.float64)
        if not bool(torch.isfinite(values).all()):
            peer.control.reject(str(msg.sender), "non-finite", "an average message")
            return
        if op != "start" and peer.node is not None and msg.round <= self.calls - 1 \
                and (op, msg.round) not in self.got:
            return  # a call this node has finished (without that member)
        if len(self.got) < 64:
            self.got.setdefault((op, msg.round), {})[str(msg.sender)] = values

    def agree_start(self) -> None:
        """Every member of a fresh cluster takes the first member's parameters (sorted
        member list), before anyone's first step. A member that resumed from a
        checkpoint or joined a running cluster keeps its state (then nobody is at step 0)."""
        peer, node = self.peer, self.peer.node
        assert node is not None
        if peer.joined or peer.resumed_from is not None or node.step != 0 or len(node.members) < 2:
            return
        first = node.members[0]
        if first == peer.id:
            snap = node.state.snapshot().detach().cpu().to(torch.float32).contiguous()
            msg = Message("average", peer.id, 0, 0, 0, get_codec("none").encode(snap), None,
                          {"inc": peer.incarnation, "op": "start"}, peer.fingerprint)
            for m in node.members[1:]:
                peer._send_message(m, msg)
            return
        deadline = time.monotonic() + max(peer.cfg.timeout, 5.0)
        while time.monotonic() < deadline:
            got = self.got.get(("start", 0), {})
            if first in got:
                values = self.got.pop(("start", 0))[first]
                if values.numel() == node.numel:
                    node.adopt(values.to(node.state.flat.dtype).to(node.state.flat.device))
                    log.info("%s: took the starting parameters of %s (the first member)", peer.id, first)
                    return
                break
            peer._service(0.05)
        log.warning("%s: no starting parameters from %s (the first member); starting from this node's own",
                    peer.id, first)

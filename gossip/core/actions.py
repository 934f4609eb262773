"""What driven programs yield: the one action vocabulary of the node program and the peer's life.

The node program (:meth:`gossip.training.node.Node.program`) and the peer's life
(:class:`gossip.protocol.lifecycle.Lifecycle`) never sleep, never read a clock and
never touch a socket: they yield one of these, and the driver (the wall clock and
ZeroMQ, :mod:`gossip.peer.driver`; the simulator's virtual clock,
:mod:`gossip.sim.engine` and :mod:`gossip.sim.cluster`) answers each with the time of
its clock.

``Compute()``
    "I just ran one local optimizer step": the simulator advances its virtual
    clock by this node's compute time; a real driver just carries on.
``Send(messages)``
    "deliver these": the simulator schedules arrivals over its link model; the
    real driver hands them to the ZeroMQ I/O thread. Never blocks.
``Wait(timeout)``
    "resume me when the node is ready (its round's messages are in), or after
    ``timeout`` seconds of your clock". Used by synchronous rules.
``Release(lease, timeout)``
    "resume me when the transport has let go of the parameters I sent in place,
    or after ``timeout`` seconds" (see :class:`gossip.core.buffers.SendLease`).
``Poll(timeout)``
    "handle what arrives for me, then resume me within ``timeout`` seconds" (a
    driver may resume it earlier, as soon as something arrived). The peer's life
    turns the node program's ``Wait`` into polls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

from gossip.core.buffers import SendLease
from gossip.core.message import Message

__all__ = ["Compute", "Send", "Wait", "Release", "Poll", "Action", "COMPUTE", "POLL0", "Program"]


@dataclass(frozen=True)
class Compute:
    """The node finished one local step."""


@dataclass(frozen=True)
class Send:
    """Messages to deliver: ``(destination id, Message)`` pairs."""

    messages: list[tuple[Any, Message]]


@dataclass(frozen=True)
class Wait:
    """Resume when the node is ready or ``timeout`` seconds have passed."""

    timeout: float


@dataclass(frozen=True)
class Release:
    """Resume when ``lease`` is released (the transport is done with the
    parameters sent in place) or ``timeout`` seconds have passed."""

    lease: SendLease
    timeout: float


@dataclass(frozen=True)
class Poll:
    """Handle arriving messages, resume within ``timeout`` seconds."""

    timeout: float


Action = Compute | Send | Wait | Release | Poll
COMPUTE = Compute()
POLL0 = Poll(0.0)  # "what time is it?": handle what arrived, resume at once
Program = Generator[Any, float, Any]

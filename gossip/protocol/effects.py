"""The one effect vocabulary of the protocol's sans-IO parts.

The control plane (:class:`~gossip.protocol.control.ControlPlane`) and the failure
detectors (:mod:`gossip.protocol.detector`, :mod:`gossip.protocol.swim_detector`)
never touch a socket: every method that decides something returns an
:class:`Effects`, and only the control plane's shell (``ControlPlane.apply``, run by
the driver) carries it out. A detector's :class:`Verdicts` are effects too (its
probes and replies, framed as this node's messages) plus what it now holds of the
members.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gossip.core.message import Message

__all__ = ["Effects", "Verdicts", "Verdict"]

# this node, alive and training, must join another cluster as a new life:
# (round, by, that cluster's members, merge); see ControlPlane's ``excluded``
Verdict = tuple[int, str, set[str], bool]


@dataclass
class Effects:
    """What handling a message or a tick decided, for the shell to carry out."""

    sends: list[tuple[str, Message]] = field(default_factory=list)
    broadcasts: list[Message] = field(default_factory=list)  # to every other member
    reconnect: list[str] = field(default_factory=list)  # members that came back: open fresh connections
    verdict: Verdict | None = None
    dead: list[str] = field(default_factory=list)  # members just declared dead (their connections can go)

    def add(self, other: "Effects") -> "Effects":
        """``other``'s effects after these (the first verdict stands); returns self."""
        self.sends += other.sends
        self.broadcasts += other.broadcasts
        self.reconnect += other.reconnect
        self.dead += other.dead
        if self.verdict is None:
            self.verdict = other.verdict
        return self


@dataclass
class Verdicts(Effects):
    """A failure detector's effects at one tick (or on one of its own messages): the
    messages to send now (``sends``: probes, replies), and the members it now holds
    ``dead``, ``suspected``, ``alive`` again (after a suspicion) or ``left``."""

    suspected: list[str] = field(default_factory=list)
    alive: list[str] = field(default_factory=list)  # suspected before, heard from since
    left: list[str] = field(default_factory=list)  # said goodbye, as another node heard (SWIM's news)
    stalled: float = 0.0  # seconds this node itself did not run (0: it ran)

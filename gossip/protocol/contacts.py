"""First contacts: whose word a control plane takes before it knows the sender.

A sender's word counts once the control plane has reason to take it: it is a member (or
was one), or it proved that it receives at its address. A sender with neither gets a
light ``hello`` carrying a token (``tok``: a keyed hash of the sender's id, so only
whoever receives at that address learns it), and its message changes nothing; a message
that sends the token back (``echo``) proves the address. Each side asks only while it
does not know the other, so tokens cost a round trip at a first contact and nothing in
steady traffic (see docs/PROTOCOL.md, "Strangers").

:class:`Contacts` keeps this bookkeeping (the key, the ids that proved their address,
the tokens others asked this node to send back, the senders sent a token, the ids said
hello to unasked, the budget of tokens for senders nobody expects), every part of it
bounded, so that senders cycling through made-up ids cannot grow a node's memory. It
does not send and does not read member tables: :class:`~gossip.protocol.control.ControlPlane`
says which senders are vouched for or expected, and sends what this decides. Its
methods are called with the control plane's lock held.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import secrets
from typing import Any

from gossip.core.message import Message
from gossip.protocol.timing import Timing

__all__ = ["Contacts", "BadToken", "MAX_PROVEN", "MAX_CHALLENGED", "CHALLENGE_RATE", "MAX_GREETED",
           "TOKEN_CHARS"]

MAX_PROVEN = 16_384  # ids that proved their address kept (the oldest go first)
MAX_CHALLENGED = 256  # senders not proven yet that this node has sent its token to, at once
CHALLENGE_RATE = 10.0  # tokens a second, at most, to senders this node has no reason to expect (burst: twice)
MAX_GREETED = 4096  # ids this node said hello to unasked (seeds, the members a restart remembers) kept
TOKEN_CHARS = 64  # the longest token accepted


class BadToken(ValueError):
    """A message's ``tok`` field is not a short string."""


class Contacts:
    """One process's first-contact bookkeeping.

    Parameters
    ----------
    timing : the protocol's timings (:class:`~gossip.protocol.timing.Timing`): a token to one
        sender at most once a ``heartbeat``; a sender that has not sent it back within
        ``dead_after`` is forgotten, an id said hello to after ``join_timeout``
    secret : the key of this process's tokens (default: random; a simulated peer passes
        one of its own, so that a run replays exactly)
    """

    def __init__(self, timing: Timing, secret: bytes | None = None) -> None:
        self.timing = timing
        self._key = secret if secret is not None else secrets.token_bytes(16)
        self.proven: dict[str, None] = {}  # ids that sent this node's token back (insertion order: age)
        self.asked: dict[str, str] = {}  # peer that does not know this node yet -> the token it sent
        self.challenged: dict[str, tuple[float, bool]] = {}  # sent a token -> (when, its refused message a hello)
        self.greeted: dict[str, float] = {}  # said hello to unasked -> when
        self.unproven = 0  # control messages that changed nothing: their sender had not proved its address
        self._allowance = (2 * CHALLENGE_RATE, -math.inf)  # (tokens left for the unexpected, as of when)

    def token(self, peer: str) -> str:
        """This process's token for ``peer``: only a node that receives at ``peer``'s address
        learns it, so a message that sends it back comes from there."""
        return hashlib.blake2b(peer.encode(errors="replace"), key=self._key, digest_size=8).hexdigest()

    def stamp(self, dst: str, msg: Message, vouched: bool) -> Message:
        """``msg`` as it goes to ``dst``: with this node's token for ``dst`` unless ``dst`` is
        ``vouched`` for, and with the token ``dst`` asked this node to send back while it asks."""
        tok = None if vouched else self.token(dst)
        echo = self.asked.get(dst)
        if tok is None and echo is None:
            return msg
        x = dict(msg.extra)
        if tok is not None:
            x["tok"] = tok
        if echo is not None:
            x["echo"] = echo
        return dataclasses.replace(msg, extra=x)

    @staticmethod
    def take(msg: Message) -> tuple[str | None, Any]:
        """Remove ``tok`` and ``echo`` from ``msg`` and return them (``tok`` checked: a short
        string or None; else :class:`BadToken`)."""
        tok, echo = msg.extra.pop("tok", None), msg.extra.pop("echo", None)
        if tok is not None and not (isinstance(tok, str) and 0 < len(tok) <= TOKEN_CHARS):
            raise BadToken("a token that is not a short string")
        return tok, echo

    def prove(self, peer: str, echo: Any) -> tuple[bool, bool]:
        """Whether ``echo`` is this node's token for ``peer`` (then ``peer`` has proved its
        address and is remembered so), and whether the message refused when the token was
        sent was a hello."""
        if not (isinstance(echo, str) and hmac.compare_digest(echo.encode(errors="replace"),
                                                              self.token(peer).encode())):
            return False, False
        if len(self.proven) >= MAX_PROVEN:
            del self.proven[next(iter(self.proven))]
        self.proven[peer] = None
        challenge = self.challenged.pop(peer, None)
        return True, challenge is not None and challenge[1]

    def heard(self, peer: str, tok: str | None) -> None:
        """A message of ``peer``, whose word counts, carried ``tok``: send it back while it
        asks (no token: it knows this node now)."""
        if tok is None:
            self.asked.pop(peer, None)
        elif peer in self.asked or len(self.asked) < MAX_PROVEN:
            self.asked[peer] = tok

    def challenge(self, peer: str, hello: bool, expected: bool, now: float) -> bool:
        """Whether to send ``peer``, not vouched for, this node's token now: at most once a
        heartbeat, to at most :data:`MAX_CHALLENGED` senders at once, and from a budget of
        :data:`CHALLENGE_RATE` a second when this node has no reason to ``expect`` it (so a
        flood of made-up ids costs a few connections a second, not one a message). If so,
        it is recorded as sent (``hello``: the refused message was one)."""
        last = self.challenged.get(peer)
        if last is not None and now - last[0] < self.timing.heartbeat:
            return False  # asked a moment ago
        if last is None and len(self.challenged) >= MAX_CHALLENGED:
            return False  # (they expire in expire())
        if not expected:
            allowance, since = self._allowance
            allowance = min(2 * CHALLENGE_RATE, allowance + (now - since) * CHALLENGE_RATE)
            if allowance < 1:
                self._allowance = (allowance, now)
                return False
            self._allowance = (allowance - 1, now)
        self.challenged[peer] = (now, hello or (last is not None and last[1]))
        return True

    def challenge_message(self, peer: str, reply: Message, tok: str | None) -> Message:
        """``reply`` (a light hello) carrying this node's token for ``peer``, and ``peer``'s
        own token back when its refused message carried one."""
        extra = {**reply.extra, "tok": self.token(peer)}
        if tok is not None:
            extra["echo"] = tok
        return dataclasses.replace(reply, extra=extra)

    def greet(self, peers: list[str], now: float) -> None:
        """This node says hello to ``peers`` unasked: their answers are expected."""
        for p in peers:
            if p not in self.greeted and len(self.greeted) >= MAX_GREETED:
                break
            self.greeted[p] = now

    def expire(self, now: float) -> list[str]:
        """Forget the senders that never sent their token back within ``dead_after`` (they
        are returned) and the ids said hello to unasked ``join_timeout`` ago."""
        old = [p for p, (t, _) in self.challenged.items() if now - t > self.timing.dead_after]
        for p in old:
            del self.challenged[p]
        self.greeted = {p: t for p, t in self.greeted.items() if now - t <= self.timing.join_timeout}
        return old

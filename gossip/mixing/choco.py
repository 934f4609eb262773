"""CHOCO-gossip: compressed gossip with error feedback (Koloskova et al., 2019).

Each node i keeps public copies: ``own`` (x_hat_i, what its neighbours believe of
it) and ``copies[j]`` (x_hat_j of each in-neighbour j). Every round it sends
q_i = C(x_i - x_hat_i), once, to all its out-neighbours; sender and receivers
add the *decoded* q_i to their copy of x_hat_i, so the copies stay bit-identical;
then x_i += gamma * sum_j w_ij (x_hat_j - x_hat_i). What the codec dropped stays
in x_i - x_hat_i and is sent later: the error is fed back by construction.

Keeping copies identical on both ends of a real link takes a protocol:

* Every compressed message carries a per-sender sequence number
  (``extra["cseq"]``). All copies start at zero and cseq at 0, on both ends.
* A receiver that misses a message (it did not arrive by the round's timeout),
  or sees an unexpected cseq (a gap, reordering, a duplicate, a restarted peer),
  stops mixing that neighbour (its weight goes to self) and asks it for a
  snapshot: its next packets carry ``extra["resync"] = [requester, target,
  asked_round, ...]`` (flat triples). The request is asked again if no snapshot
  has come back when one could have.
* A sender that finds a request addressed to it sends the requester, next
  round, a full uncompressed snapshot of x_hat_i
  (``extra={"full": True, "cseq": n}``) instead of q_i; the receiver overwrites
  its copy and mixes the neighbour again.
* On a one-way link (``exponential`` sends i -> i + 2^k) the target does not hear
  the requester directly: nodes closer to the target (in hops) relay the request,
  so it arrives after as many rounds as the shortest path back is long.

Topologies: CHOCO needs a static graph. A time-varying one (one-peer exponential)
would need public copies per directed edge, each going stale while its edge is
idle; it is refused with a ValueError (use push-sum, or gossip without
compression). CHOCO is not combined with push-sum: compressed push-sum mass would
need error feedback of its own.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import numpy as np
import torch

from gossip.compression import Codec, get_codec, get_decoder
from gossip.core.message import Packet
from gossip.mixing.base import Inbox, MixingRule, MixReport
from gossip.mixing.staleness import parse_staleness

__all__ = ["ChocoRule", "check_choco_topology", "parse_gamma"]

_IDENTITY = get_codec("identity")
#: Most resync triples read from one message (a hostile peer cannot make us loop longer).
_MAX_REQUESTS = 256


def parse_gamma(gamma: Any) -> float | str | None:
    """Validate a CHOCO step size: None (the codec's default), ``"auto"`` or a number in (0, 1]."""
    if gamma is None or gamma == "auto":
        return gamma
    if isinstance(gamma, str):
        try:
            gamma = float(gamma)
        except ValueError:
            raise ValueError(f"gamma must be a number in (0, 1] or 'auto', got {gamma!r}") from None
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be a number in (0, 1] or 'auto', got {gamma!r}")
    return float(gamma)


def check_choco_topology(topology: Any) -> None:
    """Raise ValueError unless ``topology`` is static (the same graph every round)."""
    if getattr(topology, "time_varying", False):
        raise ValueError(f"CHOCO needs a static topology; {getattr(topology, 'spec', 'this one')!r} changes every "
                         "round (use push-sum, or gossip without compression)")


_HOPS: "weakref.WeakKeyDictionary[Any, np.ndarray]" = weakref.WeakKeyDictionary()


def hops(topology: Any) -> np.ndarray:
    """``d[u, v]``: fewest links from u to v in round 0's graph (n where unreachable).

    Computed once per topology object and shared by the nodes that use it.
    """
    d = _HOPS.get(topology)
    if d is None:
        n = topology.n
        adj = np.zeros((n, n), dtype=np.float32)
        for u in range(n):
            for v in topology.out_neighbors(u, 0):
                adj[u, v] = 1.0
        d = np.full((n, n), n, dtype=np.int64)
        np.fill_diagonal(d, 0)
        reach = np.eye(n, dtype=np.float32)
        for k in range(1, n):
            reach = ((reach @ adj) > 0).astype(np.float32)
            new = (reach > 0) & (d == n)
            if not new.any():
                break
            d[new] = k
        _HOPS[topology] = d
    return d


def _cseq(extra: dict[str, Any]) -> int | None:
    v = extra.get("cseq")
    return v if type(v) is int and v >= 0 else None


def _digest(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    import hashlib

    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class ChocoRule(MixingRule):
    """CHOCO-gossip (see the module docstring): compressed, error-fed-back, synchronous.

    Parameters
    ----------
    codec : the compressor C (a :class:`~gossip.compression.Codec` or a spec)
    gamma : consensus step size in (0, 1]; None takes ``codec.default_gamma``;
        ``"auto"`` tunes it on the first round with
        :func:`gossip.mixing.tune.tune_gamma` on the topology's mixing matrix

    With the identity codec and ``gamma=1`` it reproduces plain gossip (D-PSGD).
    ``asynchronous=True`` never waits for a round: it applies the messages that
    arrived (numbered, in order; a gap still triggers a resync) and weights each
    neighbour by ``staleness`` (see :mod:`gossip.mixing.staleness`).

    Counters (cumulative): ``gaps`` (times a neighbour's copy went out of step),
    ``resyncs_requested``, ``resyncs_sent`` (full snapshots sent) and ``resyncs``
    (full snapshots applied).
    """

    name = "choco"
    synchronous = True

    def __init__(self, codec: Codec | str = "none", gamma: float | str | None = None, *,
                 asynchronous: bool = False, staleness: Any = None) -> None:
        super().__init__(codec)
        # asynchronous: never wait; mix each neighbour's public copy weighted by W_ij f(staleness)
        self.synchronous = not asynchronous
        self.decay = parse_staleness(staleness)
        self.progress_of: dict[int, int] = {}  # in-neighbour -> progress of the last message applied
        gamma = parse_gamma(gamma)
        self.gamma_spec = gamma
        self.gamma: float | None = self.codec.default_gamma if gamma is None else (None if gamma == "auto" else gamma)
        self.own: torch.Tensor | None = None  # x_hat_i
        self.copies: dict[int, torch.Tensor] = {}  # x_hat_j, per in-neighbour
        self.expect: dict[int, int] = {}  # next cseq due from each in-neighbour
        self.unsynced: set[int] = set()  # in-neighbours whose copy we cannot trust
        self.asked: dict[int, int] = {}  # in-neighbour -> round we last asked it for a snapshot
        self.resync_to: set[int] = set()  # out-neighbours owed a snapshot next round
        self.answered: dict[int, int] = {}  # requester -> latest asked_round we answered
        self.relay: dict[tuple[int, int, int], None] = {}  # requests to pass on next round (ordered)
        self.seen: dict[tuple[int, int, int], int] = {}  # requests already handled -> round seen
        self.cseq = 0  # sequence number of our next compressed message
        self.gaps = 0
        self.resyncs_requested = 0
        self.resyncs_sent = 0
        self.resyncs = 0
        self._checked: Any = None
        self._hops: np.ndarray | None = None

    # -- per-round set-up -------------------------------------------------------------------
    def _prepare(self, x: torch.Tensor, topology: Any) -> None:
        if topology is not self._checked:
            check_choco_topology(topology)
            self._checked, self._hops = topology, None
        own = self.own
        if own is None or own.shape != x.shape or own.dtype != x.dtype:
            self.own = torch.zeros_like(x)
            self.copies = {j: c for j, c in self.copies.items() if c.shape == x.shape and c.dtype == x.dtype}
        elif own.device != x.device:  # restored from a CPU checkpoint onto a GPU node
            self.own = own.to(x.device)
            self.copies = {j: c.to(x.device) for j, c in self.copies.items()}
        if self.gamma is None:  # "auto": one tuning per (matrix, codec) in this process
            from gossip.mixing.tune import cached_tune_gamma

            self.gamma = cached_tune_gamma(topology.mixing_matrix(0), self.codec, dim=min(x.numel(), 2000))

    def _distance(self, topology: Any, u: int, v: int) -> int:
        if self._hops is None:
            self._hops = hops(topology)
        return int(self._hops[u, v])

    def _copy(self, j: int, like: torch.Tensor) -> torch.Tensor:
        c = self.copies.get(j)
        if c is None:  # by convention every public copy starts at zero on both ends
            c = self.copies[j] = torch.zeros_like(like)
            self.expect.setdefault(j, 0)
        return c

    def _lose(self, j: int) -> None:
        """Our copy of ``j`` missed a message: stop trusting it until a snapshot arrives."""
        self.unsynced.add(j)
        self.asked.pop(j, None)
        self.gaps += 1

    # -- the rule ---------------------------------------------------------------------------
    def outgoing(self, x: torch.Tensor, topology: Any, me: int, rnd: int) -> list[tuple[int, Packet]]:
        self._prepare(x, topology)
        outs = self.round_weights(topology, me, rnd)[1]
        receivers = [j for j in outs if j != me]
        if not receivers:
            return []
        own = self.own
        n = self.cseq
        self.cseq += 1
        # q_i = C(x_i - x_hat_i); the sender applies the same decoded q as its receivers
        diff = x - own
        data = self.codec.encode(diff, seed=(n * 0x9E3779B1 + me) & 0x7FFFFFFFFFFFFFFF)
        if data.source is diff:
            q = diff
        else:
            q = get_decoder(data.codec).decode(data, device=x.device, copy=False)
            # In-process receivers (the simulator) read the decoded tensor instead of decoding
            # the same bytes again; it never travels, and real receivers decode the bytes.
            data = dataclasses.replace(data, source=q)
        own.add_(q)
        extra: dict[str, Any] = {"cseq": n}
        requests = self._requests(topology, me, rnd)
        if requests:
            extra["resync"] = requests
        full_to = [j for j in receivers if j in self.resync_to]
        self.resync_to.clear()
        packet = Packet(data, extra=extra)
        if not full_to:
            return [(j, packet) for j in receivers]
        # requesters get x_hat_i itself (the state after message n); the rest get q_i.
        # Receivers sharing a packet are listed together: the node makes one message per packet.
        self.resyncs_sent += len(full_to)
        full = Packet(_IDENTITY.encode(own.clone()), extra={**extra, "full": True})
        out = [(j, packet) for j in receivers if j not in full_to]
        out.extend((j, full) for j in full_to)
        return out

    def _requests(self, topology: Any, me: int, rnd: int) -> list[int]:
        """This round's resync triples: our own (re-)asks, then the ones we relay."""
        senders = self.round_weights(topology, me, rnd)[2]
        for j in sorted(self.unsynced.intersection(senders)):
            # a snapshot can be back (distance to j) + 1 rounds after we ask; ask again after that
            last = self.asked.get(j)
            if last is None or rnd - last > self._distance(topology, me, j):
                self.asked[j] = rnd
                self.resyncs_requested += 1
                self.relay[(me, j, rnd)] = None
        if self.seen:
            horizon = rnd - 2 * (topology.n + 1)  # every request has reached its target by then
            self.seen = {k: r for k, r in self.seen.items() if r >= horizon}
        if not self.relay:
            return []
        # at most _MAX_REQUESTS per message (the wire caps header lists); the rest are asked again
        flat = [v for triple in list(self.relay)[:_MAX_REQUESTS] for v in triple]
        self.relay.clear()
        return flat

    def _read_requests(self, topology: Any, me: int, sender: int, rnd: int, flat: Any) -> None:
        if not isinstance(flat, list) or len(flat) % 3:
            return
        outs = self.round_weights(topology, me, rnd)[1]
        for k in range(0, min(len(flat), 3 * _MAX_REQUESTS), 3):
            r, t, a = flat[k], flat[k + 1], flat[k + 2]
            if not (type(r) is int and type(t) is int and type(a) is int) or r == me:
                continue
            if not (0 <= r < topology.n and 0 <= t < topology.n):
                continue
            key = (r, t, a)
            if key in self.seen:
                continue
            self.seen[key] = rnd
            if t == me:
                if r in outs and a > self.answered.get(r, -1):
                    self.resync_to.add(r)
                    self.answered[r] = a
            elif self._distance(topology, me, t) < self._distance(topology, sender, t):
                self.relay[key] = None  # we are on a shortest way to the target: pass it on

    def ready(self, inbox: Inbox, topology: Any, me: int, rnd: int) -> bool:
        return True if not self.synchronous else super().ready(inbox, topology, me, rnd)

    def _apply(self, topology: Any, me: int, j: int, msg: Any, x: torch.Tensor, copy: torch.Tensor, rnd: int) -> bool:
        """Apply one message of neighbour ``j`` to our copy of x_hat_j; False if it
        could not be (a gap, a repeat, or a neighbour we are out of step with)."""
        extra = msg.extra if isinstance(msg.extra, dict) else {}
        if "resync" in extra:
            self._read_requests(topology, me, j, rnd, extra["resync"])
        n = _cseq(extra)
        if n is not None and extra.get("full") is True:
            copy.copy_(self.decode(msg, x))
            self.expect[j] = n + 1
            self.unsynced.discard(j)
            self.asked.pop(j, None)
            self.resyncs += 1
        elif n is not None and j not in self.unsynced and n == self.expect[j]:
            copy.add_(self.decode(msg, x))
            self.expect[j] = n + 1
        else:  # never apply it
            if j not in self.unsynced:
                self._lose(j)
            return False
        self.progress_of[j] = msg.progress
        return True

    def mix(self, x: torch.Tensor, inbox: Inbox, topology: Any, me: int, rnd: int, progress: int) -> MixReport:
        self._prepare(x, topology)
        weights = self.round_weights(topology, me, rnd)[0]
        report = MixReport()
        terms: list[tuple[float, torch.Tensor]] = []
        if self.synchronous:
            for j in sorted(weights):
                if j == me:
                    continue
                msg, stale = inbox.take_round(j, rnd)
                report.late += stale
                copy = self._copy(j, x)
                if msg is None:
                    if j not in self.unsynced:
                        self._lose(j)
                    report.missing += 1
                    continue
                if not self._apply(topology, me, j, msg, x, copy, rnd):
                    report.missing += 1
                    continue
                terms.append((weights[j], copy))
        else:
            # asynchronous: apply whatever arrived, in order, then mix every neighbour whose
            # copy is in step, weighted by how stale its latest message is
            stale_total = 0.0
            for j in sorted(inbox.senders()):
                if j not in weights or j == me:
                    report.late += len(inbox.take_all(j))  # not a neighbour (any more)
            for j in sorted(weights):
                if j == me:
                    continue
                copy = self._copy(j, x)
                for msg in inbox.take_all(j):
                    self._apply(topology, me, j, msg, x, copy, rnd)
                if j in self.unsynced or j not in self.progress_of:
                    continue
                s = max(0, progress - self.progress_of[j])
                w = weights[j] * self.decay(s)
                if w > 0:
                    terms.append((w, copy))
                    stale_total += s
            if terms:
                report.staleness = stale_total / len(terms)
        if terms:
            # x_i += gamma * sum_j w_ij (x_hat_j - x_hat_i); unsynced neighbours' weight goes to self
            gamma = self.gamma
            total = 0.0
            for w, c in terms:
                x.add_(c, alpha=gamma * w)
                total += w
            x.add_(self.own, alpha=-gamma * total)
            report.mixed = len(terms)
        return report

    # -- membership and persistence ---------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Name, gamma and resync counters, plus digests of the public copies (a
        receiver's copy of j must equal j's own: compare across nodes)."""
        return {"rule": self.name, "gamma": self.gamma, "gaps": self.gaps, "resyncs_requested": self.resyncs_requested,
                "resyncs_sent": self.resyncs_sent, "resyncs": self.resyncs,
                "own_sha": _digest(self.own), "copies_sha": {j: _digest(c) for j, c in sorted(self.copies.items())}}

    def neighbor_models(self) -> dict[int, torch.Tensor]:
        """What this node knows of its neighbours' parameters: the in-sync public copies."""
        return {j: c for j, c in self.copies.items() if j not in self.unsynced}

    def on_members_changed(self, old: list[Any], new: list[Any]) -> None:
        """Re-key per-neighbour state by member identity; state of departed members is dropped.

        A neighbour seen for the first time starts from the zero copy; if it has sent
        before (cseq > 0) its first message is a gap and a resync follows.
        """
        parent = getattr(super(), "on_members_changed", None)
        if parent is not None:
            parent(old, new)
        self._round_key = None
        self._checked, self._hops = None, None
        index = {m: i for i, m in enumerate(new)}
        remap = {i: index[m] for i, m in enumerate(old) if m in index}
        self.copies = {remap[j]: c for j, c in self.copies.items() if j in remap}
        self.expect = {remap[j]: v for j, v in self.expect.items() if j in remap}
        self.unsynced = {remap[j] for j in self.unsynced if j in remap}
        self.asked = {remap[j]: v for j, v in self.asked.items() if j in remap}
        self.resync_to = {remap[j] for j in self.resync_to if j in remap}
        self.answered = {remap[j]: v for j, v in self.answered.items() if j in remap}
        self.relay.clear()  # requests name old indices
        self.seen.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "gamma": self.gamma,
            "cseq": self.cseq,
            "own": None if self.own is None else self.own.detach().cpu().clone(),
            "copies": {j: c.detach().cpu().clone() for j, c in self.copies.items()},
            "expect": dict(self.expect),
            "unsynced": sorted(self.unsynced),
            "asked": dict(self.asked),
            "resync_to": sorted(self.resync_to),
            "answered": dict(self.answered),
            "relay": [list(k) for k in self.relay],
            "seen": [[*k, r] for k, r in self.seen.items()],
            "counters": {"gaps": self.gaps, "resyncs_requested": self.resyncs_requested,
                         "resyncs_sent": self.resyncs_sent, "resyncs": self.resyncs},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if state.get("gamma") is not None:
            self.gamma = float(state["gamma"])
        self.cseq = int(state.get("cseq", 0))
        own = state.get("own")
        self.own = None if own is None else own.clone()
        self.copies = {int(j): c.clone() for j, c in (state.get("copies") or {}).items()}
        self.expect = {int(j): int(v) for j, v in (state.get("expect") or {}).items()}
        self.unsynced = {int(j) for j in state.get("unsynced", ())}
        self.asked = {int(j): int(v) for j, v in (state.get("asked") or {}).items()}
        self.resync_to = {int(j) for j in state.get("resync_to", ())}
        self.answered = {int(j): int(v) for j, v in (state.get("answered") or {}).items()}
        self.relay = {tuple(int(v) for v in k): None for k in state.get("relay", ())}
        self.seen = {(int(r), int(t), int(a)): int(s) for r, t, a, s in state.get("seen", ())}
        for k, v in (state.get("counters") or {}).items():
            if k in ("gaps", "resyncs_requested", "resyncs_sent", "resyncs"):
                setattr(self, k, int(v))

"""Modelled links for the simulator: latency, bandwidth, jitter, loss, partitions.

Each directed link (u, v) serialises its own messages: a message starts
transmitting when the previous one on the same link has left, takes
``bytes * 8 / bandwidth`` seconds to leave, then ``latency`` (+ jitter) to
arrive. Links are classified "intra" or "inter" datacenter by the topology's
``dc`` labels, and each class has its own :class:`LinkModel`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

__all__ = ["LinkModel", "SimNetwork", "parse_link", "group_link", "emulated_links", "emulation_origin", "LAN", "WAN",
           "UNSHAPED"]

_UNITS_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_UNITS_RATE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "b": 8.0, "kb": 8e3, "mb": 8e6, "gb": 8e9}


@dataclass(frozen=True)
class LinkModel:
    """One class of link.

    latency : one-way delay in seconds
    bandwidth : bits per second
    jitter : standard deviation of extra delay (seconds, half-normal)
    loss : probability that a message is lost
    drop : if > 0, the ``drop``-th message on each link of this class is lost
        (a deterministic fault for tests: "lose exactly one message here")
    down : ``(start, end)`` seconds: every message on links of this class is lost
        from ``start`` to ``end`` (an outage: ``inter`` down splits datacenters);
        or a tuple of such windows (several outages)
    """

    latency: float = 100e-6
    bandwidth: float = 10e9
    jitter: float = 0.0
    loss: float = 0.0
    drop: int = 0
    down: tuple[float, float] | tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"latency must be a finite number >= 0 seconds, got {self.latency!r}")
        if not (self.bandwidth > 0):
            raise ValueError(f"bandwidth must be > 0 bits/s, got {self.bandwidth!r}")
        if not (self.jitter >= 0 and math.isfinite(self.jitter)):
            raise ValueError(f"jitter must be a finite number >= 0 seconds, got {self.jitter!r}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be a probability in [0, 1), got {self.loss!r}")
        if isinstance(self.drop, bool) or not isinstance(self.drop, int) or self.drop < 0:
            raise ValueError(f"drop must be a non-negative integer (the N-th message), got {self.drop!r}")
        try:
            windows = self.windows
            ok = all(len(w) == 2 and 0 <= w[0] < w[1] and math.isfinite(w[1]) for w in windows)
        except TypeError:
            ok = False
        if not ok or (self.down is not None and not windows):
            raise ValueError(f"down must be a window START-END in seconds with 0 <= START < END (or a tuple of "
                             f"such windows), got {self.down!r}")

    @property
    def windows(self) -> tuple[tuple[float, float], ...]:
        """The outages ``down`` names, as a tuple of ``(start, end)`` windows.

        >>> LinkModel(down=(1.0, 2.0)).windows, LinkModel(down=((1.0, 2.0), (5.0, 6.0))).is_down(5.5)
        (((1.0, 2.0),), True)
        """
        if self.down is None:
            return ()
        if len(self.down) == 2 and not isinstance(self.down[0], tuple):
            return (self.down,)  # type: ignore[return-value]
        return tuple(self.down)  # type: ignore[arg-type]

    def is_down(self, t: float) -> bool:
        """Whether ``t`` seconds after the origin falls in an outage."""
        return any(a <= t < b for a, b in self.windows)

    def transfer_time(self, nbytes: int) -> float:
        """Seconds for ``nbytes`` to leave the sender on an idle link."""
        return nbytes * 8.0 / self.bandwidth


LAN = LinkModel(latency=100e-6, bandwidth=10e9)
WAN = LinkModel(latency=50e-3, bandwidth=100e6)


def _parse_quantity(key: str, text: str, units: dict[str, float]) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z/]*)\s*", text)
    if not m:
        raise ValueError(f"link option {key}={text!r}: expected a number with a unit")
    unit = m.group(2).lower().removesuffix("/s").removesuffix("ps")
    try:
        value = float(m.group(1))
    except ValueError:
        raise ValueError(f"link option {key}={text!r}: {m.group(1)!r} is not a number") from None
    if unit == "":
        return value
    if unit not in units:
        raise ValueError(f"link option {key}={text!r}: unknown unit {m.group(2)!r}; valid: {', '.join(units)}")
    return value * units[unit]


def parse_link(spec: str | LinkModel | None, base: LinkModel = LAN) -> LinkModel:
    """Parse ``latency=50ms,bandwidth=100Mbit,jitter=1ms,loss=0.01,drop=N,down=10s-30s``
    (or ``lan`` / ``wan``), and ``streams=K``. ``down`` may be given more than once:
    each is an outage (``down=10s-30s,down=50s-60s``).

    Unspecified fields keep ``base``'s values. Times take s/ms/us, rates
    bit/kbit/Mbit/Gbit (per second). ``streams=K`` models nodes that are groups of
    K ranks (:mod:`gossip.groups.group`): rank r sends its 1/K shard to rank r over a
    connection of its own of ``bandwidth``, all at once, so the link carries K
    times ``bandwidth`` (:func:`group_link`); latency, loss and bytes are unchanged.

    >>> parse_link("bandwidth=1Gbit,streams=4").bandwidth
    4000000000.0

    >>> parse_link("latency=50ms,down=10-30s").down
    (10.0, 30.0)
    >>> parse_link("down=10-30s,down=50s-60s").down
    ((10.0, 30.0), (50.0, 60.0))
    """
    if spec is None:
        return base
    if isinstance(spec, LinkModel):
        return spec
    s = spec.strip().lower()
    if s in ("lan", ""):
        return LAN
    if s == "wan":
        return WAN
    fields: dict[str, Any] = {"latency": base.latency, "bandwidth": base.bandwidth, "jitter": base.jitter,
                              "loss": base.loss, "drop": base.drop, "down": base.down}
    streams = 1
    downs: list[tuple[float, float]] = []
    for item in s.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in (*fields, "streams"):
            raise ValueError(f"link spec {spec!r}: bad item {item!r}; valid keys: {', '.join(fields)}, streams "
                             "(key=value)")
        if key in ("latency", "jitter"):
            fields[key] = _parse_quantity(key, value, _UNITS_TIME)
        elif key == "bandwidth":
            fields[key] = _parse_quantity(key, value, _UNITS_RATE)
        elif key == "down":
            start, dash, end = value.strip().partition("-")
            if not dash:
                raise ValueError(f"link spec {spec!r}: down must be START-END, e.g. down=10s-30s")
            m = re.fullmatch(r"\s*[0-9.e+]+\s*([a-z]*)\s*", end)
            if m and re.fullmatch(r"\s*[0-9.e+]+\s*", start):
                start += m.group(1)  # "10-30s": the end's unit is the start's too
            downs.append((_parse_quantity(key, start, _UNITS_TIME), _parse_quantity(key, end, _UNITS_TIME)))
            fields[key] = downs[0] if len(downs) == 1 else tuple(downs)
        elif key == "streams":
            try:
                streams = int(value)
            except ValueError:
                raise ValueError(f"link spec {spec!r}: streams must be an integer (ranks per group)") from None
        elif key == "drop":
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"link spec {spec!r}: drop must be an integer (the N-th message)") from None
        else:
            fields[key] = _parse_quantity(key, value, {})
    return group_link(LinkModel(**fields), streams)


def group_link(model: LinkModel, streams: int) -> LinkModel:
    """``model`` between two groups of ``streams`` ranks each: each rank pair has its own
    connection of ``model.bandwidth`` and carries 1/``streams`` of each message, so a
    message leaves ``streams`` times sooner; latency, jitter and losses stay the link's.

    >>> group_link(LinkModel(bandwidth=1e9), 4).transfer_time(4 * 10**6)
    0.008
    """
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams must be a positive integer (ranks per group), got {streams!r}")
    return model if streams == 1 else dataclasses.replace(model, bandwidth=model.bandwidth * streams)


class SimNetwork:
    """The simulated network between ``n`` nodes.

    Parameters
    ----------
    links : link model per link class ("intra", "inter")
    link_class : function (u, v) -> class name
    seed : seeds jitter and loss draws
    origin : the time that ``down`` windows count from (a real node's start)
    cache_classes : compute each pair's class once (the simulator's labels are
        fixed); a real node learns its peers' labels as it hears them, so its
        emulator passes False and asks ``link_class`` for every message

    Real nodes use the same object as their link emulator (``gossip-node
    --emulate``): ``transmit`` answers when a message may leave, or that it is lost.
    """

    def __init__(self, links: dict[str, LinkModel], link_class: Callable[[int, int], str], seed: int = 0,
                 origin: float = 0.0, cache_classes: bool = True) -> None:
        self.links = dict(links)
        self.origin = origin
        self.link_class = link_class
        self.cache_classes = cache_classes
        self.rng = np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, 0x11E7]))
        self.busy_until: dict[tuple[int, int], float] = {}
        self._class_cache: dict[tuple[int, int], str] = {}
        self._sent_on: Counter[tuple[int, int]] = Counter()  # droppable messages per link (for ``drop``)
        self.bytes_by_class: Counter[str] = Counter()
        self.messages_by_class: Counter[str] = Counter()
        self.lost = 0
        self._group: dict[int, int] = {}  # partition: node -> its group (empty: none)
        self._cut: Counter[tuple[Any, Any]] = Counter()  # one-way cuts: (u, v) -> how many hold it

    def partition(self, groups: list[list[int]] | None) -> None:
        """Split the network into groups that cannot reach each other (None heals it)."""
        self._group = {} if groups is None else {node: g for g, nodes in enumerate(groups) for node in nodes}

    def cut(self, pairs: Iterable[tuple[Any, Any]], *, on: bool = True) -> None:
        """Messages from u to v are lost for each (u, v) in ``pairs`` (``on`` False
        lifts the cut again); the other direction is not touched, and cuts that
        overlap hold until each is lifted."""
        for pair in pairs:
            if on:
                self._cut[pair] += 1
            elif self._cut[pair] <= 1:
                self._cut.pop(pair, None)
            else:
                self._cut[pair] -= 1

    def reachable(self, u: int, v: int) -> bool:
        if self._cut and (u, v) in self._cut:
            return False
        return not self._group or self._group.get(u, -1) == self._group.get(v, -1)

    def transmit(self, u: Any, v: Any, nbytes: int, now: float, *, droppable: bool = True) -> float | None:
        """Send ``nbytes`` from u to v at time ``now``; returns the arrival time or
        None if the message is lost. Bytes are counted as sent either way.
        ``droppable=False`` (control traffic) exempts it from ``drop``, not from ``loss``."""
        pair = (u, v)
        cls = self._class_cache.get(pair)
        if cls is None:
            cls = self.link_class(u, v)
            if self.cache_classes:
                self._class_cache[pair] = cls
        model = self.links.get(cls) or self.links["intra"]
        self.bytes_by_class[cls] += nbytes
        self.messages_by_class[cls] += 1
        start = max(now, self.busy_until.get(pair, 0.0))
        leave = start + nbytes * 8.0 / model.bandwidth
        self.busy_until[pair] = leave
        dropped = False
        if model.drop and droppable:
            self._sent_on[pair] += 1
            dropped = self._sent_on[pair] == model.drop
        down = model.down is not None and model.is_down(now - self.origin)
        if dropped or down or not self.reachable(u, v) or (model.loss and self.rng.random() < model.loss):
            self.lost += 1
            return None
        delay = model.latency
        if model.jitter:
            delay += abs(self.rng.normal(0.0, model.jitter))
        return leave + delay


UNSHAPED = LinkModel(latency=0.0, bandwidth=math.inf)


def emulated_links(specs: tuple[str, ...] | list[str]) -> dict[str, LinkModel] | None:
    """Parse ``--emulate CLASS:SPEC`` entries (CLASS: intra, inter or all) into link models."""
    if not specs:
        return None
    links = {"intra": UNSHAPED, "inter": UNSHAPED}
    for entry in specs:
        cls, sep, spec = str(entry).partition(":")
        cls = cls.strip()
        if not sep or cls not in ("intra", "inter", "all"):
            raise ValueError(f"--emulate {entry!r}: expected CLASS:SPEC with CLASS intra, inter or all, "
                             "e.g. inter:latency=50ms,bandwidth=100Mbit")
        model = parse_link(spec, UNSHAPED)
        for c in (("intra", "inter") if cls == "all" else (cls,)):
            links[c] = model
    return links


def emulation_origin(unix_time: float | None, start: float, *, now: float | None = None,
                     wall: float | None = None) -> float:
    """The time on this process's monotonic clock that ``--emulate``'s ``down`` windows
    count from: ``start`` (the node's own start), or the moment ``unix_time`` (UNIX
    seconds, ``--emulate-origin``) names, so that nodes started at different moments
    cut their links at the same moment (a partition of the whole cluster).
    ``now``/``wall`` are the monotonic and UNIX clocks read together (default: read now).

    >>> emulation_origin(None, 7.0), emulation_origin(1000.0, 7.0, now=50.0, wall=1010.0)
    (7.0, 40.0)
    """
    if unix_time is None:
        return start
    if now is None or wall is None:
        import time

        now, wall = time.monotonic(), time.time()
    return now - (wall - unix_time)

"""Building one mixing rule by name: :func:`make_rule` and the algorithms it knows."""

from __future__ import annotations

from typing import Any

from gossip.compression import Codec, get_codec
from gossip.mixing.base import MixingRule
from gossip.mixing.choco import ChocoRule, check_choco_topology, parse_gamma
from gossip.mixing.gossip import GossipRule
from gossip.mixing.pushsum import PushSumRule
from gossip.mixing.staleness import AsyncGossipRule, parse_staleness

__all__ = ["ALGORITHMS", "make_rule"]

ALGORITHMS = ("gossip", "push-sum", "choco", "naive")

#: Codecs that send every value, only rounded: push-sum may average them directly.
_ROUNDING = frozenset({"identity", "fp16", "bf16"})


def make_rule(algorithm: str, codec: Codec | str = "none", *, gamma: float | str | None = None,
              topology: Any = None, asynchronous: bool = False, staleness: Any = None,
              clip: float | str | None = None) -> MixingRule:
    """Build one mixing rule named by ``algorithm`` (one of :data:`ALGORITHMS`).

    A node's rules come from :func:`gossip.mixing.settings.build_rules`, which
    calls this for each link class; use this directly for one rule in a test.

    ``gossip``
        D-PSGD when ``codec`` is the identity; with any other codec, CHOCO (compressed
        gossip without error feedback does not train). ``gamma`` (other than 1 or
        "auto") also selects CHOCO with the identity codec: lazy gossip.
    ``choco``
        CHOCO-gossip with any codec (:class:`ChocoRule`), step size ``gamma``
        (None: the codec's default, "auto": tuned on the mixing matrix).
    ``naive``
        plain averaging of the decoded compressed parameters, no public copies: the
        ablation that shows why error feedback matters.
    ``push-sum``
        SGP; only with codecs that send every value (identity, fp16, bf16).

    ``asynchronous=True`` makes the rule never wait for a round: gossip becomes
    staleness-weighted asynchronous gossip (``staleness``: a decay spec, see
    :mod:`gossip.mixing.staleness`; CHOCO when compressed), push-sum mixes
    whatever mass has arrived.

    ``clip`` (a radius or "auto") makes synchronous uncompressed gossip robust to
    misbehaving neighbours (clipped gossip, :class:`GossipRule`).

    ``topology``, when given, is checked now (CHOCO needs a static graph) instead of
    at the first round.
    """
    codec = get_codec(codec) if isinstance(codec, str) else codec
    gamma = parse_gamma(gamma)
    parse_staleness(staleness)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    if algorithm in ("naive", "push-sum") and gamma is not None:
        raise ValueError(f"gamma is CHOCO's step size; algorithm {algorithm!r} has none "
                         "(use gossip with compression, or choco)")
    if staleness is not None and not asynchronous:
        raise ValueError("a staleness decay applies to asynchronous mixing only (asynchronous, --async)")
    if algorithm == "push-sum":
        if codec.name not in _ROUNDING:
            raise ValueError(f"push-sum cannot use compression {codec.spec!r}: averaging compressed mass has no "
                             "error feedback and does not converge; use --algorithm gossip (CHOCO) on a static "
                             "graph, or fp16/bf16")
        return PushSumRule(codec, synchronous=not asynchronous)
    if algorithm == "naive":
        if asynchronous:
            raise ValueError("naive has no asynchronous form; use gossip")
        return GossipRule(codec)
    if clip is not None and (algorithm != "gossip" or asynchronous or codec.name != "identity"
                             or gamma not in (None, "auto", 1.0)):
        raise ValueError("clip (robust mixing) works with synchronous uncompressed gossip only (algorithm gossip, "
                         "compression none, not asynchronous)")
    if algorithm == "gossip" and codec.name == "identity" and gamma in (None, "auto", 1.0):
        return AsyncGossipRule(codec, staleness) if asynchronous else GossipRule(codec, clip=clip)
    if topology is not None:
        check_choco_topology(topology)
    return ChocoRule(codec, gamma, asynchronous=asynchronous, staleness=staleness)

"""Mixing rules: how a node combines its parameters with its neighbours'.

Rules never touch sockets or clocks; see :class:`gossip.mixing.base.MixingRule`.
"""

from __future__ import annotations

from typing import Any

from gossip.compression import Codec, get_codec
from gossip.mixing.base import Inbox, MixingRule, MixReport
from gossip.mixing.choco import ChocoRule, check_choco_topology, parse_gamma
from gossip.mixing.gossip import GossipRule, weighted_sum_
from gossip.mixing.pushsum import PushSumRule

__all__ = ["Inbox", "MixingRule", "MixReport", "GossipRule", "PushSumRule", "ChocoRule", "weighted_sum_",
           "make_rule", "ALGORITHMS"]

ALGORITHMS = ("gossip", "push-sum", "choco", "naive")

#: Codecs that send every value, only rounded: push-sum may average them directly.
_ROUNDING = frozenset({"identity", "fp16", "bf16"})


def make_rule(algorithm: str, codec: Codec | str = "none", *, gamma: float | str | None = None,
              topology: Any = None) -> MixingRule:
    """Build the mixing rule named by ``algorithm`` (one of :data:`ALGORITHMS`).

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

    ``topology``, when given, is checked now (CHOCO needs a static graph) instead of
    at the first round.
    """
    codec = get_codec(codec) if isinstance(codec, str) else codec
    gamma = parse_gamma(gamma)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    if algorithm in ("naive", "push-sum") and gamma is not None:
        raise ValueError(f"gamma is CHOCO's step size; algorithm {algorithm!r} has none "
                         "(use gossip with compression, or choco)")
    if algorithm == "push-sum":
        if codec.name not in _ROUNDING:
            raise ValueError(f"push-sum cannot use compression {codec.spec!r}: averaging compressed mass has no "
                             "error feedback and does not converge; use --algorithm gossip (CHOCO) on a static "
                             "graph, or fp16/bf16")
        return PushSumRule(codec)
    if algorithm == "naive":
        return GossipRule(codec)
    if algorithm == "gossip" and codec.name == "identity" and gamma in (None, "auto", 1.0):
        return GossipRule(codec)
    if topology is not None:
        check_choco_topology(topology)
    return ChocoRule(codec, gamma)

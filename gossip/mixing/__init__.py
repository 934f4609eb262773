"""Mixing rules: how a node combines its parameters with its neighbours'.

Rules never touch sockets or clocks; see :class:`gossip.mixing.base.MixingRule`.
"""

from __future__ import annotations

from gossip.mixing.base import Inbox, MixingRule, MixReport
from gossip.mixing.choco import ChocoRule
from gossip.mixing.gossip import GossipRule, weighted_sum_
from gossip.mixing.pushsum import PushSumRule
from gossip.mixing.rules import ALGORITHMS, make_rule
from gossip.mixing.settings import MixingSettings, build_rules
from gossip.mixing.staleness import AsyncGossipRule, Staleness, parse_staleness

__all__ = ["AsyncGossipRule", "Staleness", "parse_staleness", "Inbox", "MixingRule", "MixReport", "GossipRule", "PushSumRule", "ChocoRule", "weighted_sum_",
           "make_rule", "ALGORITHMS", "MixingSettings", "build_rules"]

"""One settings object for how a node mixes, and the one place that turns it into rules.

Every entry point (``gossip-sim`` and ``gossip-node`` flags, a TOML file,
:class:`gossip.SimConfig`, :class:`gossip.protocol.config.PeerConfig`,
:class:`gossip.GossipNode`) parses its mixing options into a
:class:`MixingSettings` once, at the boundary; the simulator, the real node and
``GossipNode`` embed that object, and :func:`build_rules` builds a node's rules
from it (one rule, or one per link class with link policies). Nothing downstream
re-reads the flat options, so they cannot drift apart again.

>>> s = MixingSettings(compression="topk:0.01", period=4)
>>> s.period, s.for_link("inter").compression
(4, 'topk:0.01')
>>> rule, policies = build_rules(s)
>>> rule.name, policies
('choco', None)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from gossip.compression import Codec, get_codec
from gossip.core.options import flat_options
from gossip.mixing.base import MixingRule
from gossip.mixing.choco import parse_gamma
from gossip.mixing.fragments import FragmentRule, check_fragments
from gossip.mixing.outer import OuterRule, OuterSpec, check_outer_pairing, parse_outer
from gossip.mixing.policy import LINK_CLASSES, LinkPolicy, parse_link_policies
from gossip.mixing.pseudograd import PseudoGradientRule, check_pseudograd
from gossip.mixing.rules import ALGORITHMS, make_rule
from gossip.mixing.staleness import Staleness, parse_staleness

__all__ = ["MixingSettings", "OptionError", "build_rules", "with_mixing_options", "MIXING_OPTIONS", "CLI_FLAGS"]

#: CLI flags of the options whose flag is not ``--`` + the name with dashes.
CLI_FLAGS = {"asynchronous": "--async", "link_policy": "--link-policy"}


class OptionError(ValueError):
    """A bad value for one mixing option. ``str(e)`` names the API parameter;
    :meth:`for_cli` gives the same message naming the command-line flag."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option

    def for_cli(self) -> str:
        text = str(self)
        flag = CLI_FLAGS.get(self.option, "--" + self.option.replace("_", "-"))
        return flag + text[len(self.option):] if text.startswith(self.option) else text


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionError(name, f"{name} must be true or false, got {value!r}")
    return value


def parse_clip(value: Any, name: str = "clip") -> float | str | None:
    """None, ``"auto"`` or a positive finite radius (numbers may come as text)."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise OptionError(name, f"{name} must be a number or 'auto', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise OptionError(name, f"{name} must be a positive radius or 'auto', got {value!r}")
    return float(value)


@dataclass(frozen=True)
class MixingSettings:
    """How a node mixes: every mixing option of a run, validated, in one frozen object.

    Field names are the flat keyword arguments of :class:`gossip.SimConfig` and
    the TOML keys of ``gossip-node`` (flags: ``--`` + the name with dashes,
    ``--async`` for ``asynchronous``).

    algorithm : gossip | choco | naive | push-sum (gossip with a lossy codec is CHOCO)
    compression : codec spec (see :mod:`gossip.compression`)
    gamma : CHOCO step size in (0, 1], ``"auto"`` (tuned), or None (the codec's default)
    period : local steps between exchanges
    asynchronous : never wait for neighbours (staleness-weighted mixing)
    staleness : decay of stale messages (asynchronous only); None: :class:`Staleness`'s
        default, ``hinge:1,2``; see :mod:`gossip.mixing.staleness`
    overlap : a synchronous round travels while the next local steps compute
    clip : robust mixing radius, ``"auto"``, or None (synchronous uncompressed gossip only)
    outer : outer optimizer over the mixing, an :class:`~gossip.mixing.outer.OuterSpec` or its
        spec: ``sgd:lr=1`` (the default: plain gossip), ``nesterov:lr=0.7,momentum=0.9``
        (DiLoCo), ``noloco`` (see :mod:`gossip.mixing.outer`); ``,exchange=pseudograd``
        mixes compressed pseudo-gradients with error feedback instead of parameters
        (:mod:`gossip.mixing.pseudograd`), ``,fragments=F`` exchanges one of F parameter
        fragments per round (:mod:`gossip.mixing.fragments`)
    link_policy : per link class overrides, normalised to ``((class, LinkPolicy), ...)``;
        given as CLI strings (``"inter:period=20,codec=topk:0.01,async"``), a list of
        them, or a mapping ``{"inter": "period=20,..."}`` (see :mod:`gossip.mixing.policy`)

    Construction checks every value and every pairing (by building the rules once),
    so a bad combination fails here, before anything runs.
    """

    algorithm: str = "gossip"
    compression: Any = "none"
    gamma: float | str | None = None
    period: int = 1
    asynchronous: bool = False
    staleness: Staleness | Callable[[float], float] | None = None
    overlap: bool = False
    clip: float | str | None = None
    outer: OuterSpec = OuterSpec()
    link_policy: tuple[tuple[str, LinkPolicy], ...] = ()

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        if self.algorithm not in ALGORITHMS:
            raise OptionError("algorithm", f"algorithm: unknown algorithm {self.algorithm!r}; valid: {', '.join(ALGORITHMS)}")
        if isinstance(self.compression, str):
            try:
                get_codec(self.compression)
            except ValueError as e:
                raise OptionError("compression", f"compression {self.compression!r}: {e}") from None
        elif not isinstance(self.compression, Codec):
            raise OptionError("compression", f"compression must be a codec spec such as 'topk:0.01', "
                                             f"got {self.compression!r}")
        try:
            set_("gamma", parse_gamma(self.gamma))
        except ValueError as e:
            raise OptionError("gamma", str(e)) from None
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise OptionError("period", f"period must be a positive integer, got {self.period!r}")
        _bool("asynchronous", self.asynchronous)
        _bool("overlap", self.overlap)
        if self.staleness is not None:
            try:
                set_("staleness", parse_staleness(self.staleness))
            except ValueError as e:
                raise OptionError("staleness", f"staleness: {e}") from None
            if not self.asynchronous:
                raise OptionError("staleness", "staleness (a decay of stale messages) applies to asynchronous "
                                               "mixing only: set asynchronous (--async) too")
        set_("clip", parse_clip(self.clip))
        try:
            set_("outer", parse_outer(self.outer))
        except ValueError as e:
            raise OptionError("outer", str(e)) from None
        if isinstance(self.link_policy, tuple) and all(isinstance(p, tuple) and len(p) == 2
                                                       and isinstance(p[1], LinkPolicy) for p in self.link_policy):
            policies = dict(self.link_policy)
        else:
            policies = parse_link_policies(self.link_policy)
        set_("link_policy", tuple((c, policies[c]) for c in LINK_CLASSES if c in policies))
        build_rules(self)  # every rule this node would run, built once: a bad pairing fails now

    @property
    def policies(self) -> dict[str, LinkPolicy]:
        """The link policies by class (empty without)."""
        return dict(self.link_policy)

    @property
    def decay(self) -> Staleness | Callable[[float], float] | None:
        """The staleness decay asynchronous rules use (the default when none was given), None when synchronous."""
        return parse_staleness(self.staleness) if self.asynchronous else None

    def replace(self, **changes: Any) -> "MixingSettings":
        """A copy with some options changed (checked again)."""
        return dataclasses.replace(self, **changes) if changes else self

    def for_link(self, link: str) -> "MixingSettings":
        """The settings of one link class: its policy over the run's settings, without policies.

        Every option a policy leaves out is the run's, ``clip`` included (a policy
        may say ``clip=none``). A class that turns asynchronous without a decay of
        its own takes the run's decay if the run is asynchronous, else the default.
        """
        if link not in LINK_CLASSES:
            raise OptionError("link_policy", f"link_policy class must be one of {', '.join(LINK_CLASSES)}, "
                                             f"got {link!r}")
        pol = self.policies.get(link, LinkPolicy())
        is_async = self.asynchronous if pol.asynchronous is None else pol.asynchronous
        decay = pol.staleness if pol.staleness is not None else (self.staleness if is_async else None)
        clip = self.clip if pol.clip is None else (None if pol.clip == "none" else pol.clip)
        try:
            return MixingSettings(
                algorithm=pol.algorithm or self.algorithm, compression=pol.codec or self.compression,
                gamma=self.gamma if pol.gamma is None else pol.gamma, period=pol.period or self.period,
                asynchronous=is_async, staleness=decay, overlap=self.overlap, clip=clip,
                outer=self.outer if pol.outer is None else pol.outer)
        except ValueError as e:
            raise OptionError("link_policy", f"link_policy {link}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for summaries and JSON): specs as strings."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "link_policy":
                v = [f"{c}:{p}" for c, p in v]
            elif f.name == "compression" and isinstance(v, Codec):
                v = v.spec
            elif f.name in ("staleness", "outer") and v is not None:
                v = str(v)
            out[f.name] = v
        return out


#: The flat keyword arguments every config accepts for its ``mixing`` settings.
MIXING_OPTIONS = tuple(f.name for f in dataclasses.fields(MixingSettings))


def settings_from(base: MixingSettings | None, flat: Mapping[str, Any]) -> MixingSettings:
    """``base`` (or the defaults) with the flat options in ``flat`` applied."""
    if base is not None and not isinstance(base, MixingSettings):
        raise OptionError("mixing", f"mixing must be a MixingSettings, got {type(base).__name__}")
    if base is None:
        return MixingSettings(**flat)
    return base.replace(**flat)


def _older_options(kwargs: dict[str, Any], flat: dict[str, Any]) -> None:
    """The older form ``options={"gamma": 0.5, "clip": 1.0}``, merged under the flat keywords."""
    if "options" not in kwargs:
        return
    extra = dict(kwargs.pop("options") or {})
    unknown = sorted(set(extra) - set(MIXING_OPTIONS))
    if unknown:
        raise OptionError("options", f"options: unknown mixing option(s) {', '.join(map(repr, unknown))}; "
                                     f"valid: {', '.join(MIXING_OPTIONS)}")
    for k, v in extra.items():
        flat.setdefault(k, v)


with_mixing_options = flat_options("mixing", MIXING_OPTIONS, settings_from, before=_older_options)
"""Class decorator for a dataclass with a ``mixing: MixingSettings`` field.

Its constructor also takes the options of :class:`MixingSettings` as flat
keywords (``SimConfig(period=4, compression="int8")``), applied over
``mixing=`` (or the defaults) at construction, so the object only ever holds
one settings object; the flat names read back from it (``cfg.period``).
``dataclasses.replace(cfg, period=8)`` works the same way (see
:func:`gossip.core.options.flat_options`).
"""


def build_rules(settings: MixingSettings, topology: Any = None, *,
                sender_scale: float | None = None) -> tuple[MixingRule, dict[str, tuple[MixingRule, int]] | None]:
    """A node's mixing rules: ``(rule, None)``, or with link policies ``(first rule,
    {class: (rule, period)})`` for every link class (what :class:`gossip.training.node.Node` takes).

    The only place settings become rules. ``topology``, when given, is checked now
    (CHOCO needs a static graph, on every link class). ``sender_scale`` makes every
    rule of this node a :class:`~gossip.mixing.adversary.ScaledSender` (a misbehaving
    node of a robustness experiment), on every link class.
    """
    from gossip.mixing.adversary import ScaledSender
    from topologies import restrict_links

    def one(s: MixingSettings, graph: Any) -> MixingRule:
        if sender_scale is not None:
            return ScaledSender(sender_scale)
        spec = s.outer
        try:
            check_fragments(spec, algorithm=s.algorithm, asynchronous=s.asynchronous)
            if spec.exchange == "pseudograd":
                check_pseudograd(spec, algorithm=s.algorithm, asynchronous=s.asynchronous, gamma=s.gamma,
                                 clip=s.clip, topology=graph)
        except ValueError as e:
            raise OptionError("outer", str(e)) from None
        if spec.fragments > 1:  # one rule per fragment, each as the settings make it without fragments
            part = s.replace(outer=dataclasses.replace(spec, fragments=1))
            return FragmentRule(lambda: one(part, graph), spec.fragments)  # type: ignore[return-value]
        if spec.exchange == "pseudograd":  # the compressed pseudo-gradients are what is mixed
            return PseudoGradientRule(s.compression, spec)  # type: ignore[return-value]
        rule = make_rule(s.algorithm, s.compression, gamma=s.gamma, topology=topology, asynchronous=s.asynchronous,
                         staleness=s.staleness, clip=s.clip)
        if spec.is_identity:
            return rule  # plain gossip: exactly the rule itself
        try:
            check_outer_pairing(spec, s.algorithm, topology)
        except ValueError as e:
            raise OptionError("outer", str(e)) from None
        return OuterRule(rule, spec)  # type: ignore[return-value]

    if not settings.link_policy:
        return one(settings, topology), None
    per_class = {}
    for link in LINK_CLASSES:
        s = settings.for_link(link)
        try:
            # the graph a link class's rule mixes over: only that class's edges
            graph = None if topology is None or s.outer.exchange != "pseudograd" else restrict_links(topology, link)
            per_class[link] = (one(s, graph), s.period)
        except ValueError as e:  # a pairing only this class has (CHOCO on a time-varying graph, ...)
            raise OptionError("link_policy", f"link_policy {link}: {e}") from None
    return per_class[LINK_CLASSES[0]][0], per_class

"""Link policies: a mixing rule per class of link.

Inside a datacenter links are fast, across datacenters slow, so each class may
get its own period, codec and sync/async choice. Example (the CLI syntax)::

    --link-policy inter:period=20,codec=topk:0.01,async,staleness=poly:0.5

Classes without a policy use the run's own settings. A node then has two
channels (see :class:`gossip.node.Channel`), one per class, each mixing over
its own links on its own schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from gossip.mixing.base import MixingRule

__all__ = ["LinkPolicy", "parse_link_policies", "build_policies", "LINK_CLASSES"]

LINK_CLASSES = ("intra", "inter")
_KEYS = ("period", "codec", "algorithm", "gamma", "staleness")
_FLAGS = ("async", "sync")


@dataclass(frozen=True)
class LinkPolicy:
    """What one class of links does; None fields take the run's settings."""

    period: int | None = None
    codec: str | None = None
    algorithm: str | None = None
    gamma: Any = None
    asynchronous: bool | None = None
    staleness: str | None = None


def _parse_one(spec: str) -> tuple[str, LinkPolicy]:
    cls, sep, rest = spec.strip().partition(":")
    if not sep or cls not in LINK_CLASSES:
        raise ValueError(f"link policy {spec!r}: expected CLASS:OPTIONS with CLASS intra or inter, "
                         "e.g. inter:period=20,codec=topk:0.01,async")
    fields: dict[str, Any] = {}
    for item in filter(None, (i.strip() for i in rest.split(","))):
        if item in _FLAGS:
            fields["asynchronous"] = item == "async"
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _KEYS:
            raise ValueError(f"link policy {spec!r}: bad option {item!r}; valid: "
                             f"{', '.join(k + '=...' for k in _KEYS)}, {', '.join(_FLAGS)}")
        value = value.strip()
        if key == "period":
            try:
                fields["period"] = int(value)
            except ValueError:
                raise ValueError(f"link policy {spec!r}: period must be an integer") from None
            if fields["period"] < 1:
                raise ValueError(f"link policy {spec!r}: period must be >= 1")
        elif key == "gamma":
            fields["gamma"] = value if value == "auto" else float(value)
        else:
            fields[key] = value
    return cls, LinkPolicy(**fields)


def parse_link_policies(specs: Any) -> dict[str, LinkPolicy]:
    """Parse policies from CLI strings, a mapping {class: spec or LinkPolicy}, or None."""
    if not specs:
        return {}
    out: dict[str, LinkPolicy] = {}
    if isinstance(specs, Mapping):
        for cls, spec in specs.items():
            if isinstance(spec, LinkPolicy):
                if cls not in LINK_CLASSES:
                    raise ValueError(f"link policy class must be intra or inter, got {cls!r}")
                out[cls] = spec
            else:
                c, pol = _parse_one(f"{cls}:{spec}")
                out[c] = pol
        return out
    for spec in ([specs] if isinstance(specs, str) else specs):
        cls, pol = _parse_one(spec)
        if cls in out:
            raise ValueError(f"two link policies for {cls!r} links")
        out[cls] = pol
    return out


def build_policies(policies: Mapping[str, LinkPolicy], *, algorithm: str, codec: str, period: int,
                   gamma: Any = None, asynchronous: bool = False, staleness: Any = None,
                   topology: Any = None) -> dict[str, tuple[MixingRule, int]] | None:
    """One (rule, period) per link class for a node, or None without policies."""
    if not policies:
        return None
    from gossip.mixing import make_rule

    out = {}
    for cls in LINK_CLASSES:
        pol = policies.get(cls, LinkPolicy())
        is_async = asynchronous if pol.asynchronous is None else pol.asynchronous
        decay = pol.staleness if pol.staleness is not None else (staleness if is_async else None)
        rule = make_rule(pol.algorithm or algorithm, pol.codec or codec,
                         gamma=pol.gamma if pol.gamma is not None else gamma, asynchronous=is_async,
                         staleness=decay if is_async else None, topology=None)
        out[cls] = (rule, pol.period or period)
    return out

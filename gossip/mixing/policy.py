"""Link policies: a mixing rule per class of link.

Inside a datacenter links are fast, across datacenters slow, so each class may
get its own period, codec and sync/async choice. Example (the CLI syntax)::

    --link-policy inter:period=20,codec=topk:0.01,async,staleness=poly:0.5

Options a policy leaves out are the run's own (``clip`` included; ``clip=none``
turns it off for one class); classes without a policy use the run's settings.
:func:`gossip.mixing.settings.build_rules` turns them into rules. A node then has two
channels (see :class:`gossip.training.node.Channel`), one per class, each mixing over
its own links on its own schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["LinkPolicy", "parse_link_policies", "LINK_CLASSES"]

LINK_CLASSES = ("intra", "inter")
_KEYS = ("period", "codec", "algorithm", "gamma", "staleness", "clip", "outer")
_ALIASES = {"compression": "codec"}
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
    clip: float | str | None = None  # a radius, "auto", or "none" (no clipping on this class)
    outer: Any = None                # an outer optimizer spec (gossip.mixing.outer), e.g. nesterov:lr=0.7,momentum=0.9

    def __str__(self) -> str:
        """The CLI form (without the class), e.g. ``period=20,codec=topk:0.01,async``."""
        parts = [f"{k}={getattr(self, k)}" for k in _KEYS if getattr(self, k) is not None]
        if self.asynchronous is not None:
            parts.append("async" if self.asynchronous else "sync")
        return ",".join(parts)


def _parse_one(spec: str) -> tuple[str, LinkPolicy]:
    cls, sep, rest = spec.strip().partition(":")
    if not sep or cls not in LINK_CLASSES:
        raise ValueError(f"link policy {spec!r}: expected CLASS:OPTIONS with CLASS intra or inter, "
                         "e.g. inter:period=20,codec=topk:0.01,async")
    fields: dict[str, Any] = {}
    last = None
    for item in filter(None, (i.strip() for i in rest.split(","))):
        if item in _FLAGS:
            fields["asynchronous"] = item == "async"
            last = None
            continue
        key, eq, value = item.partition("=")
        key = _ALIASES.get(key.strip(), key.strip())
        if last == "outer" and eq and key not in _KEYS:  # outer=nesterov:lr=0.7,momentum=0.9: its own commas
            fields["outer"] = f"{fields['outer']},{item}"
            continue
        last = key
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
            try:
                fields["gamma"] = value if value == "auto" else float(value)
            except ValueError:
                raise ValueError(f"link policy {spec!r}: gamma must be a number in (0, 1] or 'auto'") from None
        elif key == "outer":
            fields["outer"] = value  # parsed below, with the options that follow it
        elif key == "clip":
            if value not in ("auto", "none"):
                try:
                    fields["clip"] = float(value)
                except ValueError:
                    raise ValueError(f"link policy {spec!r}: clip must be a radius, 'auto' or 'none'") from None
                continue
            fields["clip"] = value
        else:
            fields[key] = value
    if "outer" in fields:
        from gossip.mixing.outer import parse_outer

        try:
            fields["outer"] = parse_outer(fields["outer"])  # with the options that followed it
        except ValueError as e:
            raise ValueError(f"link policy {spec!r}: {e}") from None
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

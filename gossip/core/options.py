"""Settings objects held whole, given flat: the one mechanism behind ``mixing=`` and ``timing=``.

A configuration dataclass (``SimConfig``, ``PeerConfig``) holds each group of
options as one frozen settings object (:class:`~gossip.mixing.settings.MixingSettings`,
:class:`~gossip.protocol.timing.Timing`), checked once when it is made. For
convenience its constructor also takes that object's fields as flat keywords
(``PeerConfig(listen=..., period=4, dead_after=2.0)``), applied over the object
given (or the defaults), and reads them back flat (``cfg.dead_after``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

__all__ = ["flat_options"]


def flat_options(field: str, names: tuple[str, ...], make: Callable[[Any, Mapping[str, Any]], Any],
                 *, before: Callable[[dict[str, Any], dict[str, Any]], None] | None = None) -> Callable[[type], type]:
    """A class decorator for a dataclass with a settings field ``field``.

    ``names`` are the settings' own fields, accepted flat by the constructor;
    ``make(given, flat)`` returns the settings object ``given`` (None: the
    defaults) with the flat values applied, raising ``ValueError`` naming a bad
    one. ``before(kwargs, flat)``, when given, may move further keywords into
    ``flat`` first (an older spelling). ``dataclasses.replace(cfg, dead_after=2)``
    works the same way, since it calls the constructor.
    """

    def decorate(cls: type) -> type:
        generated = cls.__init__
        own = {f.name for f in dataclasses.fields(cls)}
        clash = sorted(own.intersection(names))
        if clash:
            raise TypeError(f"{cls.__name__} has fields of its own named like {field} options: {clash}")

        @functools.wraps(generated)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            flat = {k: kwargs.pop(k) for k in names if k in kwargs}
            if before is not None:
                before(kwargs, flat)
            kwargs[field] = make(kwargs.get(field), flat)
            generated(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        for name in names:
            setattr(cls, name, property(lambda self, _n=name: getattr(getattr(self, field), _n),
                                        doc=f"``{field}.{name}``"))
        return cls

    return decorate

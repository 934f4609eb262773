"""Streaming DiLoCo's fragments: each exchange covers one part of the parameters, in turn.

``--outer SPEC,fragments=F``. The flat parameters are cut into F contiguous fragments of
(nearly) equal size; round r exchanges fragment ``r mod F`` only, with a rule of its own
(the rule, and outer optimizer, that the settings make without fragments: its own
anchor, momentum, CHOCO copies or residual, over that slice). A round's bytes are the
fragment's, about 1/F of the model's; every fragment still takes an outer step every F
exchanges, that is every F x H inner steps, and the fragments' steps are staggered, so
one round's traffic is spread over the period instead of coming all at once (Douillard
et al., 2025, "Streaming DiLoCo"; torchft's ``local_sgd`` fragments). With ``--overlap``
a fragment's round travels while the next H inner steps compute, as without fragments.

Which fragment a message carries follows from its round, so every node must number
rounds alike: synchronous rules only (asynchronous and push-sum mixing are refused by
:func:`check_fragments`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from gossip.core.message import Packet
from gossip.mixing.base import Inbox, MixReport

__all__ = ["FragmentRule", "check_fragments", "fragment_bounds"]


def fragment_bounds(numel: int, fragments: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``numel`` elements cut into ``fragments`` contiguous parts, sizes within one."""
    if fragments > numel:
        raise ValueError(f"outer: fragments={fragments} is more than the model's {numel} parameters")
    return [(f * numel // fragments, (f + 1) * numel // fragments) for f in range(fragments)]


def check_fragments(spec: Any, *, algorithm: str, asynchronous: bool) -> None:
    """Refuse fragments with a rule that does not number its rounds alike on every node."""
    if spec.fragments == 1:
        return
    forms = "valid: fragments=F with synchronous gossip or CHOCO (not asynchronous, not push-sum), or fragments=1"
    if asynchronous:
        raise ValueError(f"outer {spec}: fragments need synchronous rounds (a message's fragment is its round "
                         f"mod {spec.fragments}); {forms}")
    if algorithm == "push-sum":
        raise ValueError(f"outer {spec}: fragments cannot be used with push-sum (its mass is one scalar for the "
                         f"whole model); {forms}")


class FragmentRule:
    """F rules, one per fragment; round r is fragment ``r mod F``'s (see the module docstring).

    ``make()`` builds one fragment's rule. Each is handed a view of its slice of the
    parameters, so its in-place mixing writes the model itself.
    """

    synchronous = True

    def __init__(self, make: Callable[[], Any], fragments: int) -> None:
        self.rules = [make() for _ in range(fragments)]
        self.fragments = fragments
        self._bounds: list[tuple[int, int]] | None = None
        self._numel = 0
        self._overlap = False
        self.synchronous = all(r.synchronous for r in self.rules)

    @property
    def overlap(self) -> bool:
        return self._overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:  # set by the node on the rule it holds
        self._overlap = value
        for r in self.rules:
            r.overlap = value

    @property
    def sends_live(self) -> bool:
        return False

    @sends_live.setter
    def sends_live(self, value: bool) -> None:
        # a fragment is a view into the parameters; the rules snapshot what they send
        for r in self.rules:
            r.sends_live = False

    def __getattr__(self, name: str) -> Any:  # name, codec, clipped, ...: the first fragment's rule
        if name == "rules":
            raise AttributeError(name)
        return getattr(self.rules[0], name)

    def bounds(self, numel: int) -> list[tuple[int, int]]:
        if self._bounds is None or self._numel != numel:
            self._bounds, self._numel = fragment_bounds(numel, self.fragments), numel
        return self._bounds

    def _part(self, x: torch.Tensor, rnd: int) -> tuple[Any, torch.Tensor]:
        f = rnd % self.fragments
        lo, hi = self.bounds(x.numel())[f]
        return self.rules[f], x[lo:hi]

    def payload_numel(self, rnd: int, numel: int) -> int:
        """Elements a state message of round ``rnd`` carries (the node checks arriving ones against it)."""
        lo, hi = self.bounds(numel)[rnd % self.fragments]
        return hi - lo

    def outgoing(self, x: torch.Tensor, topology: Any, me: int, rnd: int) -> list[tuple[int, Packet]]:
        rule, part = self._part(x, rnd)
        return rule.outgoing(part, topology, me, rnd)

    def mix(self, x: torch.Tensor, inbox: Inbox, topology: Any, me: int, rnd: int, progress: int) -> MixReport:
        rule, part = self._part(x, rnd)
        return rule.mix(part, inbox, topology, me, rnd, progress)

    def ready(self, inbox: Inbox, topology: Any, me: int, rnd: int) -> bool:
        return self.rules[rnd % self.fragments].ready(inbox, topology, me, rnd)

    def expected_senders(self, topology: Any, me: int, rnd: int) -> list[int]:
        return self.rules[rnd % self.fragments].expected_senders(topology, me, rnd)

    def round_weights(self, topology: Any, me: int, rnd: int) -> Any:
        return self.rules[rnd % self.fragments].round_weights(topology, me, rnd)

    def on_adopt(self, x: torch.Tensor) -> None:
        for (lo, hi), r in zip(self.bounds(x.numel()), self.rules):
            r.on_adopt(x[lo:hi])

    def on_members_changed(self, old: Sequence[Any], new: Sequence[Any]) -> None:
        for r in self.rules:
            r.on_members_changed(old, new)

    def debiased(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def neighbor_models(self) -> dict[int, torch.Tensor]:
        """None: a message holds one fragment, not a model (no distance to measure)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"fragments": [r.state_dict() for r in self.rules]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = state.get("fragments")
        if not isinstance(parts, list) or len(parts) != self.fragments:
            raise ValueError(f"checkpoint holds {len(parts) if isinstance(parts, list) else 'no'} fragment states, "
                             f"this rule has fragments={self.fragments}")
        for r, st in zip(self.rules, parts):
            r.load_state_dict(st)

    def outer_state(self) -> dict[str, Any]:
        """The fragments' momenta as one vector over the model (zeros where a fragment has none yet);
        momentum None when no fragment has one."""
        states = [r.outer_state() or {} for r in self.rules]
        if self._bounds is None or all(st.get("momentum") is None for st in states):
            return {"momentum": None}
        out = torch.zeros(self._numel)
        for (lo, hi), st in zip(self._bounds, states):
            if st.get("momentum") is not None:
                out[lo:hi] = st["momentum"].detach().cpu()
        return {"momentum": out}

    def load_outer_state(self, state: dict[str, Any]) -> None:
        m = state.get("momentum")
        for (lo, hi), r in zip(self._bounds or [], self.rules):
            r.load_outer_state({"momentum": None if m is None else m[lo:hi].clone()})

    def report(self) -> dict[str, Any]:
        out = dict(self.rules[0].report())
        out["fragments"] = self.fragments
        if "outer_steps" in out:
            out["outer_steps"] = sum(r.report().get("outer_steps", 0) for r in self.rules)
        return out

"""The research entry point: :func:`simulate` runs one simulated training job.

>>> import gossip
>>> r = gossip.simulate(nodes=8, topology="ring", task="synthetic", steps=50)  # doctest: +SKIP
>>> r.summary["final_accuracy"]  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

from gossip.mixing.settings import MixingSettings
from gossip.sim.config import SimConfig
from gossip.sim.record import SimulationResult, average_params, consensus_distance
from gossip.sim.simulation import Simulation

__all__ = ["SimConfig", "MixingSettings", "Simulation", "SimulationResult", "simulate", "consensus_distance",
           "average_params"]


def simulate(config: SimConfig | None = None, *, out: str | Path | IO[str] | None = None,
             progress: bool | None = False, **overrides: Any) -> SimulationResult:
    """Run one simulated decentralized training job and return its results.

    Parameters
    ----------
    config : a :class:`SimConfig`; keyword ``overrides`` replace its fields
        (``simulate(nodes=16, topology="exponential")`` works without one)
    out : path or open file for JSON-lines metrics (one line per evaluation, then the summary)
    progress : draw a progress bar on stderr (None: only if stderr is a terminal)

    Examples
    --------
    >>> r = simulate(nodes=4, topology="ring", steps=20, task="synthetic")  # doctest: +SKIP
    >>> r.summary["final_accuracy"] > 0.5  # doctest: +SKIP
    True
    """
    with Simulation(config, out=out, progress=progress, **overrides) as sim:
        return sim.run().result()

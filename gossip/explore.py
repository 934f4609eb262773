"""``python -m gossip.explore``: the seeded explorer, which lives in :mod:`gossip.sim.explore`
(``python -m gossip.sim.explore`` is the same command, with the same flags)."""

from gossip.sim.explore import main

if __name__ == "__main__":
    raise SystemExit(main())

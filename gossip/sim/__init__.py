"""The simulator: the event engine on a virtual clock, its engines, simulated clusters, faults, exploration."""

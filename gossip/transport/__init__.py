"""How bytes move: the simulated network (virtual clock, link models) and ZeroMQ."""

"""A node made of a group of devices: torch.distributed inside, sharded gossip between groups."""

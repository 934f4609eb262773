"""Gossip inside the frameworks people train with: Hugging Face's Trainer
(:mod:`gossip.integrations.transformers`, ``pip install ".[hf]"``) and Lightning
(:mod:`gossip.integrations.lightning`, ``pip install ".[lightning]"``).

Each is a thin layer over :class:`gossip.GossipNode` (gossip/peer): it joins the
cluster right before the framework's training loop starts, shards the training data
the way the framework builds its sampler, counts the framework's optimizer steps,
hands the framework's optimizer and schedulers to the node (a joiner takes a
member's), and makes the framework's own resume agree with the cluster's step.
Nothing below this layer imports it.
"""

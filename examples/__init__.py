"""Runnable examples; each module also exposes a ``task`` usable as ``--task examples.NAME:task``.

Run one as a script from the repository root, e.g. ``python examples/image_classification.py --short``.
"""

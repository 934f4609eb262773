"""Node addresses: the ``HOST:PORT`` id every node is known by, its ZeroMQ endpoint,
and its form as a file name."""

from __future__ import annotations

import re

__all__ = ["parse_address", "endpoint", "node_file_name"]

_ADDR = re.compile(r"^(?:tcp://)?(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")
_UNSAFE_IN_NAMES = re.compile(r"[^A-Za-z0-9.\-]")


def node_file_name(node_id: str) -> str:
    """``node_id`` as a file or directory name (every character outside
    ``[A-Za-z0-9.-]`` becomes ``_``).

    >>> node_file_name("10.0.0.1:5555")
    '10.0.0.1_5555'
    """
    return _UNSAFE_IN_NAMES.sub("_", node_id)


def parse_address(text: str, what: str = "address") -> str:
    """Normalise ``HOST:PORT`` or ``tcp://HOST:PORT`` to ``HOST:PORT`` (the node id form)."""
    m = _ADDR.match(text.strip())
    if not m:
        raise ValueError(f"{what} {text!r} is not HOST:PORT or tcp://HOST:PORT")
    port = int(m.group(2))
    if not 0 < port < 65536:
        raise ValueError(f"{what} {text!r}: port must be in 1..65535")
    return f"{m.group(1)}:{port}"


def endpoint(node_id: str) -> str:
    """The ZeroMQ endpoint of a node id."""
    return f"tcp://{node_id}"

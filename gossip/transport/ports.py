"""Free loopback ports for nodes started on one machine (tests, examples, benchmarks).

A port handed out here is bound later by another process (a ``gossip-node``
told ``--listen`` before it starts), so between the check and the bind it is
free for anyone. The usual trick, binding port 0 and closing the socket, draws
from the kernel's *ephemeral* range, the range every outgoing connection takes
its source port from: on a busy machine a node connecting to its neighbours
can take the port a node yet to start was promised, and that node fails with
"already in use". Ports here come from just below the ephemeral range, where
the kernel never puts an outgoing connection, each one checked bindable and
none handed out twice by one process.
"""

from __future__ import annotations

import os
import random
import socket
import threading

_SPAN = 16384  # how many ports below the ephemeral range to draw from
_given: set[int] = set()
_lock = threading.Lock()
_rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux reads it
    from /proc; elsewhere the IANA range that macOS and Windows use)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int, consecutive: bool = False, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that are free now, outside the ephemeral range and
    not given before by this process; with ``consecutive``, a run P .. P+n-1
    (a device group's ranks listen on its base port plus the rank)."""
    if n < 1:
        raise ValueError(f"free_ports: n must be at least 1, not {n}")
    lo, _ = ephemeral_range()
    first = max(1024, lo - _SPAN)
    if lo - first < 4 * n:  # the ephemeral range reaches down to 1024: nothing is outside it
        return _from_kernel(n, consecutive, host)
    with _lock:
        picked: list[int] = []
        for _ in range(1000 + 4 * n):
            if consecutive:
                base = _rng.randrange(first, lo - n + 1)
                picked = list(range(base, base + n))
                if _given.intersection(picked) or not all(_bindable(p, host) for p in picked):
                    continue
            else:
                p = _rng.randrange(first, lo)
                if p in _given or p in picked or not _bindable(p, host):
                    continue
                picked.append(p)
                if len(picked) < n:
                    continue
            _given.update(picked)
            return picked
    raise RuntimeError(f"no {n} free ports in {first}..{lo - 1}")


def free_port(host: str = "127.0.0.1") -> int:
    """One port, as :func:`free_ports`."""
    return free_ports(1, host=host)[0]


def _from_kernel(n: int, consecutive: bool, host: str) -> list[int]:
    """The fallback where no port lies outside the ephemeral range: the kernel's pick."""
    for _ in range(200):
        socks = [socket.socket() for _ in range(1 if consecutive else n)]
        try:
            for s in socks:
                s.bind((host, 0))
            ports = [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
        if consecutive:
            ports = list(range(ports[0], ports[0] + n))
            if ports[-1] > 65535 or not all(_bindable(p, host) for p in ports):
                continue
        with _lock:
            if not _given.intersection(ports):
                _given.update(ports)
                return ports
    raise RuntimeError(f"no {n} free ports")

"""gossip.transport.ports: ports promised to nodes that start later stay clear of the
kernel's ephemeral range, so an outgoing connection cannot take one first."""

from __future__ import annotations

import socket

import pytest

from gossip.transport import ports


def test_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    lo, _ = ports.ephemeral_range()
    got = ports.free_ports(50) + [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 100
    if lo - 1024 >= 200:  # an ephemeral range that leaves room below it (every usual kernel setting)
        assert all(1024 <= p < lo for p in got), [p for p in got if not 1024 <= p < lo]


def test_a_consecutive_run_is_bindable_and_a_port_in_use_is_never_given(monkeypatch):
    run = ports.free_ports(4, consecutive=True)
    assert run == list(range(run[0], run[0] + 4))
    for p in run:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    # every port but one of a tiny range is taken: that one is what comes back
    lo, _ = ports.ephemeral_range()
    if lo - 8 < 1024 + 32:
        pytest.skip("the ephemeral range leaves no room below it")
    monkeypatch.setattr(ports, "_SPAN", 8)
    monkeypatch.setattr(ports, "_given", set())
    held = []
    try:
        for p in range(lo - 8, lo - 1):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", p))
            except OSError:  # in use already: taken all the same
                s.close()
                continue
            held.append(s)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", lo - 1))
            except OSError:
                pytest.skip(f"port {lo - 1} is in use on this machine")
        assert ports.free_ports(1) == [lo - 1]
        with pytest.raises(RuntimeError, match="no 1 free ports"):  # given once: never again
            ports.free_ports(1)
    finally:
        for s in held:
            s.close()


def test_n_below_one_is_refused():
    with pytest.raises(ValueError, match="n must be at least 1"):
        ports.free_ports(0)

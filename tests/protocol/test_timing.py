"""The protocol's one timing object: defaults written once, checked once, passed explicitly."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from gossip.core.message import Message
from gossip.protocol.config import PeerConfig
from gossip.protocol.control import ControlPlane
from gossip.protocol.membership import Membership
from gossip.protocol.timing import TIMING_OPTIONS, Timing

FP = "fp"


def test_the_defaults_are_the_flags_and_the_config_defaults():
    from gossip.cli import build_node_parser, build_sim_parser

    t = Timing()
    args = build_node_parser().parse_args(["--listen", "tcp://127.0.0.1:7000"])
    assert (args.heartbeat, args.dead_after, args.settle, args.join_timeout, args.join_margin, args.grace) == \
        (t.heartbeat, t.dead_after, t.settle, t.join_timeout, t.join_margin, t.grace)
    assert build_sim_parser().parse_args([]).detect == t.dead_after
    cfg = PeerConfig(listen="127.0.0.1:7000")
    assert cfg.timing == t and all(getattr(cfg, k) == getattr(t, k) for k in TIMING_OPTIONS)


def test_flat_keywords_become_one_timing_and_read_back_flat():
    cfg = PeerConfig(listen="127.0.0.1:7000", dead_after=2.0, heartbeat=0.25)
    assert cfg.timing == Timing(heartbeat=0.25, dead_after=2.0) and cfg.dead_after == 2.0
    over = PeerConfig(listen="127.0.0.1:7000", timing=Timing.fast(), join_margin=7)
    assert over.timing == Timing.fast().replace(join_margin=7)  # flat values over the object given
    assert dataclasses.replace(over, grace=1.0).timing == over.timing.replace(grace=1.0)


@pytest.mark.parametrize("kw,needle", [
    (dict(heartbeat=3.0, dead_after=2.0), "heartbeat (3 s) must be shorter than dead_after (2 s)"),
    (dict(heartbeat=1.0, dead_after=1.0), "heartbeat (1 s) must be shorter than dead_after (1 s)"),
    (dict(dead_after=0), "dead_after must be a positive number of seconds, got 0"),
    (dict(settle=-1), "settle must be a number >= 0, got -1"),
    (dict(join_margin=1.5), "join_margin must be a non-negative integer, got 1.5"),
    (dict(heartbeat=float("nan")), "heartbeat must be a positive number of seconds, got nan"),
])
def test_a_bad_timing_is_refused_naming_it(kw, needle):
    with pytest.raises(ValueError) as e:
        Timing(**kw)
    assert needle in str(e.value)
    with pytest.raises(ValueError) as e:
        PeerConfig(listen="127.0.0.1:7000", **kw)
    assert needle in str(e.value)


def test_gossip_node_refuses_a_heartbeat_not_below_dead_after(capsys):
    from gossip.cli import node_main

    assert node_main(["--listen", "tcp://127.0.0.1:7000", "--heartbeat", "3", "--dead-after", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "heartbeat (3 s) must be shorter than dead_after (2 s)" in err[0]


def test_the_simulator_refuses_a_detect_that_its_fault_runs_could_not_use():
    from gossip.sim.config import SimConfig

    with pytest.raises(ValueError, match="detect must be a positive number of seconds"):
        SimConfig(detect=0)
    t = Timing.from_detect(0.4, 0.01)
    assert (t.dead_after, t.heartbeat, t.settle, t.grace, t.join_timeout, t.join_margin) == (0.4, 0.1, 0.1, 1.0, 8.0, 10)
    assert Timing.from_detect(3.0, 0.01).join_margin == Timing().join_margin  # capped at the default


def test_every_part_reads_the_one_timing_it_was_given():
    from gossip.protocol.lifecycle import Lifecycle

    cfg = PeerConfig(listen="127.0.0.1:7000", timing=Timing(heartbeat=0.2, dead_after=1.5, join_margin=3))
    life = Lifecycle(cfg, task=None, device=None, fingerprint=FP, incarnation=1, send=lambda d, m: None,
                     reconnect=lambda p: None, new_incarnation=lambda i: i + 1)
    assert life.membership.timing is cfg.timing and life.control.timing is cfg.timing
    assert life.control.detector.timing is cfg.timing
    assert life.control.detector.options.period == 0.2  # SWIM's period is the heartbeat


def test_the_control_plane_sends_only_through_its_shell():
    """Sans-IO: handling a message, a tick and every command return effects; nothing
    reaches the transport until ``apply`` carries them out."""
    a, b, c = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    sent: list[tuple[str, str]] = []
    m = Membership(a, 1, FP, timing=Timing(dead_after=2.0))
    cp = ControlPlane(a, 1, FP, "", m, threading.RLock(), lambda d, msg: sent.append((d, msg.kind)),
                      lambda msg: None, lambda: ("training", 10, 10), timing=m.timing, seeds=(c,),
                      detector="heartbeat")
    m.training = True
    hello = Message("hello", b, 10, 10, 0, None, None, {"inc": 1, "status": "training"}, FP)
    effects = [cp.handle(hello, 0.1), cp.tick(0.6), cp.hello_all([b]), cp.announce_status(),
               cp.announce_members(), cp.goodbye("done")]
    assert sent == []
    for fx in effects:
        cp.apply(fx)
    kinds = [k for _, k in sent]
    assert kinds.count("hello") == 2 and "bye" in kinds and "ping" in kinds and "members" in kinds
    dead = []
    for k in range(7, 40):  # ticks every 0.1 s: b stays silent past dead_after
        sent.clear()
        fx = cp.tick(k / 10)
        assert sent == []
        cp.apply(fx)
        dead += fx.dead
    assert dead == [b] and b not in m.members  # declared dead by a tick, its connection can go

"""Synchronous rounds send the parameters themselves (no snapshot) over a
transport that holds what it sends, and never change them while a send is in
flight: the node waits for the transport to let go, or moves its parameters."""

from __future__ import annotations

import pytest
import torch

from gossip.core.actions import Release, Send
from gossip.core.buffers import Pieces
from gossip.mixing import make_rule
from gossip.training.node import Node, NodeConfig
from gossip.transport import wire
from tests.helpers import FrozenTask
from topologies import Topology, complete

DIM = 3 * 2**18 + 7  # float32: 3 MiB and a bit, so the payload travels as several chunk frames


def pair(live: bool = True, algorithm: str = "gossip") -> tuple[Node, Node]:
    topo = Topology(complete(2))
    nodes = []
    for i, name in enumerate(["a", "b"]):
        cfg = NodeConfig(steps=10, timeout=1.0, live_sends=live, release_wait=0.01)
        node = Node(name, ["a", "b"], topo, FrozenTask(DIM), make_rule(algorithm), cfg)
        node.state.flat.copy_(torch.randn(DIM, generator=torch.Generator().manual_seed(i)))
        nodes.append(node)
    return nodes[0], nodes[1]


def start_round(node: Node):
    """Run ``node``'s exchange up to its Send; return (program, that round's frames)."""
    program = node.exchange()
    action = next(program)
    assert type(action) is Send and len(action.messages) == 1
    frames = wire.encode(action.messages[0][1])
    return program, frames


def finish_round(program, release_wait: bool) -> list:
    """Advance ``program`` to its end, as a driver would; return the actions it yielded."""
    actions = []
    try:
        while True:
            action = program.send(0.0)
            actions.append(type(action))
            if type(action) is Release and release_wait:
                action.lease.wait(action.timeout)
            del action
    except StopIteration:
        return actions


def over_the_wire(frames: list) -> list:
    return [bytes(memoryview(f)) for f in frames]  # what the peer's kernel copies out


def test_a_round_sends_the_parameters_themselves_and_mixes_in_place_once_sent():
    a, b = pair()
    xa, xb = a.state.flat.clone(), b.state.flat.clone()
    ptr = a.state.flat.data_ptr()
    pa, fa = start_round(a)
    pb, fb = start_round(b)
    sent = fa[2]  # a chunk frame: a view of a's live parameters, no snapshot
    assert torch.frombuffer(sent, dtype=torch.uint8).data_ptr() == ptr
    del sent
    wa, wb = over_the_wire(fa), over_the_wire(fb)
    del fa, fb  # the transport is done with both sends
    assert b.deliver(wire.decode(wa)) and a.deliver(wire.decode(wb))
    assert type(b.inbox.queues[0][0].tensor) is Pieces  # checked where it arrived, not joined
    assert finish_round(pa, True) == [] and finish_round(pb, True) == []
    assert a.held_sends == 0 and b.held_sends == 0
    assert a.state.flat.data_ptr() == ptr  # mixed in place
    assert torch.equal(a.state.flat, torch.lerp(xa, xb, 0.5)) and torch.equal(b.state.flat, torch.lerp(xb, xa, 0.5))


def test_a_send_still_in_flight_at_mixing_time_keeps_what_it_sends():
    a, b = pair()
    xa, xb = a.state.flat.clone(), b.state.flat.clone()
    pa, fa = start_round(a)  # a's frames stay held, as by a slow link
    pb, fb = start_round(b)
    wb = over_the_wire(fb)
    del fb
    assert a.deliver(wire.decode(wb))
    assert finish_round(pa, True) == [Release]  # it waited for the transport, in vain
    assert a.held_sends == 1
    assert torch.equal(a.state.flat, torch.lerp(xa, xb, 0.5))  # the mix went to fresh memory
    assert a.state.is_bound()
    # ... and the message still on its way carries the parameters as they were sent
    assert b.deliver(wire.decode(over_the_wire(fa)))
    finish_round(pb, True)
    assert torch.equal(b.state.flat, torch.lerp(xb, xa, 0.5))
    # the next round's local step and send start from the moved parameters
    a.local_step()
    assert a.state.is_bound() and torch.equal(a.state.flat, torch.lerp(xa, xb, 0.5))


@pytest.mark.parametrize("algorithm", ["gossip", "push-sum"])
def test_live_and_snapshot_sends_mix_to_the_same_numbers(algorithm):
    results = []
    for live in (True, False):
        a, b = pair(live, algorithm)
        for _ in range(3):
            pa, fa = start_round(a)
            pb, fb = start_round(b)
            wa, wb = over_the_wire(fa), over_the_wire(fb)
            del fa, fb
            a.deliver(wire.decode(wb))
            b.deliver(wire.decode(wa))
            finish_round(pa, True)
            finish_round(pb, True)
        results.append((a.state.flat.clone(), b.state.flat.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_non_finite_payload_in_a_later_frame_is_rejected_before_mixing():
    a, b = pair()
    xa = a.state.flat.clone()
    pa, fa = start_round(a)
    pb, fb = start_round(b)
    wb = [bytearray(f) for f in over_the_wire(fb)]
    del fa, fb
    wb[-1][:4] = torch.tensor([float("inf")]).numpy().tobytes()  # first value of the last frame
    assert not a.deliver(wire.decode(wb)) and a.rejected["nonfinite"] == 1
    finish_round(pa, True)  # the round times out without b: nothing to mix
    assert torch.equal(a.state.flat, xa)


def test_asynchronous_and_overlapped_rounds_still_send_snapshots():
    topo = Topology(complete(2))
    for rule, overlap in ((make_rule("gossip", asynchronous=True), False), (make_rule("gossip"), True)):
        cfg = NodeConfig(steps=10, live_sends=True, overlap=overlap)
        node = Node("a", ["a", "b"], topo, FrozenTask(DIM), rule, cfg)
        program = node.exchange()
        action = next(program)
        frames = wire.encode(action.messages[0][1])
        assert torch.frombuffer(frames[2], dtype=torch.uint8).data_ptr() != node.state.flat.data_ptr()
        assert node._lease is None

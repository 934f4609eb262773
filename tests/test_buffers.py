"""Pooled send snapshots and receive joins: reused only once nothing views them."""

from __future__ import annotations

import gc

import pytest
import torch

from gossip import wire
from gossip.buffers import POOL_MIN, BufferPool, pool, pooled_copy
from gossip.compression import get_codec
from gossip.message import Message

BIG = POOL_MIN // 4 * 3  # float32 values: 3 MiB, pooled


def test_pooled_copy_is_an_independent_copy():
    x = torch.randn(BIG)
    snap = pooled_copy(x)
    assert torch.equal(snap, x) and snap.data_ptr() != x.data_ptr()
    x.add_(1.0)
    assert not torch.equal(snap, x)  # training on x does not reach the sent snapshot


def test_block_is_reused_once_released():
    x = torch.randn(BIG)
    first = pooled_copy(x)
    ptr = first.data_ptr()
    del first
    second = pooled_copy(x)
    assert second.data_ptr() == ptr  # the warm block again, not a fresh mapping
    assert torch.equal(second, x)


def test_block_in_flight_is_never_reused():
    x = torch.randn(BIG)
    snap = pooled_copy(x)
    frames = wire.encode(Message("state", "a:1", 1, 1, 1, get_codec("none").encode(snap), None, {}, "fp"))
    expected = bytes(frames[2])  # a chunk frame, a view of the snapshot as ZeroMQ would hold it
    ptr = snap.data_ptr()
    del snap
    gc.collect()
    other = pooled_copy(torch.zeros(BIG))
    assert other.data_ptr() != ptr  # the frames still view the first block
    assert bytes(frames[2]) == expected  # and what they carry is unchanged


def test_views_of_every_kind_keep_a_block_busy():
    p = BufferPool(keep=2)
    a = p.get(4096)
    view = torch.from_numpy(a).view(torch.float32)[10:20]  # a tensor view of a view
    del a
    b = p.get(4096)
    assert b.ctypes.data != view.data_ptr() - 40
    del view, b
    assert p.get(4096) is p.free[4096][0]  # both free again: the first comes back
    assert p.reused == 1


def test_keep_bounds_what_the_pool_holds():
    p = BufferPool(keep=2)
    held = [p.get(100) for _ in range(5)]
    assert len(held) == 5 and len(p.free[100]) == 2


def test_small_and_non_cpu_tensors_are_plain_clones():
    x = torch.randn(100)
    snap = pooled_copy(x)
    assert torch.equal(snap, x) and snap.data_ptr() != x.data_ptr()
    before = pool.reused
    pooled_copy(x)
    assert pool.reused == before
    y = torch.randn(BIG).to(torch.float64)[::2]  # strided: the copy is contiguous
    s = pooled_copy(y)
    assert s.is_contiguous() and torch.equal(s, y)


def test_joined_receive_buffers_are_reused():
    x = torch.randn(3 * wire.CHUNK // 4 + 5)  # several chunk frames
    frames = [bytes(memoryview(f)) for f in wire.encode(
        Message("state", "a:1", 1, 1, 1, get_codec("none").encode(x), None, {}, "fp"))]
    first = wire.decode(frames)
    addr = torch.frombuffer(first.data.buffers[0], dtype=torch.uint8).data_ptr()
    del first
    second = wire.decode(frames)
    assert torch.frombuffer(second.data.buffers[0], dtype=torch.uint8).data_ptr() == addr
    assert torch.equal(torch.frombuffer(second.data.buffers[0], dtype=torch.float32), x)


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "topk:0.01"])
def test_encode_state_payload_is_unaffected_by_training(spec):
    from gossip.mixing.gossip import GossipRule

    rule = GossipRule(codec=spec)
    x = torch.randn(BIG)
    enc = rule.encode_state(x)
    before = rule.codec.decode(enc)
    x.mul_(-3.0)  # the local steps that follow the send
    assert torch.equal(rule.codec.decode(enc), before)
    if spec == "none":
        assert enc.source is not None and enc.source.data_ptr() != x.data_ptr()  # a snapshot was taken
    else:
        assert enc.source is None  # the encoding is the copy: no snapshot beside it


def test_only_recent_sizes_are_kept():
    """A peer sending ever new sizes cannot make the pool keep a block of each."""
    p = BufferPool(keep=4, sizes=3)
    model = p.get(1000)
    del model
    for n in range(2000, 2100):
        p.get(n)  # hostile sizes, each used once
        p.get(1000)  # the model's size stays in use
    assert len(p.free) == 3 and 1000 in p.free
    assert sum(len(v) for v in p.free.values()) <= 3

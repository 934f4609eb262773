"""Pooled send snapshots and receive joins: reused only once nothing views them."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from gossip.compression import get_codec
from gossip.core.buffers import (
    POOL_MIN,
    BufferPool,
    Chunked,
    Pieces,
    SendLease,
    pool,
    pooled_copy,
)
from gossip.core.message import Message
from gossip.mixing.base import all_finite, decode_payload
from gossip.transport import wire

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
    x = torch.randn(3 * wire.CHUNK // 2 + 5)  # fp16: several chunk frames, joined for the decoder
    frames = [bytes(memoryview(f)) for f in wire.encode(
        Message("state", "a:1", 1, 1, 1, get_codec("fp16").encode(x), None, {}, "fp"))]
    assert len(frames) > 3
    first = wire.decode(frames)
    addr = torch.frombuffer(first.data.buffers[0], dtype=torch.uint8).data_ptr()
    del first
    second = wire.decode(frames)
    assert torch.frombuffer(second.data.buffers[0], dtype=torch.uint8).data_ptr() == addr
    assert torch.equal(get_codec("fp16").decode(second.data), x.half().float())


def test_uncompressed_payload_is_read_where_it_arrived():
    x = torch.randn(3 * wire.CHUNK // 4 + 5)
    frames = [bytearray(memoryview(f)) for f in wire.encode(
        Message("state", "a:1", 1, 1, 1, get_codec("none").encode(x), None, {}, "fp"))]
    msg = wire.decode(frames)
    buf = msg.data.buffers[0]
    assert type(buf) is Chunked and buf.nbytes == x.numel() * 4 and msg.data.nbytes == x.numel() * 4
    pieces = decode_payload(msg, x, pieces=True)
    assert type(pieces) is Pieces and len(pieces.parts) == len(frames) - 2 and pieces.numel == x.numel()
    for (off, part), frame in zip(pieces, frames[2:]):
        assert part.data_ptr() == torch.frombuffer(frame, dtype=torch.uint8).data_ptr()  # no copy
        assert torch.equal(part, x[off:off + part.numel()])
    assert torch.equal(pieces.join(), x)
    assert torch.equal(decode_payload(msg, x), x)  # a joined tensor for consumers that need one
    frames[-1][-4:] = torch.tensor([float("nan")]).numpy().tobytes()  # the last value of the last frame
    assert all_finite(x) and not all_finite(decode_payload(wire.decode(frames), x, pieces=True))



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_is_exact(dtype):
    x = torch.randn(10_000).to(dtype)
    assert all_finite(x) and all_finite(torch.empty(0, dtype=dtype))
    big = torch.full((100,), torch.finfo(dtype).max, dtype=dtype)  # finite values whose sum overflows
    assert math.isinf(big.sum().item()) and all_finite(big) and all_finite(-big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1234] = bad
        assert not all_finite(y)
    y = x.clone()
    y[3], y[7] = float("inf"), float("-inf")  # opposite infinities: a NaN sum, still rejected
    assert not all_finite(y)
    assert not all_finite(torch.cat([big, torch.tensor([float("nan")], dtype=dtype)]))  # overflow and NaN


def test_a_received_payload_can_be_sent_on():
    x = torch.randn(3 * wire.CHUNK // 4 + 5)
    frames = [bytes(memoryview(f)) for f in wire.encode(
        Message("state", "a:1", 1, 1, 1, get_codec("none").encode(x), None, {}, "fp"))]
    again = wire.encode(wire.decode(frames))
    assert [bytes(memoryview(f)) for f in again] == frames


def test_frames_that_split_a_value_are_joined():
    x = torch.arange(6, dtype=torch.float32)
    raw = x.numpy().tobytes()
    chunked = Chunked([raw[:6], raw[6:]], len(raw))  # a boundary inside the second value
    assert chunked.pieces(torch.float32) is None
    assert torch.equal(torch.frombuffer(chunked.join(), dtype=torch.float32), x)


@pytest.mark.numeric
def test_weighted_sum_of_pieces_equals_the_joined_one():
    from gossip.mixing.gossip import weighted_sum_

    x, a, b = torch.randn(3, 1000)
    pa = Pieces([a[:300].clone(), a[300:700].clone(), a[700:].clone()])
    want = weighted_sum_(x.clone(), 0.5, [(0.3, a), (0.2, b)])
    got = weighted_sum_(x.clone(), 0.5, [(0.3, pa), (0.2, b)])
    assert torch.equal(got, want)


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


def test_send_lease_is_released_when_every_view_is_gone():
    x = torch.randn(BIG)
    lease = SendLease(x)
    assert lease.released()
    enc = get_codec("none").encode(lease.tensor())
    frames = wire.encode(Message("state", "a:1", 1, 1, 1, enc, None, {}, "fp"))
    del enc
    assert not lease.released() and not lease.wait(0.01)
    last = frames[-1]
    del frames
    assert not lease.released()  # one frame, as ZeroMQ would still hold it
    del last
    assert lease.released() and lease.wait(0.0)
    with pytest.raises(ValueError, match="contiguous CPU"):
        SendLease(x[::2])


def test_a_bfloat16_model_is_sent_in_place_too():
    x = torch.randn(BIG).to(torch.bfloat16)
    lease = SendLease(x)
    enc = get_codec("none").encode(lease.tensor())
    assert not lease.released() and enc.dtype == "bfloat16"
    assert torch.frombuffer(enc.buffers[0], dtype=torch.uint8).data_ptr() == x.data_ptr()
    assert torch.equal(get_codec("none").decode(enc), x)
    del enc
    assert lease.released()


def test_a_live_send_encodes_x_itself():
    from gossip.mixing.gossip import GossipRule

    rule = GossipRule()
    x = torch.randn(BIG)
    rule.sends_live = True
    assert rule.encode_state(x).source.data_ptr() == x.data_ptr()  # no snapshot
    rule.sends_live = False
    assert rule.encode_state(x).source.data_ptr() != x.data_ptr()


def test_rehome_moves_parameters_and_keeps_the_old_memory_for_its_readers():
    from torch import nn

    from gossip.core.state import FlatState

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    st = FlatState(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    old = st.flat
    sent = old.clone()
    st.rehome()
    assert st.is_bound() and st.flat.data_ptr() != old.data_ptr() and torch.equal(st.flat, sent)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()  # the optimizer built before the move updates the new memory
    assert torch.equal(old, sent) and not torch.equal(st.flat, sent)
    assert not torch.equal(model[1].running_mean, sent[-8:-4])  # the buffers moved too

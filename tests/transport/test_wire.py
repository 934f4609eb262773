"""The wire format: exact round trips, exact sizes, and a named reason for every bad input."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from gossip.compression import get_codec
from gossip.core.message import Message
from gossip.transport import wire


def state_message(values=None, codec="none", weight=None, extra=None):
    x = torch.arange(10, dtype=torch.float32) if values is None else values
    return Message("state", "10.0.0.1:5000", round=7, progress=42, seq=3, data=get_codec(codec).encode(x),
                   weight=weight, extra=extra or {}, fingerprint="abcd")


def frames_of(msg):
    return [bytes(memoryview(f)) for f in wire.encode(msg)]  # what a receiver gets: plain bytes


@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "int4", "int2:64", "topk:0.3", "randk:0.5", "sign"])
def test_state_round_trip_and_exact_size(codec):
    msg = state_message(torch.randn(257), codec=codec, weight=0.25, extra={"cseq": 5, "full": False})
    frames = frames_of(msg)
    assert wire.message_size(msg) == sum(len(f) for f in frames)
    back = wire.decode(frames)
    assert (back.kind, back.sender, back.round, back.progress, back.seq, back.weight, back.fingerprint) == \
        ("state", "10.0.0.1:5000", 7, 42, 3, 0.25, "abcd")
    assert back.extra == {"cseq": 5, "full": False}
    from gossip.compression import get_decoder

    torch.testing.assert_close(get_decoder(back.data.codec).decode(back.data),
                               get_decoder(msg.data.codec).decode(msg.data))


def test_control_message_round_trip():
    msg = Message("hello", "h:1", 0, 0, 0, None, None, {"inc": 9, "status": "waiting", "mids": ["a:1", "b:2"]}, "fp")
    back = wire.decode(frames_of(msg))
    assert back.kind == "hello" and back.extra["mids"] == ["a:1", "b:2"] and back.data is None


def test_a_member_table_of_thousands_travels_whole():
    """A start's or an anti-entropy exchange's member table lists every member: 4,097 at
    4,096 members and a joiner (a cap of 4,096 entries once rejected it as malformed).
    The header's byte cap bounds it; a list longer than MAX_LIST is still refused."""
    from gossip.protocol.control import parse_control

    ids = [f"10.0.{i >> 8}.{i & 255}:7000" for i in range(4097)]
    msg = Message("members", "h:1", 0, 0, 0, None, None,
                  {"inc": 9, "status": "training", "mids": ids, "mincs": list(range(1, 4098))}, "fp")
    back = wire.decode(frames_of(msg))
    assert back.extra["mids"] == ids and parse_control(back).mids == ids
    big = Message("members", "h:1", 0, 0, 0, None, None, {"inc": 9, "mincs": [1] * (wire.MAX_LIST + 1)}, "fp")
    with pytest.raises(wire.WireError, match="short list"):
        wire.decode(frames_of(big))


def test_decoded_ids_are_one_copy_and_the_sharing_is_bounded(monkeypatch):
    """Every member table keys the same ids: a simulated cluster of n holds n tables of n,
    so each decode of an id hands back one shared copy; a flood of new strings ends the
    sharing once MAX_SHARED are kept, and takes no more memory."""
    def ids_of():
        msg = Message("members", "h:1", 0, 0, 0, None, None, {"inc": 9, "mids": ["a:1", "b:2"], "digest": "d|e"},
                      "fp")
        back = wire.decode(frames_of(msg))
        return [back.sender, *back.extra["mids"]]

    first, again = ids_of(), ids_of()
    assert first == again and all(a is b for a, b in zip(first, again))
    assert "d|e" not in wire._SHARED  # a scalar (a digest changes with the table) is not kept
    monkeypatch.setattr(wire, "_SHARED", {})
    monkeypatch.setattr(wire, "MAX_SHARED", 2)
    first, again = ids_of(), ids_of()
    assert len(wire._SHARED) == 2 and first[2] == again[2] and first[2] is not again[2]


def test_tensor_frames_are_not_copied_on_encode():
    x = torch.arange(1000, dtype=torch.float32)
    frames = wire.encode(state_message(x))
    buf = memoryview(frames[2])
    assert torch.frombuffer(buf, dtype=torch.float32).data_ptr() == x.data_ptr()


def header(frames, **changes):
    h = msgpack.unpackb(frames[1], raw=False)
    for k, v in changes.items():
        if v is None:
            h.pop(k, None)
        else:
            h[k] = v
    return [frames[0], msgpack.packb(h, use_bin_type=True), *frames[2:]]


GOOD = frames_of(state_message())


@pytest.mark.parametrize("frames,reason", [
    ([GOOD[0]], "frames"),
    ([b"HTTP/1.1", *GOOD[1:]], "protocol"),
    ([b"GSP/4", *GOOD[1:]], "version"),
    ([GOOD[0], b"\xc1\xff\x00", *GOOD[2:]], "header"),
    ([GOOD[0], msgpack.packb([1, 2, 3]), *GOOD[2:]], "header"),
    ([GOOD[0], b"x" * (wire.MAX_HEADER + 1), *GOOD[2:]], "header"),
    (header(GOOD, kind="exploit"), "kind"),
    (header(GOOD, codec="zip"), "codec"),
    (header(GOOD, dtype="int64"), "dtype"),
    (header(GOOD, numel=2**40), "size"),
    (header(GOOD, numel=-1), "header"),
    (header(GOOD, seq=-5), "header"),
    (header(GOOD, round="7"), "header"),
    (header(GOOD, lens=[41]), "lengths"),
    (header(GOOD, lens=[40, 8]), "frames"),
    (GOOD + [b"extra"], "frames"),
    (header(GOOD, numel=11), "codec-data"),
    (header(GOOD, w=math.nan), "weight"),
    (header(GOOD, w=-1.0), "weight"),
    (header(GOOD, **{"from": ""}), "header"),
    (header(GOOD, x={"k": {"nested": 1}}), "header"),
    (header(GOOD, fp=123), "header"),
    ([GOOD[0], msgpack.packb({"kind": "ping", "from": "a:1"}), b"stray"], "frames"),
    ([GOOD[0], GOOD[1]] + [b""] * (wire.MAX_FRAMES), "frames"),
])
def test_every_bad_input_has_a_reason(frames, reason):
    with pytest.raises(wire.WireError) as e:
        wire.decode(frames)
    assert e.value.reason == reason


def test_version_error_names_both_versions():
    with pytest.raises(wire.WireError, match="GSP/4.*GSP/3"):
        wire.decode([b"GSP/4", *GOOD[1:]])


def test_random_garbage_only_ever_raises_wire_error():
    g = torch.Generator().manual_seed(0)
    for i in range(2000):
        n = int(torch.randint(0, 5, (1,), generator=g))
        frames = [bytes(torch.randint(0, 256, (int(torch.randint(0, 64, (1,), generator=g)),),
                                      generator=g, dtype=torch.uint8).tolist()) for _ in range(n)]
        if i % 3 == 0 and frames:
            frames[0] = wire.TAG
        with pytest.raises(wire.WireError):
            wire.decode(frames)


def test_large_buffers_travel_in_chunks_and_join_exactly():
    x = torch.randn(3 * wire.CHUNK // 4 + 12345)  # 3 chunks and a bit: 4 frames
    msg = state_message(x)
    frames = wire.encode(msg)
    assert len(frames) == 2 + 4 and all(memoryview(f).nbytes <= wire.CHUNK for f in frames[2:])
    assert wire.message_size(msg) == sum(memoryview(f).nbytes for f in frames)
    back = wire.decode([bytes(memoryview(f)) for f in frames])
    from gossip.compression import get_decoder

    assert torch.equal(get_decoder("identity").decode(back.data), x)


def test_chunk_frames_are_checked_one_by_one():
    frames = [bytes(memoryview(f)) for f in wire.encode(state_message(torch.randn(wire.CHUNK // 2)))]
    assert len(frames) == 2 + 2
    with pytest.raises(wire.WireError) as e:  # a chunk one byte short
        wire.decode([*frames[:2], frames[2][:-1], frames[3] + b"x"])
    assert e.value.reason == "lengths"
    with pytest.raises(wire.WireError) as e:  # a chunk missing
        wire.decode(frames[:3])
    assert e.value.reason == "frames"
    with pytest.raises(wire.WireError) as e:  # an absurd chunk size
        wire.decode(header(frames, chunk=7))
    assert e.value.reason == "header"


def test_claimed_sender_reads_only_a_gossip_header_with_a_string_sender():
    frames = wire.encode(Message("ping", "10.0.0.1:5555", 0, 0, 0, None, None, {}, "fp"))
    assert wire.claimed_sender(frames) == "10.0.0.1:5555"
    header = msgpack.unpackb(frames[1])
    for bad in ([], [wire.TAG], [wire.PREFIX + b"0", frames[1]], [wire.TAG, b"\xc1garbage"], [wire.TAG, msgpack.packb([1])],
                [wire.TAG, msgpack.packb({**header, "from": 7})], [wire.TAG, msgpack.packb({**header, "from": ""})],
                [wire.TAG, msgpack.packb({**header, "from": "x" * 257})],
                [wire.TAG, b"\x00" * (wire.MAX_HEADER + 1)]):
        assert wire.claimed_sender(bad) is None, bad

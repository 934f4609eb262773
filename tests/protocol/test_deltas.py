"""News of a change to the member table travels as a delta (gossip/protocol/control.py,
``ControlPlane._delta_messages``): the entries of the members that changed, not the whole
table; a receiver takes a delta's schedule entries only from a member its schedule counts."""

from __future__ import annotations

from gossip.protocol.control import DELTA_IDS

from tests.protocol.test_control import Plane

A, B, C, D, E = (f"10.0.0.{i}:1" for i in range(1, 6))


def _trainer(me: str, ids: list[str], rnd: int = 100) -> Plane:
    """A training member of a cluster that started with ``ids``, all heard at ``rnd``."""
    p = Plane(me, status="training", rnd=rnd)
    for x in ids:
        if x != me:
            p.m.heard(x, 1, 0.0, status="training", round=rnd)
    p.m.start(ids)
    return p


def _members(p: Plane, to: str) -> list:
    return [m for d, m in p.sent if d == to and m.kind == "members"]


def _fields(msg) -> dict:
    """A message's list fields, to be sent again by another node (``Plane.receive``)."""
    return {k: v for k, v in msg.extra.items() if k not in ("inc", "status", "dc", "seeding", "cseq")}


def test_a_join_is_told_to_the_members_as_a_delta_and_to_the_joiner_whole():
    a = _trainer(A, [A, B, C])
    a.receive("hello", D, status="waiting")  # a newcomer: A schedules its join
    join = a.m.joins[D]
    whole = [m for m in _members(a, D) if not m.extra.get("delta")]
    assert whole and sorted(whole[0].extra["base"]) == [A, B, C] and whole[0].extra["jids"] == [D]
    for x in (B, C):
        delta = _members(a, x)
        assert len(delta) == 1, delta
        e = delta[0].extra
        # only what changed: the joiner's row and its join, no base, no other member's row
        assert e["delta"] is True and "base" not in e
        assert e["mids"] == [D] and e["jids"] == [D] and e["jrounds"] == [join] and e["lids"] == []
        assert e["digest"] == a.m.digest()


def test_a_counted_member_s_delta_changes_the_schedule_and_what_was_news_goes_on_as_a_delta():
    a = _trainer(A, [A, B, C])
    a.receive("hello", D, status="waiting")
    delta = _fields(_members(a, B)[0])
    b = _trainer(B, [A, B, C])
    b.receive("members", A, status="training", rnd=100, **delta)
    assert b.m.joins == {D: a.m.joins[D]} and D in b.m.members
    assert b.m.digest() == a.m.digest()
    onward = [m for d, m in b.sent if m.kind == "members"]
    assert onward and all(m.extra.get("delta") and m.extra["mids"] == [D] for m in onward)
    # the same delta again is no news: nothing goes on
    b.sent.clear()
    b.receive("members", C, status="training", rnd=100, **delta)
    assert [m for _, m in b.sent if m.kind == "members"] == []


def test_a_delta_from_a_node_outside_the_schedule_changes_no_round():
    b = _trainer(B, [A, B, C])
    b.m.heard(E, 1, 0.0, status="training", round=100)  # alive, but not in B's schedule
    before = (dict(b.m.joins), dict(b.m.leaves))
    b.receive("members", E, status="training", rnd=100, delta=True, mids=[D], mincs=[1], mdcs=[""],
              jids=[D], jrounds=[120], lids=[C], lrounds=[110], jincs=[1], lincs=[1], digest="x")
    assert (b.m.joins, b.m.leaves) == before
    # the same entries from a member B counts take effect
    b.receive("members", A, status="training", rnd=100, delta=True, mids=[D], mincs=[1], mdcs=[""],
              jids=[D], jrounds=[120], lids=[C], lrounds=[110], jincs=[1], lincs=[1], digest="x")
    assert b.m.joins == {D: 120}
    assert C not in b.m.leaves  # (B heard C itself lately: one member's word is no death, as for whole lists)


def test_a_death_is_spread_as_a_delta_of_its_leave():
    a = _trainer(A, [A, B, C])
    t = 0.0
    while C in a.m.members:  # C falls silent; B keeps talking
        t += 0.5
        a.m.heard(B, 1, t, status="training", round=100)
        a.cp.apply(a.cp.tick(t))
    deltas = [m for _, m in a.sent if m.kind == "members"]
    assert deltas and all(m.extra.get("delta") for m in deltas)
    assert deltas[-1].extra["lids"] == [C] and deltas[-1].extra["mids"] == []


def test_a_large_change_travels_in_deltas_of_bounded_size():
    a = _trainer(A, [A, B])
    v = a.m.version
    many = [f"10.1.{i >> 8}.{i & 255}:1" for i in range(DELTA_IDS + 10)]
    a.m.merge([(x, 1) for x in many], 1.0)
    msgs = a.cp._delta_messages(v)
    assert [len(m.extra["mids"]) for m in msgs] == [DELTA_IDS, 10]
    assert sorted(x for m in msgs for x in m.extra["mids"]) == sorted(many)


def test_bad_delta_fields_are_refused_and_change_nothing():
    b = _trainer(B, [A, B, C])
    before = (b.m.version, b.m.digest())
    b.receive("members", A, status="training", rnd=100, delta="yes", mids=[D], mincs=[1], mdcs=[""])
    b.receive("members", A, status="training", rnd=100, delta=True, base=[A, B, D], mids=[D], mincs=[1], mdcs=[""])
    assert b.cp.rejected["control"] == 2
    assert (b.m.version, b.m.digest()) == before


def test_news_arriving_in_a_burst_is_spread_once_a_tick():
    b = _trainer(B, [A, B, C])
    for x in (A, C):
        b.m.heard(x, 1, 9.0, status="training", round=100)
    b.cp.apply(b.cp.tick(9.0))  # (its first tick: nothing to say yet)
    assert [m for _, m in b.sent if m.kind == "members"] == []
    b.cp.now = 10.0
    b.receive("members", A, status="training", rnd=100, delta=True, mids=[D], mincs=[1], mdcs=[""], digest="x")
    first = [m for _, m in b.sent if m.kind == "members"]
    assert first and all(m.extra["mids"] == [D] for m in first)  # the first news goes at once
    b.sent.clear()
    b.cp.now = 10.0 + b.m.timing.tick / 2  # more news within the same tick: held
    b.receive("members", A, status="training", rnd=100, delta=True, mids=[E], mincs=[1], mdcs=[""], digest="x")
    b.receive("members", C, status="training", rnd=100, delta=True, mids=["10.0.0.6:1"], mincs=[1], mdcs=[""],
              digest="x")
    assert [m for _, m in b.sent if m.kind == "members"] == []
    for x in (A, C):
        b.m.heard(x, 1, 10.0, status="training", round=100)
    b.cp.apply(b.cp.tick(10.0 + b.m.timing.tick))  # ... and spread by the next tick, in one delta
    later = [m for _, m in b.sent if m.kind == "members"]
    assert later and all(m.extra["mids"] == [E, "10.0.0.6:1"] for m in later)
    assert len(later) == min(b.m.timing.spread(len(b.m.members)), len(b.m.members) - 1)

"""gossip/protocol/group.py without processes: rank 0's decisions and news as JSON, the
addresses of a group's ranks, and a follower rank over its shard (``ShardFollower``)
driven by hand: its messages travel through the real wire encoding, in this process."""

from __future__ import annotations

import json

import pytest
import torch

from gossip.core.actions import Release, Send, Wait
from gossip.core.message import Message
from gossip.core.state import sha256_of
from gossip.mixing.base import decode_payload
from gossip.mixing.settings import MixingSettings
from gossip.protocol.errors import PeerError
from gossip.protocol.group import DECISIONS, HELD, Decision, News, ShardFollower, group_of, rank_address
from gossip.protocol.joining import ClusterFinished
from gossip.protocol.ranks import GroupFollow, GroupLead
from gossip.transport import wire

A, B, C = "127.0.0.1:7000", "127.0.0.1:7100", "127.0.0.1:7200"  # member ids: each group's rank 0
FP = "layout-of-rank-1"
N = 300  # values in one rank's shard


# -- decisions and news ------------------------------------------------------------------------

def test_a_decision_survives_json_with_every_field() -> None:
    d = Decision(7, "start", round=3, step=6, members=(A, B, C), dcs=("west", "", "east"), lives=(2, 0, 5),
                 handover=(C,), donor=B, donor_round=2, rank=1, world=3, origin=12.5)
    text = d.to_json()
    back = Decision.from_json(text)
    assert back == d
    assert back.members == (A, B, C) and isinstance(back.members, tuple)  # lists come back as tuples
    assert json.loads(text)["donor"] == B and Decision.from_json(text.encode()) == d  # bytes, as the store gives
    assert Decision.from_json(Decision(1, "exit").to_json()) == Decision(1, "exit")  # the defaults too
    stop = Decision(2, "exit", why="every member of the cluster it joins has finished training (x:1)", finished=True)
    assert Decision.from_json(stop.to_json()) == stop
    assert set(DECISIONS) == {"start", "go", "round", "stop", "life", "serve", "exit"}


@pytest.mark.parametrize("text,needle", [
    ('{"seq": 1, "kind": "maybe"}', "decision kind must be one of start, go, round, stop, life, serve, exit, "
                                    "got 'maybe'"),
    ('{"seq": -1, "kind": "round"}', "decision seq must be a non-negative integer, got -1"),
    ('{"seq": 1, "kind": "round", "round": 2.5}', "decision round must be a non-negative integer, got 2.5"),
    ('{"seq": 1, "kind": "round", "step": true}', "decision step must be a non-negative integer, got True"),
    ('{"seq": 1, "kind": "start", "world": "3"}', "decision world must be a non-negative integer, got '3'"),
    ('{"seq": 1, "kind": "start", "origin": "now"}', "decision origin must be a number, got 'now'"),
    ('{"seq": 1, "kind": "exit", "finished": "yes"}', "decision why must be text and finished true or false"),
    ('{"seq": 1, "kind": "exit", "why": 3}', "decision why must be text and finished true or false, got 3"),
    ('{"seq": 1, "kind": "round", "bogus": 1}', "a decision has unknown fields: ['bogus']"),
    ('{"seq": 1, "kind": "round", "members": "abc"}', "decision members must be a list of strings"),
    ('{"seq": 1, "kind": "round", "members": ["a:1", 2]}', "decision members must be a list of strings"),
    ('{"seq": 1, "kind": "round", "handover": [null]}', "decision handover must be a list of strings"),
    ('{"seq": 1, "kind": "round", "members": ["a:1"], "lives": [true]}', "decision lives must be a list of integers"),
    ('{"seq": 1, "kind": "round", "members": ["a:1"], "dcs": ["x", "y"]}', "labels go one per member"),
    ('{"seq": 1, "kind": "round", "members": ["a:1"], "lives": [1, 2]}', "lives go one per member"),
    ('{"kind": "round"}', "a decision needs its seq"),
    ('{"seq": 3}', "a decision needs its kind"),
    ('{"seq": 1, "kind": "start", "donor": 7}', "decision donor must be a member id or null, got 7"),
    ('{"seq": 1, "kind": "start", "donor_round": "2"}', "decision donor_round must be an integer >= -1, got '2'"),
    ('[1, "round"]', "a decision must be a JSON object"),
    ('{"seq": 1, "kind": ', "a decision must be JSON"),
    (b'\xff\xfe', "a decision must be JSON"),
])
def test_a_malformed_decision_is_refused_naming_what_is_wrong(text, needle) -> None:
    with pytest.raises(ValueError) as e:
        Decision.from_json(text)
    assert needle in str(e.value)


def test_news_survives_json_and_refuses_what_is_not_rank_0s() -> None:
    news = News(dead=((4, (B,)), (5, (B, C))), handovers=((3, C, 4, 9), (4, B, 5, 11)), known=((B, 2), (C, 7)))
    back = News.from_json(news.to_json())
    assert back == news and back.dead_in(5) == (B, C) and back.dead_in(6) == ()
    assert News.from_json("{}") == News()  # nothing published yet reads as no news
    for text, field in (('[1, 2]', "JSON object"), ('{"handovers": [[1, "x:1", 2]]}', "handovers"),
                        ('{"known": [["x:1", "two"]]}', "known"), ('{"dead": "abc"}', "dead"),
                        ('{"dead": ["x:1"]}', "dead"), ('{"dead": [[3, ["x:1", 7]]]}', "dead"), ("not json", "must be JSON")):
        with pytest.raises(ValueError, match=field):
            News.from_json(text)


# -- addresses -----------------------------------------------------------------------------------

def test_rank_r_of_a_group_listens_r_ports_above_its_member_id_and_back() -> None:
    assert rank_address("10.0.0.5:6000", 0) == "10.0.0.5:6000"
    assert rank_address("10.0.0.5:6000", 3) == "10.0.0.5:6003"
    assert rank_address("[::1]:6000", 2) == "[::1]:6002"  # the host may hold colons itself
    assert rank_address("h:65534", 1) == "h:65535"
    for r in range(4):
        assert group_of(rank_address(A, r), r) == A
    assert group_of("10.0.0.5:6003", 3) == "10.0.0.5:6000"
    assert group_of("10.0.0.5:6003", 1) == "10.0.0.5:6002"  # another rank's reading names another group


@pytest.mark.parametrize("call,needle", [
    (lambda: rank_address("h:65535", 1), "rank 1 would listen on port 65536, outside 1-65535"),
    (lambda: rank_address("nohost", 0), "group id must be HOST:PORT, got 'nohost'"),
    (lambda: rank_address(":6000", 1), "group id must be HOST:PORT, got ':6000'"),
    (lambda: rank_address("h:60a0", 1), "group id must be HOST:PORT, got 'h:60a0'"),
    (lambda: rank_address("h:-5", 0), "group id must be HOST:PORT"),
    (lambda: group_of("h:2", 3), "its group would listen on port -1"),
])
def test_an_address_that_cannot_be_a_ranks_is_refused(call, needle) -> None:
    with pytest.raises(ValueError) as e:
        call()
    assert needle in str(e.value)


# -- a follower, driven by hand -------------------------------------------------------------------

def _follower(group: str, value: float, rank: int = 1, **kwargs) -> ShardFollower:
    return ShardFollower(rank, group, torch.full((N,), value), FP, mixing=kwargs.pop("mixing", MixingSettings()),
                         timeout=5.0, **kwargs)


def _copy(msg: Message) -> Message:
    """``msg`` as the other side decodes it: encoded, the frames copied, decoded."""
    return wire.decode([bytes(memoryview(f)) for f in wire.encode(msg)])


class Exchange:
    """A follower's ``node.exchange()`` driven by hand: its sends are encoded and handed to
    ``deliver``; it stops at its round's wait, and :meth:`finish` runs it to the end."""

    def __init__(self, follower: ShardFollower, deliver) -> None:
        self.program = follower.node.exchange()
        self.deliver = deliver
        self.sent: list[tuple[str, Message]] = []
        self.waited = False
        self.done = False
        self._run(next(self.program))

    def _run(self, action) -> None:
        while True:
            if isinstance(action, Send):
                out = [(dst, _copy(m)) for dst, m in action.messages]
                del action  # the shard sent in place is let go here
                self.sent += out
                for dst, m in out:
                    self.deliver(dst, m)
            elif isinstance(action, Wait):
                self.waited = True
                return
            else:
                assert isinstance(action, Release)
                assert action.lease.released()
                del action
            try:
                action = self.program.send(0.0)
            except StopIteration:
                self.done = True
                return

    def finish(self) -> None:
        if not self.done:
            try:
                action = self.program.send(0.0)
            except StopIteration:
                self.done = True
                return
            self._run(action)
        assert self.done


def _pair(va: float = 0.0, vb: float = 2.0, step: int = 0):
    """Rank 1 of groups A and B, both started on the same decision; ``post`` delivers."""
    fa, fb = _follower(A, va), _follower(B, vb)
    by_id = {fa.id: fa, fb.id: fb}
    start = Decision(1, "start", round=step // 1, step=step, members=(A, B))
    for f in (fa, fb):
        f.apply(start)

    def post(dst: str, msg: Message) -> None:
        by_id[dst].handle(msg)

    return fa, fb, post


def test_a_follower_is_a_rank_above_0_and_listens_at_its_ranks_address() -> None:
    f = _follower(A, 0.0, rank=2)
    assert f.id == "127.0.0.1:7002" and f.status == "waiting" and f.node is None
    with pytest.raises(ValueError, match="a follower is rank 1 or above of its group, got rank 0"):
        _follower(A, 0.0, rank=0)


def test_a_start_decision_builds_the_shards_node_at_the_decided_step_and_members() -> None:
    f = _follower(B, 1.0, mixing=MixingSettings(period=2))
    f.apply(Decision(4, "start", round=3, step=6, members=(A, B, C)))
    node = f.node
    assert f.members == ("127.0.0.1:7001", "127.0.0.1:7101", "127.0.0.1:7201")  # rank 1 of each member
    assert node.members == list(f.members) and node.index == 1
    assert f.status == "training" and node.step == 6 and node.round == 3  # step 6 at period 2: round 3
    assert node.fingerprint == FP  # rank 1's layout, which every message must carry
    assert node.state.flat.data_ptr() == f.shard.data_ptr()  # the node mixes the shard in place
    joining = _follower(C, 1.0)
    joining.apply(Decision(1, "start", members=(A, B, C), donor=A, donor_round=3))
    assert joining.status == "waiting"  # a joining life trains once it holds its shard


def test_two_followers_mix_their_shards_over_the_wire() -> None:
    fa, fb, post = _pair(0.0, 2.0)
    ea = Exchange(fa, post)
    assert ea.waited and not ea.done  # a waits for b's round-0 shard
    assert fa.awaited_dead({B}) and not fa.awaited_dead({C}) and not fa.awaited_dead(set())
    eb = Exchange(fb, post)
    assert eb.done  # a's shard was in when b's round began
    ea.finish()
    assert [(dst, m.round, m.progress) for dst, m in ea.sent] == [("127.0.0.1:7101", 0, 0)]
    assert ea.sent[0][1].sender == fa.id and ea.sent[0][1].fingerprint == FP
    # a ring of two: half each (the shards are the model's memory: mixed in place)
    assert torch.equal(fa.shard, torch.full((N,), 1.0)) and torch.equal(fb.shard, torch.full((N,), 1.0))
    assert fa.node.round == fb.node.round == 1 and fa.node.mix_totals.mixed == 1
    assert not fa.awaited_dead({B})  # no longer waiting
    assert fa.rejected == {} and dict(fa.node.rejected) == {}


def test_a_round_decision_moves_the_round_forward_and_changes_the_members() -> None:
    fa, fb, post = _pair()
    fc = _follower(C, 8.0)
    for f in (fa, fb):
        f.apply(Decision(2, "round", round=5, step=5, members=(A, B)))
    assert fa.node.round == 0  # the round is taken at the next exchange ...
    ea = Exchange(fa, post)
    assert [m.round for _, m in ea.sent] == [5]  # ... which is round 5, not round 0
    Exchange(fb, post).finish()
    ea.finish()
    assert fa.node.round == 6
    # c joins: a and b take it from the next round's decision on
    fc.apply(Decision(1, "start", round=6, step=6, members=(A, B, C)))
    for f in (fa, fb):
        f.apply(Decision(3, "round", round=6, step=6, members=(A, B, C)))
    assert fa.members == ("127.0.0.1:7001", "127.0.0.1:7101", "127.0.0.1:7201") and fa.node.index == 0
    assert fc.node.members == fa.node.members  # every rank 1 holds one member list


def test_a_member_readmitted_or_in_a_new_life_numbers_its_messages_afresh() -> None:
    fa, fb, post = _pair()
    for _ in range(2):  # rounds 0 and 1: a holds b's sequence number 2
        ea = Exchange(fa, post)
        Exchange(fb, post).finish()
        ea.finish()
    b1 = "127.0.0.1:7101"
    assert fa.node.last_seq[b1] == 2
    fa.apply(Decision(3, "round", round=2, step=2, members=(A, B), lives=(1, 1)))
    assert fa.node.last_seq[b1] == 2 and fa.lives[b1] == 1  # first word of b's life: nothing to forget
    fa.apply(Decision(4, "round", round=2, step=2, members=(A, B), lives=(1, 2)))
    assert b1 not in fa.node.last_seq and fa.lives[b1] == 2  # b's new life numbers from 1 again
    fresh = _follower(B, 5.0)
    fresh.apply(Decision(1, "start", round=2, step=2, members=(A, B)))
    msg = Message("state", b1, 2, 2, 1, *_payload(fresh), fingerprint=FP)
    fa.handle(msg)
    assert fa.node.inbox.has_round(1, 2)  # seq 1 again, accepted: not a replay
    fa.apply(Decision(5, "round", round=3, step=3, members=(A,)))  # b left ...
    assert b1 not in fa.node.last_seq
    fa.handle(Message("state", b1, 3, 3, 1, *_payload(fresh), fingerprint=FP))
    assert fa.held[-1].sender == b1  # ... and a state of b's for round 3 is held, not mixed


def _payload(f: ShardFollower):
    from gossip.compression import get_codec

    return get_codec("none").encode(f.shard.clone()), 0.5


def test_state_from_a_member_not_decided_yet_or_for_a_start_not_made_yet_is_held_then_used() -> None:
    fa, fb, post = _pair(0.0, 2.0)
    fc = _follower(C, 8.0)
    fc.apply(Decision(1, "start", round=0, step=0, members=(A, B, C)))
    c1 = "127.0.0.1:7201"
    msg = Message("state", c1, 0, 0, 1, *_payload(fc), fingerprint=FP)
    fa.handle(_copy(msg))  # c's round 0, before a's rank 0 decided that c is a member
    assert [m.sender for m in fa.held] == [c1] and not fa.node.inbox.has_round(0, 0)
    fa.apply(Decision(2, "round", round=0, step=0, members=(A, B, C)))
    assert fa.held == [] and fa.node.inbox.has_round(fa.node.index_of[c1], 0)  # filed once decided
    # a rank that has no start yet holds everything, and files it at the start
    late = _follower(B, 4.0)
    late.handle(_copy(Message("state", "127.0.0.1:7001", 0, 0, 1, *_payload(fa), fingerprint=FP)))
    assert len(late.held) == 1 and late.node is None
    late.apply(Decision(1, "start", round=0, step=0, members=(A, B)))
    assert late.held == [] and late.node.inbox.has_round(0, 0)
    # a joining life holds state until it has its shard
    joining = _follower(C, 0.0)
    joining.apply(Decision(1, "start", members=(A, B, C), donor=A, donor_round=0))
    joining.handle(_copy(Message("state", "127.0.0.1:7001", 0, 0, 1, *_payload(fa), fingerprint=FP)))
    assert len(joining.held) == 1
    # held, but only a few: the latest rounds (a joining life hears every round from its
    # start to its first, and only its first round's messages are of use)
    for i in range(HELD + 5):
        joining.handle(_copy(Message("state", "127.0.0.1:7101", i, i, i + 1, *_payload(fb), fingerprint=FP)))
    assert len(joining.held) == HELD
    assert sorted(m.round for m in joining.held) == list(range(5, HELD + 5))
    joining.handle(_copy(Message("state", "127.0.0.1:7101", 2, 2, 3, *_payload(fb), fingerprint=FP)))  # older
    assert sorted(m.round for m in joining.held) == list(range(5, HELD + 5))


def test_what_a_follower_cannot_use_is_counted_by_reason() -> None:
    fa, fb, post = _pair()
    b1 = "127.0.0.1:7101"
    fa.handle(_copy(Message("state", b1, 0, 0, 1, *_payload(fb), fingerprint="another-layout")))
    fa.handle(Message("ping", b1, 0, 0, 1))
    fa.handle(Message("state-reply", b1, 0, 0, 1, *_payload(fb), fingerprint=FP))  # nobody asked
    assert fa.rejected == {"state": 1, "kind": 1, "unsolicited": 1}
    assert fa.node.rejected["fingerprint"] == 1 and not fa.node.inbox.has_round(1, 0)


def test_a_joiner_takes_rank_rs_shard_of_the_donor_round_and_nothing_else() -> None:
    fa, fb, post = _pair(0.0, 2.0)
    ea = Exchange(fa, post)
    Exchange(fb, post).finish()
    ea.finish()  # round 0 mixed: both at 1.0, now in round 1
    with torch.no_grad():
        fa.shard.add_(torch.arange(N, dtype=torch.float32))  # a's local steps
    joiner = _follower(C, -9.0)
    start = Decision(1, "start", round=1, step=1, members=(A, B, C), donor=A, donor_round=1)
    joiner.apply(start)
    assert not joiner.take(start)  # nothing handed over yet
    out = fa.hand_over([C])
    assert [dst for dst, _ in out] == ["127.0.0.1:7201"]  # rank 1 to rank 1
    reply = out[0][1]
    assert (reply.kind, reply.sender, reply.round, reply.fingerprint) == ("state-reply", fa.id, 1, FP)
    assert fa.handed == [{"to": "127.0.0.1:7201", "round": 1, "step": 0, "sha256": sha256_of(fa.shard)}]
    # a reply from another member, or of another round, is not what the decision names
    joiner.handle(_copy(fb.hand_over([C])[0][1]))
    stale = _copy(reply)
    stale.round = 0
    joiner.handle(stale)
    assert not joiner.take(start) and joiner.status == "waiting"
    joiner.handle(_copy(reply))
    assert joiner.take(start)
    assert torch.equal(joiner.shard, fa.shard)  # exactly a's rank-1 shard, in the joiner's own memory
    assert joiner.shard.data_ptr() != fa.shard.data_ptr()
    assert joiner.took == {"from": fa.id, "round": 1, "step": 0, "sha256": fa.handed[0]["sha256"]}
    assert joiner.status == "training" and joiner.replies == []


def test_a_joiner_keeps_the_newest_replies_and_takes_a_later_round_until_its_go() -> None:
    """Replies of other rounds pile up while rank 0 asks the donor again: the newest are
    kept (not the first eight), and a rank that took its shard of one round takes the
    later round's that rank 0's next start names, until the go."""
    fa, _, _ = _pair(0.0, 2.0)
    joiner = _follower(C, -9.0)
    joiner.apply(Decision(1, "start", round=1, step=1, members=(A, B, C), donor=A, donor_round=0))
    reply = fa.hand_over([C])[0][1]
    for rnd in range(12):
        late = _copy(reply)
        late.round = rnd
        joiner.handle(late)
    assert [m.round for m in joiner.replies] == list(range(4, 12)) and "unsolicited" not in joiner.rejected
    assert joiner.take(Decision(2, "start", round=11, step=11, members=(A, B, C), donor=A, donor_round=11))
    again = _copy(reply)
    again.round = 13
    joiner.handle(again)  # rank 0 asked again (another rank missed round 11): still wanted
    assert joiner.take(Decision(3, "start", round=13, step=13, members=(A, B, C), donor=A, donor_round=13))
    joiner.begin()  # the go
    joiner.handle(_copy(again))
    assert joiner.rejected == {"unsolicited": 1} and joiner.replies == []


def test_a_hand_over_in_the_middle_of_a_round_comes_from_rank_0s_news_once() -> None:
    fa, fb, post = _pair(3.0, 2.0)
    ea = Exchange(fa, post)  # a waits in round 0, at step 0
    rnd, step = fa.node.waiting[1], fa.node.step
    news = News(handovers=((1, C, rnd, step), (2, B, rnd + 1, step)))
    out = fa.news_handovers(news)
    assert [dst for dst, _ in out] == ["127.0.0.1:7201"]  # the hand-over of another round is left
    msg = out[0][1]
    assert msg.kind == "state-reply" and msg.round == rnd and msg.progress == step
    assert torch.equal(decode_payload(_copy(msg), fa.shard), torch.full((N,), 3.0))  # the shard before mixing
    assert fa.news_handovers(news) == []  # each numbered hand-over once
    assert fa.handovers_done == {1, 2}
    Exchange(fb, post).finish()
    ea.finish()
    assert fa.news_handovers(News(handovers=((3, C, 0, 0),))) == []  # round 0 is mixed: nothing to hand
    assert 3 in fa.handovers_done


def test_a_rank_a_moment_behind_rank_0_hands_over_when_it_reaches_the_round_s_wait() -> None:
    """Rank 0 read the joiner's request while waiting in round 0; this rank reads the news
    before its own wait there (it still takes the round's step, or reads the decision): the
    hand-over waits for that wait, not dropped (else the joiner's ranks miss their shards
    and the round waits out --timeout on every member)."""
    fa, fb, post = _pair(3.0, 2.0)
    news = News(handovers=((1, C, 0, 0),))
    assert fa.news_handovers(news) == [] and fa.handovers_done == set()  # not in round 0's wait yet
    ea = Exchange(fa, post)
    out = fa.news_handovers(news)
    assert [dst for dst, _ in out] == ["127.0.0.1:7201"] and out[0][1].round == 0
    assert torch.equal(decode_payload(_copy(out[0][1]), fa.shard), torch.full((N,), 3.0))
    assert fa.news_handovers(news) == [] and fa.handovers_done == {1}
    Exchange(fb, post).finish()
    ea.finish()


def test_a_wait_ends_only_when_every_awaited_neighbour_is_held_dead() -> None:
    fa = _follower(A, 0.0)
    assert not fa.awaited_dead({B})  # no node yet
    fa.apply(Decision(1, "start", members=(A, B, C)))
    ea = Exchange(fa, lambda dst, m: None)  # nobody answers
    assert ea.waited
    assert sorted(fa.node.awaited()) == ["127.0.0.1:7101", "127.0.0.1:7201"]
    assert not fa.awaited_dead({B})  # c is still awaited
    assert fa.awaited_dead({B, C})
    assert not fa.awaited_dead(set())


def test_the_examples_in_the_docstrings_hold() -> None:
    import doctest

    import gossip.protocol.group

    result = doctest.testmod(gossip.protocol.group)
    assert result.attempted >= 2 and result.failed == 0


class _Link:
    """The group's channel as a dict (the programs never block on it)."""

    def __init__(self) -> None:
        self.decisions: dict[int, Decision] = {}

    def publish(self, d: Decision) -> None:
        self.decisions[d.seq] = d

    def next(self, seq: int, timeout: float) -> Decision | None:
        return self.decisions.get(seq)

    def news(self) -> News:
        return News()


class _Life:
    """Rank 0's lifecycle, as far as GroupLead.start sees it: discovery raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.id, self.on_node, self.error = A, None, error

    def discover(self):
        raise self.error
        yield  # (a program)


def _run(program):
    """Drive a sans-IO program whose every wait is answered at once; returns its value."""
    try:
        action = next(program)
        while True:
            action = program.send(0.0)
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize("error, finished", [
    (ClusterFinished("every member of the cluster it joins has finished training (127.0.0.1:7100)"), True),
    (PeerError("the running cluster did not schedule our join (no answer to hello)"), False),
])
def test_rank_0_stopped_before_its_start_tells_the_other_ranks_why(error, finished) -> None:
    """Ranks 1..K-1 wait for rank 0's start: when rank 0's discovery ends in an error, its exit
    decision carries the reason, so every rank ends with rank 0's finding (a cluster that
    finished: gossip-node exits 0 on every rank) instead of waiting for a start that never comes."""
    link = _Link()
    lead = GroupLead(_Life(error), 2, link, shard=torch.zeros(N))
    with pytest.raises(type(error)):
        _run(lead.start())
    assert link.decisions == {1: Decision(1, "exit", why=str(error), finished=finished)}
    follow = GroupFollow(_follower(A, 0.0), link, send=lambda dst, msg: None)
    with pytest.raises(ClusterFinished if finished else PeerError) as raised:
        _run(follow.start())
    assert isinstance(raised.value, ClusterFinished) == finished
    assert str(error) in str(raised.value) and follow.exited


class _RoundLife:
    """Rank 0's lifecycle, as far as GroupLead.after_step sees it: one channel of period 1
    whose exchange sends the round's message, then waits, then mixes; ``sent`` holds what
    was handed to whom (the round in which it was), ``handovers`` the requests queued."""

    def __init__(self) -> None:
        import threading

        channel = type("Channel", (), {"period": 1})()
        self.node = type("Node", (), {"round": 4, "step": 4, "waiting": None, "channels": [channel]})()
        self.id, self.on_node, self.lock = A, None, threading.Lock()
        self.last_step_at, self.max_step_gap, self.excluded = None, 0.0, None
        self.stop = threading.Event()
        self.handovers: list[str] = []
        self.sent: list[tuple[str, int]] = []
        self.during_send = None  # called while the round's message goes out

    def apply_members(self) -> None:
        pass

    def take_handovers(self) -> list[str]:
        out, self.handovers = self.handovers, []
        return out

    def state_reply(self, to: str):
        return self.node.round

    def send_message(self, to: str, rnd: int) -> None:
        self.sent.append((to, rnd))

    def exchange(self, ch):
        node = self.node
        yield Send([])
        if self.during_send is not None:
            self.during_send()  # (the driver handles what arrived before the send goes out)
        node.waiting = (ch, node.round)
        yield Wait(1.0)
        node.waiting = None
        node.round += 1  # the mix


class _NewsLink(_Link):
    def __init__(self) -> None:
        super().__init__()
        self.published: list[News] = []

    def publish_news(self, news: News) -> None:
        self.published.append(news)


def test_a_request_read_while_the_round_s_message_goes_out_is_handed_over_in_that_round() -> None:
    """Rank 0 took the queued requests at the round's decision; a request it reads after
    that, as the round's message goes out (before its wait), belongs to the round, which
    may wait for this joiner: every rank hands over now, as in the wait. Between rounds a
    request waits for the next decision."""
    life, link = _RoundLife(), _NewsLink()
    lead = GroupLead(life, 2, link, shard=torch.zeros(N))
    lead.members = lambda: {"members": (A, B), "dcs": ("", ""), "lives": (1, 1)}
    lead.state_request(B)  # between rounds: queued for the next decision
    assert life.sent == [] and life.handovers == [B]
    life.during_send = lambda: lead.state_request(C)
    _run(lead.after_step(4))
    assert life.sent == [(B, 4), (C, 4)]  # b before round 4 (its decision names it), c in round 4
    assert link.decisions[1].handover == (B,)
    assert link.published[-1].handovers == ((1, C, 4, 4),)  # the other ranks: their shard of round 4
    lead.state_request(A)  # round 4 is mixed: the next decision's
    assert life.handovers == [A] and len(life.sent) == 2

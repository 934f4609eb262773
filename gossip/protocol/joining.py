"""How a node enters a running cluster: the join round the members schedule, the
state pulled from a member before the first round, and ``--resume`` from a
checkpoint. One part of a peer's :class:`~gossip.protocol.lifecycle.Lifecycle`: it owns
what it learns (the state replies, where the state came from) and reads the
lifecycle's member table, control plane and node.
"""

from __future__ import annotations

import logging
from typing import Any

from gossip.core.actions import POLL0, Poll, Program
from gossip.core.checkpoint import latest_checkpoint, load_checkpoint
from gossip.core.message import Message
from gossip.core.state import sha256_of
from gossip.mixing.base import all_finite, decode_payload
from gossip.protocol.errors import PeerError
from gossip.protocol.membership import RUNNING

__all__ = ["Joining", "ClusterGone", "ClusterFinished"]

log = logging.getLogger("gossip.peer")

POLL = 0.05  # seconds between looks while waiting for a state reply (a driver may wake earlier)


class ClusterGone(PeerError):
    """The cluster a node waits to join stopped training before the node's first round
    (its members died or started new lives): there is no round to join any more."""


class ClusterFinished(PeerError):
    """Every member of the cluster a node waits to join has finished training (said
    so, or said goodbye, in this life): nobody will schedule its join or hand it a state."""


class Joining:
    """The join of one life of a peer (a new life gets a new one).

    ``life`` is the :class:`~gossip.protocol.lifecycle.Lifecycle` it belongs to.
    """

    def __init__(self, life: Any) -> None:
        self.life = life
        self.joined = False
        self.replies: list[Message] = []  # state replies while pulling (a few: each holds a whole model)
        self.state_from: str | None = None
        self.state_step = 0  # the step of the member state taken (state_from's)
        self.resumed_from: str | None = None
        self.took: tuple[str, str] | None = None  # (donor, sha256) with life.audit
        self.took_from: tuple[str, int] | None = None  # (donor, round of its state) this life adopted
        self.asking = False  # waiting for a reply it asked for (a group asks again after its start: see pull_again)

    def offer(self, msg: Message) -> bool:
        """A state reply arrived; False if nobody asked for it."""
        life = self.life
        if life.node is not None and (life.status == "waiting" or self.asking) \
                and msg.fingerprint == life.fingerprint and len(self.replies) < 8:
            self.replies.append(msg)
            return True
        return False

    def await_round(self) -> Program:
        """The round the cluster scheduled for us (it answers our hello with it)."""
        life = self.life
        now = yield POLL0
        deadline = now + max(life.cfg.timing.join_timeout, 5 * life.cfg.timing.heartbeat)
        while now < deadline and not life.stop.is_set():
            with life.lock:
                m = life.membership
                # a join round is of use only with the schedule it belongs to (who started
                # the cluster): a list from a member that waits to join too may announce our
                # join before any training member has told us the starters. Without them our
                # first round's member list would lack them, and a cluster of trainers would
                # look gone; the training member we say hello to sends them
                if life.id in m.joins and m.started:
                    return m.joins[life.id]
                if m.spent:  # (see Membership.spent) discover afresh, as a new life
                    raise ClusterGone("the cluster started with this life and dropped it before it trained")
                if m.orphaned() and not m.target:
                    raise ClusterGone("every member of the cluster it joins restarted or died")
                if m.started and life.id in m.base and m.counts(life.id, life.incarnation):
                    # a cluster started afresh counting this life as a starter (it settled
                    # while we waited to join): nobody schedules a join; start with a member's state
                    return 0
                if m.target_gone():
                    # every member of the cluster it set out to join died or began a new life
                    # meanwhile (a merge takes only the members the two views do not share, maybe
                    # one; two clusters that met may each send the other's members to join
                    # it). The schedule taken from them counts rounds nobody trains: wait as a
                    # restarted process does, and take the lists of whichever member schedules
                    # the join (explorer seed 7502022658: a node asked the new lives of its
                    # target, which trained elsewhere and took its stale lists for another
                    # cluster's, until the run ended)
                    log.warning("%s: every member of the cluster it joins (%s) is gone or began a new life; "
                                "asking the members it still knows", life.id, ", ".join(sorted(m.target)))
                    m.leave_target()
                others = m.others()
                if m.target:  # joining another cluster: ask only its members
                    others = [o for o in others if o in m.target]
                # only a training member schedules a join: when all have finished (or said
                # goodbye), nobody will, and waiting --join-timeout would only idle. Only what
                # they said in this life counts (see Membership.finished)
                if m.finished(m.target or others):
                    raise ClusterFinished("every member of the cluster it joins has finished training ("
                                    + ", ".join(sorted(m.target or others)) + ")")
            if life.rejoin_via is not None:  # the member that dropped us knows the running cluster
                others = [life.rejoin_via, *(o for o in others if o != life.rejoin_via)]
            life.control.apply(life.control.hello_all(others[:3]))
            end = now + life.cfg.timing.heartbeat
            while now < end and not (life.id in life.membership.joins and life.membership.started):
                now = yield Poll(end - now)
        raise PeerError("the running cluster did not schedule our join (no answer to hello)")

    def pull_state(self, start_round: int) -> Program:
        """Wait until the cluster reaches our first round, then copy a member's state."""
        life = self.life
        node, cfg = life.node, life.cfg
        assert node is not None
        while not life.stop.is_set():
            with life.lock:  # the members we train with (after a partition, others may count other rounds)
                # members that schedule this join at once may pick rounds a round or two apart,
                # and every member keeps the earliest it hears (Membership.announce_join); so
                # does this node, and it may have heard a later one first (explorer-style run
                # of 5 nodes under churn: it started a round after its neighbours' round,
                # which both waited out, and their neighbours the next)
                start_round = min(start_round, life.membership.joins.get(life.id, start_round))
                rounds = [m.round for k, m in life.membership.members.items() if k != life.id and k in node.members]
                serving = [k for k, m in life.membership.members.items()  # (a finished one serves its state)
                           if k != life.id and k in node.members and m.status in RUNNING]
            if rounds and max(rounds) >= start_round - 1:
                break
            if not serving:  # every member that would reach our round finished, died or started a new life
                others = [k for k in node.members if k != life.id]
                with life.lock:
                    done = life.membership.finished(others)
                if done:  # (a restart near the end: the cluster finished before our join round)
                    raise ClusterFinished("every member of the cluster it joins has finished training ("
                                          + ", ".join(others) + ") before its join round")
                raise ClusterGone("no member of the cluster it joins trains any more")
            yield Poll(cfg.timing.heartbeat / 2)
        asked: set[str] = set()
        for attempt in range(6):
            donors = [j for j in node.topology.in_weights(node.index, start_round) if j != node.index]
            candidates = [node.members[j] for j in donors] or [m for m in node.members if m != life.id]
            if not candidates:
                break
            with life.lock:  # a member that waits to join too has no state to give: it does not answer.
                table = life.membership.members  # In-neighbours that train first, then any member that does
                serving = [m for m in node.members if m != life.id and m in table
                           and table[m].status in RUNNING]
            candidates = [m for m in candidates if m in serving] or serving or candidates
            donor = candidates[attempt % len(candidates)]
            asked.add(donor)
            # (a member asked before may answer late: a user's loop answers between two of its
            # steps, see Lifecycle.defer_requests)
            if (yield from self._ask(donor, start_round, -1, accept=asked)):
                return
            log.warning("%s: no state from %s yet; asking another member", life.id, donor)
        node.jump_to(self._join_step(start_round))
        log.warning("%s: no member sent its state; joining with a fresh model", life.id)

    def pull_again(self, donor: str, after_round: int) -> Program:
        """Ask for the state again (a group whose other ranks missed their shards of round
        ``after_round``: the donor's ranks hand theirs over anew, at a later round): ``donor``
        twice, then the other members that train (the donor may have died, stalled, or
        started a new life). Returns whether one came."""
        life = self.life
        node = life.node
        assert node is not None
        for attempt in range(6):
            who = donor
            if attempt >= 2:
                with life.lock:
                    table = life.membership.members
                    others = [m for m in node.members if m not in (life.id, donor) and m in table
                              and table[m].status in RUNNING]
                who = others[attempt % len(others)] if others else donor
            if (yield from self._ask(who, node.round, after_round)):
                return True
        log.warning("%s: no member sent its state again after round %d; the ranks that missed their shard keep "
                    "their own (the mixing brings them to the cluster's)", life.id, after_round)
        return False

    def _ask(self, donor: str, start_round: int, after_round: int, accept: set[str] | None = None) -> Program:
        """Ask ``donor`` for its state and adopt a reply of a round after ``after_round`` from
        it (or from any member of ``accept``, asked before); returns whether one came."""
        life = self.life
        node, cfg = life.node, life.cfg
        assert node is not None
        givers = accept if accept is not None else {donor}
        self.replies.clear()
        life.send_message(donor, Message("state-request", life.id, start_round, 0, 0, None, None,
                                         {"inc": life.incarnation}, life.fingerprint))
        self.asking = True
        try:
            now = yield POLL0
            # a group hands its state over at its next exchange, which may be a while
            deadline = now + max(2.0, cfg.timeout) * (1 if life.group_size == 1 else 1.5)
            while now < deadline and not any(str(r.sender) in givers and r.round > after_round for r in self.replies):
                now = yield Poll(min(POLL, deadline - now))
        finally:
            self.asking = False
        for reply in self.replies:
            giver = str(reply.sender)
            if giver in givers and reply.round > after_round and reply.data is not None \
                    and reply.data.numel == node.handover_numel(reply.extra):
                values = decode_payload(reply, node.state.flat)
                if all_finite(values):
                    node.adopt_handover(values, reply.extra)  # parameters, and any outer momentum
                    if life.audit:
                        self.took = (giver, sha256_of(node.state.flat))
                    # a joiner that fell behind (slow start, a busy machine) starts later: its
                    # neighbours went on without it (each waited out a round), and they drop
                    # messages of rounds they have finished. At the donor's round, unless a
                    # neighbour of its first round is not that far yet: a donor that is no
                    # neighbour (they wait to join too, after a merge) does not wait for it,
                    # and the neighbours that do would wait out a round for each it skipped
                    start_round = max(start_round, min(reply.round, self._neighbours_round(start_round)))
                    node.jump_to(self._join_step(start_round))
                    if reply.weight is not None and node.rule.weight is not None:
                        node.rule.weight = 1.0  # a newcomer brings its own unit of push-sum mass
                    self.state_from, self.state_step = giver, reply.progress
                    self.took_from = (giver, reply.round)
                    log.info("%s: took the state of %s (its step %d); joining at round %d", life.id, giver,
                             reply.progress, start_round)
                    self.replies.clear()
                    return True
        self.replies.clear()
        return False

    def _neighbours_round(self, rnd: int) -> int:
        """The lowest round its training neighbours of round ``rnd`` (in and out) last
        reported; ``rnd`` when none trains (they join too, at that round)."""
        life = self.life
        node = life.node
        assert node is not None
        near = set(node.topology.in_neighbors(node.index, rnd)) | set(node.topology.out_neighbors(node.index, rnd))
        ids = [node.members[j] for j in near if j != node.index]
        with life.lock:
            table = life.membership.members
            rounds = [table[m].round for m in ids if m in table and table[m].status == "training"]
        return min(rounds, default=rnd)

    def _join_step(self, start_round: int) -> int:
        """The local step a joiner continues from: its join round's first step; a join
        round past the end of a run of ``steps`` steps (the cluster finished) holds the
        final state. A training loop of the user's own has no step budget: no cap."""
        life = self.life
        step = start_round * life.cfg.period
        return min(step, life.cfg.steps) if life.step_budget else step

    def align_start(self, mode: str) -> None:
        """With --resume, start where the starters are: a cluster restarted as a whole
        (each member from its own checkpoint, of different steps) at the furthest step
        any of them reported while waiting; a starter that noticed the start late at
        the earliest step the others train at (they wait for it in their round).
        Synchronous rounds need every member in the same round. (Without --resume
        everyone starts at step 0 and a late starter's neighbours wait for it there.)"""
        life = self.life
        node = life.node
        assert node is not None
        with life.lock:
            steps = [m.step for k, m in life.membership.members.items() if k in node.members and k != life.id
                     and (mode == "fresh" or m.status == "training")]
        if not steps:
            return
        step = max([node.step, *steps]) if mode == "fresh" else min(steps)
        if step != node.step:
            log.info("%s: starting at step %d with the other starters (this node was at step %d)", life.id, step,
                     node.step)
            node.jump_to(step)

    def resume(self) -> None:
        """``--resume``: continue from the newest checkpoint. A node that joined a running
        cluster keeps the cluster's round and step whatever the checkpoint says (its
        members wait for this node's messages of their rounds, not of the checkpoint's);
        it takes the checkpoint's parameters and optimizer state only when no member
        sent a state, or the member's is older."""
        life = self.life
        node, cfg = life.node, life.cfg
        assert node is not None and cfg.checkpoint_dir
        path = latest_checkpoint(cfg.checkpoint_dir)
        if path is None:
            log.info("%s: --resume: no checkpoint in %s, starting fresh", life.id, cfg.checkpoint_dir)
            return
        state = load_checkpoint(path)
        if state.get("fingerprint") != node.fingerprint:
            raise ValueError(f"checkpoint {path} is for model fingerprint {state.get('fingerprint')!r}, "
                             f"this node's model is {node.fingerprint!r}")
        if not self.joined:
            node.load_state_dict(state)
            self.resumed_from = str(path)
            log.info("%s: resumed from %s at step %d", life.id, path, node.step)
            return
        if self.state_from is not None and int(state["step"]) <= self.state_step:
            log.info("%s: the member state (step %d) is newer than checkpoint %s (step %d); keeping it",
                     life.id, self.state_step, path.name, state["step"])
            return
        node.adopt(state["flat"].to(life.device))
        if node.optimizer is not None and state.get("optimizer") is not None:
            node.optimizer.load_state_dict(state["optimizer"])
        self.resumed_from = str(path)
        log.info("%s: took the parameters of checkpoint %s (step %d, %s); training in the cluster's round %d",
                 life.id, path.name, state["step"], "no member state" if self.state_from is None else
                 f"the member state was of step {self.state_step}", node.round)


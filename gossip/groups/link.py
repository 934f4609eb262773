"""A group's own channel between its ranks, over torchrun's store (:class:`~gossip.protocol.group.GroupLink`).

Rank 0 publishes each decision under its number; the other ranks wait on that
key. Nothing waits in a collective: while rank 0 alone waits (discovery, a
join), the other ranks wait on the store with no collective timeout running,
and see everything rank 0 published, in order, once it does. Keys live under a
prefix of the group's life (``TORCHELASTIC_RESTART_COUNT``), so a group restarted
by torchrun never reads a dead life's decisions; old decisions are deleted as
the run goes on.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from gossip.protocol.group import Decision, News

__all__ = ["StoreLink", "LocalLink", "KEEP"]

KEEP = 64  # decisions kept in the store behind the newest (the ranks read each long before)


class StoreLink:
    """The group's channel over a ``torch.distributed`` store.

    Parameters
    ----------
    store : a ``torch.distributed.Store`` every rank of the group reaches (torchrun's)
    rank, size : this rank and the group's size
    """

    def __init__(self, store: Any, rank: int, size: int) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self._lock = threading.Lock()  # rank 0's main thread and its I/O thread both publish

    def _wait(self, keys: list[str], timeout: float) -> bool:
        """Whether every key of ``keys`` exists within ``timeout`` seconds (looked at with
        ``check``, backing off from 0.5 ms to 20 ms: the store's own blocking wait logs a
        warning at each of its timeouts)."""
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while not self.store.check(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.02)
        return True

    def publish(self, decision: Decision) -> None:
        with self._lock:
            self.store.set(f"d/{decision.seq}", decision.to_json())
            if decision.seq > KEEP:
                self.store.delete_key(f"d/{decision.seq - KEEP}")

    def next(self, seq: int, timeout: float) -> Decision | None:
        key = f"d/{seq}"
        if not self._wait([key], timeout):
            return None
        return Decision.from_json(self.store.get(key))

    def ack(self, seq: int, ok: bool) -> None:
        self.store.set(f"a/{seq}/{self.rank}", "1" if ok else "0")

    def acks(self, seq: int, timeout: float) -> list[bool] | None:
        keys = [f"a/{seq}/{r}" for r in range(1, self.size)]
        if not keys:
            return []
        if not self._wait(keys, timeout):
            return None
        return [self.store.get(k) == b"1" for k in keys]

    def publish_news(self, news: News) -> None:
        with self._lock:
            self.store.set("news", news.to_json())

    def publish_result(self, call: int, data: bytes) -> None:
        """Rank 0: the result of the group's collective number ``call`` (see
        :mod:`gossip.groups.collectives`). The previous call's key goes: every rank read it
        before it entered this call's collective inside the group."""
        self.store.set(f"c/{call}", data)
        if call > 1:
            self.store.delete_key(f"c/{call - 1}")

    def result(self, call: int, timeout: float) -> bytes | None:
        """Ranks 1..K-1: the result of collective ``call`` once rank 0 published it (the
        store looked at as :meth:`next` does: no collective is waiting), or None after
        ``timeout`` seconds."""
        key = f"c/{call}"
        if not self._wait([key], timeout):
            return None
        return self.store.get(key)

    def news(self) -> News:
        if not self.store.check(["news"]):
            return News()
        return News.from_json(self.store.get("news"))


class LocalLink:
    """The group's channel between threads of one process (a node gossiping as a group of K
    slices, ``gossip-node --as-group K``): the same :class:`~gossip.protocol.group.GroupLink`
    as :class:`StoreLink`, over a condition variable. :meth:`rank` gives rank r's side."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.decisions: dict[int, Decision] = {}
        self.acked: dict[int, dict[int, bool]] = {}
        self.latest = News()

    def rank(self, r: int) -> "_LocalRank":
        return _LocalRank(self, r)


class _LocalRank:
    def __init__(self, link: LocalLink, r: int) -> None:
        self.shared, self.r = link, r

    def publish(self, decision: Decision) -> None:
        with self.shared.cond:
            self.shared.decisions[decision.seq] = decision
            self.shared.decisions.pop(decision.seq - KEEP, None)
            self.shared.cond.notify_all()

    def next(self, seq: int, timeout: float) -> Decision | None:
        link = self.shared
        with link.cond:
            link.cond.wait_for(lambda: seq in link.decisions, timeout=max(0.0, timeout))
            return link.decisions.get(seq)

    def ack(self, seq: int, ok: bool) -> None:
        with self.shared.cond:
            self.shared.acked.setdefault(seq, {})[self.r] = ok
            self.shared.cond.notify_all()

    def acks(self, seq: int, timeout: float) -> list[bool] | None:
        link = self.shared
        with link.cond:
            if not link.cond.wait_for(lambda: len(link.acked.get(seq, {})) >= link.size - 1, timeout=max(0.0, timeout)):
                return None
            got = link.acked[seq]
            return [got[r] for r in range(1, link.size)]

    def publish_news(self, news: News) -> None:
        with self.shared.cond:
            self.shared.latest = news
            self.shared.cond.notify_all()

    def news(self) -> News:
        with self.shared.cond:
            return self.shared.latest

"""The real transport: ZeroMQ, one ROUTER in, one DEALER per peer out.

All sockets live on one I/O thread (ZeroMQ sockets are not thread-safe).
Other threads hand it frames through :meth:`ZmqTransport.send`, which only
enqueues; tensor buffers travel as zero-copy frames, so the sending thread must
not modify them afterwards (the node sends immutable snapshots). Incoming
multiparts are handed, still as raw frames, to the ``on_frames`` callback on
the I/O thread; ``on_tick`` runs there every ``tick`` seconds for heartbeats
and timers. Transports move bytes: they never choose weights or peers.

Socket options: LINGER 0 (closing never blocks on unsent data), a send
high-water mark per peer (a slow peer cannot make us buffer without bound;
what does not fit is dropped and counted), IMMEDIATE (no queueing towards a
peer that is not connected yet), MAXMSGSIZE on the ROUTER (a hostile peer
cannot make us allocate more than that), and reconnect backoff.

MAXMSGSIZE is enforced by libzmq per frame: a frame above it is dropped
unseen and the sender's connection closed. A monitor on the ROUTER counts
connection events (``events``: ``disconnected``, ``handshake-failed-auth``,
...), which is where such drops show up. libzmq assembles a multipart message
whole before handing it over, so the cap does not bound the sum of many
frames below it; wire decoding rejects those, and CurveZMQ (``curve=``) keeps
unknown senders from connecting at all.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections import Counter
from typing import Any, Callable

import zmq
import zmq.utils.garbage  # noqa: F401 - see below
from zmq.utils.monitor import recv_monitor_message

from gossip.transport import wire

__all__ = ["ZmqTransport", "BindError"]

log = logging.getLogger("gossip.transport")


class _Control:
    """Frames of a control message (exempt from emulated deterministic drops)."""

    __slots__ = ("frames",)

    def __init__(self, frames: list) -> None:
        self.frames = frames


class BindError(OSError):
    """The listen address cannot be bound (in use, not local, no permission)."""


def _nbytes(frame: Any) -> int:
    return memoryview(frame).nbytes


MAX_HELD = 64  # messages held per peer while its connection comes up
HOLD_POLL = 0.01  # seconds before the first try to send them again
HOLD_POLL_MAX = 0.16  # ... doubling after each try in vain, up to this (an address that never answers costs little)

# ROUTER connection events worth counting: how connections end, and handshakes that fail
_EVENT_NAMES = {zmq.EVENT_DISCONNECTED: "disconnected", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake-failed-auth",
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake-failed-protocol",
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake-failed"}
_MONITORED = 0
for _e in _EVENT_NAMES:
    _MONITORED |= _e


class ZmqTransport:
    """Move multipart messages between node ids (``HOST:PORT`` strings).

    Parameters
    ----------
    node_id : this node's id; also its routing identity on outgoing DEALERs
    listen : endpoint to bind, e.g. ``tcp://0.0.0.0:5555``
    on_frames : ``on_frames(routing_id, frames)`` for each incoming multipart (I/O thread)
    on_tick : ``on_tick(now)`` every ``tick`` seconds (I/O thread)
    max_message_size : ROUTER MAXMSGSIZE in bytes (-1: unlimited)
    hwm : per-peer send high-water mark, in messages
    curve : optional CurveZMQ policy with ``setup_server(router)``, ``setup_client(dealer, peer_id)``,
        ``check(routing_id, frame) -> reason | None`` and ``close()``, see :mod:`gossip.transport.security`
    io_threads : libzmq I/O threads; one thread tops out well below loopback or
        10 GbE speed on large messages, two roughly double it
    hold_control : seconds a message waits for its connection to come up before it
        is dropped: a control message (``droppable=False``) on any connection, a
        state message only on a connection opened less than this long ago. A
        connection opened just now (a new member, a new life of one, rank r of a
        group that joins) takes a moment, and its peer may be binding its socket
        still; ZeroMQ's IMMEDIATE option would otherwise drop the first messages,
        such as the member list that tells a node it was dropped, or the state of
        the round that admits a joiner (which would then wait that round out).
        A state message on an older connection that is down is dropped at once:
        the next round's replaces it.
    shaper : optional link emulator with ``transmit(src, dst, nbytes, now, droppable=)``
        (a :class:`~gossip.transport.links.SimNetwork`): each message leaves when it
        says (delay, bandwidth cap) or is dropped (loss). Off by default; for tests
        and demos of slow links on one machine.
    """

    #: Frames handed to :meth:`send` stay referenced until libzmq has sent them
    #: (zero-copy), so a sender can tell when it may change their memory
    #: (:class:`gossip.core.buffers.SendLease`).
    holds_sends = True

    def __init__(self, node_id: str, listen: str, *, on_frames: Callable[[bytes, list], None],
                 on_tick: Callable[[float], None] | None = None, tick: float = 0.1,
                 max_message_size: int = -1, hwm: int = 16, curve: Any = None, io_threads: int = 2,
                 shaper: Any = None, clock: Callable[[], float] = time.monotonic,
                 hold_control: float = 2.0) -> None:
        self.node_id = node_id
        self.listen = listen
        self.on_frames = on_frames
        self.on_tick = on_tick
        self.tick = tick
        self.max_message_size = max_message_size
        self.hwm = hwm
        self.curve = curve
        self.clock = clock
        self.ctx = zmq.Context(io_threads=io_threads)
        self.shaper = shaper
        self._delayed: list[tuple[float, int, str, Any, bool]] = []  # (release, seq, dst, frames, droppable)
        self.hold_control = hold_control
        self._held: dict[str, list[tuple[float, list]]] = {}  # dst -> messages waiting for a connection
        self._held_retry: dict[str, tuple[float, float]] = {}  # dst -> (next try, the wait after it)
        self._opened: dict[str, float] = {}  # dst -> when its connection was opened (clock)
        self._delay_seq = 0
        self.emulated_losses = 0
        self._out: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._dealers: dict[str, zmq.Socket] = {}
        self._thread: threading.Thread | None = None
        self._running = threading.Event()
        self._stopped = threading.Event()
        self.bytes_sent: Counter[str] = Counter()
        self.bytes_received: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()  # peer -> messages dropped at the high-water mark
        self.rejected: Counter[str] = Counter()  # reason -> messages refused before decoding (CURVE identity)
        self.events: Counter[str] = Counter()  # ROUTER connection events (monitor), e.g. "disconnected"
        self._wake_addr = f"inproc://wake-{id(self)}"
        self._router: zmq.Socket | None = None
        self._wake_send: zmq.Socket | None = None
        self._wake_lock = threading.Lock()
        self.error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the ROUTER (raising :class:`BindError`) and start the I/O thread."""
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, 1000)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer with the same id takes over
        if self.max_message_size > 0:
            router.setsockopt(zmq.MAXMSGSIZE, int(self.max_message_size))
        if self.curve is not None:
            self.curve.setup_server(router)
        try:
            router.bind(self.listen)
        except zmq.ZMQError as e:
            router.close(0)
            if self.curve is not None:
                self.curve.close()  # its ZAP thread holds a socket: term() would wait for it
            self.ctx.term()
            reason = "already in use" if e.errno == zmq.EADDRINUSE else e.strerror
            raise BindError(f"cannot listen on {self.listen}: {reason}") from None
        self._router = router
        monitor = router.get_monitor_socket(_MONITORED)
        wake_recv = self.ctx.socket(zmq.PAIR)
        wake_recv.bind(self._wake_addr)
        self._wake_send = self.ctx.socket(zmq.PAIR)
        self._wake_send.setsockopt(zmq.LINGER, 0)
        self._wake_send.connect(self._wake_addr)
        self._running.set()
        self._thread = threading.Thread(target=self._loop, args=(router, wake_recv, monitor),
                                        name=f"io-{self.node_id}", daemon=True)
        self._thread.start()

    @property
    def listening(self) -> bool:
        """Whether :meth:`start` bound the socket (and :meth:`close` has not closed it)."""
        return self._thread is not None

    def close(self, timeout: float = 2.0) -> None:
        """Stop the I/O thread (after it flushes what is queued) and close every socket."""
        if self._thread is None:
            return
        self._running.clear()
        self._wake()
        self._thread.join(timeout)
        with self._wake_lock:
            if self._wake_send is not None:
                self._wake_send.close(0)
                self._wake_send = None
        if self.curve is not None:
            self.curve.close()
        self.ctx.destroy(linger=0)
        self._thread = None

    # -- API for other threads -------------------------------------------------------------
    def send(self, dst: str, frames: list, *, droppable: bool = True) -> None:
        """Queue ``frames`` for ``dst``; never blocks. Buffers must not change afterwards.
        ``droppable=False`` marks control traffic (exempt from emulated ``drop=N``)."""
        self._out.put((dst, frames if droppable else _Control(frames)))
        self._wake()

    def forget(self, dst: str) -> None:
        """Close the connection to ``dst`` (it left or died)."""
        self._out.put((dst, None))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_send is not None:
                try:
                    self._wake_send.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass  # a wake-up is already pending

    # -- the I/O thread --------------------------------------------------------------------
    def _dealer(self, dst: str) -> zmq.Socket:
        s = self._dealers.get(dst)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, self.hwm)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)  # exponential backoff up to 5 s
            s.setsockopt(zmq.ROUTING_ID, self.node_id.encode())
            try:
                if self.curve is not None:
                    self.curve.setup_client(s, dst)
                s.connect(f"tcp://{dst}")
            except zmq.ZMQError:
                s.close(0)  # e.g. an id that is no endpoint: do not leak a socket per attempt
                raise
            self._dealers[dst] = s
            self._opened[dst] = self.clock()
        return s

    def _fresh(self, dst: str, now: float) -> bool:
        """Whether the connection to ``dst`` is not opened yet or was opened within ``hold_control``."""
        opened = self._opened.get(dst)
        return opened is None or now - opened < self.hold_control

    def _unnamed(self, ident: bytes, body: list) -> bytes:
        """The id to file a message under when libzmq named its connection itself.

        Routing ids that start with a zero byte are libzmq's own; every node's
        DEALER sets its node id. libzmq can still hand out its own id when a
        connection takes over from an older one with the same id (libzmq issue
        3771), and the node would then refuse a member's messages as coming from
        a stranger. The sender's id is then taken from the message header. That
        trusts the header no more than a routing id, which the sender sets
        freely too; with CURVE the check that follows still requires the
        connection's key to be the one filed for that id.
        """
        claimed = wire.claimed_sender(body)
        if claimed is None:
            return ident  # not one of ours: decoding refuses it, under the name libzmq gave it
        self.events["named-by-libzmq"] += 1  # messages, not connections: counted with the events
        if self.events["named-by-libzmq"] == 1:
            log.info("%s: a connection from %s arrived under a name libzmq made up; filed under its header's id",
                     self.node_id, claimed[:64])
        return claimed.encode()

    def _flush(self) -> None:
        now = self.clock()
        while True:
            try:
                dst, frames = self._out.get_nowait()
            except queue.Empty:
                break
            if frames is None:
                s = self._dealers.pop(dst, None)
                self._opened.pop(dst, None)
                if s is not None:
                    s.close(0)
                self.dropped[dst] += len(self._held.pop(dst, ()))
                self._held_retry.pop(dst, None)
                continue
            droppable = not isinstance(frames, _Control)
            if not droppable:
                frames = frames.frames
            if self.shaper is not None:
                release = self.shaper.transmit(self.node_id, dst, sum(_nbytes(f) for f in frames), now,
                                               droppable=droppable)
                if release is None:
                    self.emulated_losses += 1
                    continue
                if release > now:
                    self._delay_seq += 1
                    heapq.heappush(self._delayed, (release, self._delay_seq, dst, frames, droppable))
                    continue
            self._send_now(dst, frames, droppable, now)
        while self._delayed and self._delayed[0][0] <= now:
            _, _, dst, frames, droppable = heapq.heappop(self._delayed)
            self._send_now(dst, frames, droppable, now)
        self._retry_held(now)

    def _send_now(self, dst: str, frames: list, droppable: bool = True, now: float = 0.0) -> None:
        hold = (not droppable or self._fresh(dst, now)) and self.hold_control > 0
        held = self._held.get(dst)
        if held is not None and hold:
            if len(held) < MAX_HELD:
                held.append((now + self.hold_control, frames))  # behind the ones already waiting: in order
            else:
                self.dropped[dst] += 1
            return
        try:
            try:
                self._dealer(dst).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except RuntimeError:
                # pyzmq's zero-copy frames need its garbage-collector thread, which its own atexit
                # handler stops. Imported above (its handler registered before any node's, so it
                # runs after a node's own atexit close); a late send copies instead
                self._dealer(dst).send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
            self.bytes_sent[dst] += sum(_nbytes(f) for f in frames)
        except zmq.Again:
            # not connected yet (a fresh connection takes a moment), or the peer is not
            # keeping up: control, and anything on a fresh connection, is held a while;
            # state on an older connection is dropped (the next round's replaces it)
            if not hold:
                self.dropped[dst] += 1
            else:
                self._held[dst] = [(now + self.hold_control, frames)]
        except zmq.ZMQError as e:
            self.dropped[dst] += 1
            log.warning("%s: send to %s failed: %s", self.node_id, dst, e)

    def _retry_held(self, now: float) -> None:
        """Send held messages once their connection is up; drop expired ones. Each
        destination is tried again after HOLD_POLL, then twice as long after each try in
        vain (up to HOLD_POLL_MAX): a connection that comes up is used within a few tries,
        and an address where nobody listens (a stranger's made-up id) is not tried a
        hundred times a second (each try creates frames pyzmq's collector thread frees)."""
        for dst in list(self._held):
            next_try, wait = self._held_retry.get(dst, (now, HOLD_POLL))
            if now < next_try:
                continue
            held = self._held[dst]
            s = self._dealers.get(dst)
            while held and s is not None:
                expires, frames = held[0]
                if expires < now:
                    self.dropped[dst] += 1
                    held.pop(0)
                    continue
                try:
                    s.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    self.dropped[dst] += 1
                else:
                    self.bytes_sent[dst] += sum(_nbytes(f) for f in frames)
                held.pop(0)
            if s is None:
                self.dropped[dst] += len(held)
                held.clear()
            if not held:
                del self._held[dst]
                self._held_retry.pop(dst, None)
            else:
                self._held_retry[dst] = (now + wait, min(2 * wait, HOLD_POLL_MAX))

    def _count(self, counter: Counter[str], key: str, n: int) -> None:
        # a key per routing id would let a sender cycling ids grow the counter without bound
        if key in counter or len(counter) < 1024:
            counter[key] += n
        else:
            counter["(others)"] += n

    def _read_events(self, monitor: zmq.Socket) -> None:
        for _ in range(256):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            name = _EVENT_NAMES.get(event.get("event"))
            if name is not None:
                self.events[name] += 1

    def _loop(self, router: zmq.Socket, wake: zmq.Socket, monitor: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        next_tick = self.clock()
        try:
            while self._running.is_set():
                wake_at = min(next_tick, self._delayed[0][0]) if self._delayed else next_tick
                if self._held:  # held messages: the connection may be up by the next try
                    now = self.clock()
                    wake_at = min(wake_at, min((self._held_retry.get(d, (now + HOLD_POLL,))[0] for d in self._held),
                                               default=now + HOLD_POLL))
                timeout = max(0.0, wake_at - self.clock())
                events = dict(poller.poll(int(timeout * 1000) + 1))
                if self._delayed and self._delayed[0][0] <= self.clock():
                    self._flush()  # emulated delays ran out
                if wake in events:
                    try:
                        while True:
                            wake.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                    self._flush()
                if monitor in events:
                    self._read_events(monitor)
                if router in events:
                    for _ in range(256):  # bounded, so ticks and sends are not starved
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        ident = frames[0].bytes
                        body = [f.buffer for f in frames[1:]]
                        if ident[:1] == b"\x00":
                            ident = self._unnamed(ident, body)
                        self._count(self.bytes_received, ident.decode(errors="replace"), sum(f.nbytes for f in body))
                        if self.curve is not None:
                            reason = self.curve.check(ident, frames[1])
                            if reason is not None:
                                self.rejected[reason] += 1
                                continue
                        try:
                            self.on_frames(ident, body)
                        except Exception:  # a handler bug must not kill the I/O thread
                            log.exception("%s: error handling a message from %r", self.node_id, ident[:64])
                now = self.clock()
                if self._held:
                    self._retry_held(now)
                if now >= next_tick:
                    next_tick = now + self.tick
                    if self.on_tick is not None:
                        try:
                            self.on_tick(now)
                        except Exception:
                            log.exception("%s: error in the I/O tick", self.node_id)
            self._flush()  # say what was queued (goodbyes) before closing
        except Exception as e:  # pragma: no cover - reported to the node thread
            self.error = e
            log.exception("%s: I/O thread crashed", self.node_id)
        finally:
            for s in self._dealers.values():
                s.close(0)
            self._dealers.clear()
            try:
                router.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(0)
            router.close(0)
            wake.close(0)
            self._stopped.set()

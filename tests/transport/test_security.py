"""CurveZMQ: key files, the allow-list policy, and real nodes that only let allowed keys in
and only speak ciphertext on the wire."""

from __future__ import annotations

import queue
import signal
import socket
import stat
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.auth

from gossip.core.state import FlatState
from gossip.training.node import init_model
from gossip.training.tasks import get_task
from gossip.transport import wire
from gossip.transport.security import (
    AllowList,
    KeyDirError,
    generate_keys,
    key_file_name,
    keys_main,
    load_curve,
)
from tests.cluster import Cluster, free_port

FAST = ["--heartbeat", "0.2", "--dead-after", "3", "--settle", "1", "--grace", "5"]


def synthetic_fingerprint() -> str:
    return FlatState(init_model(get_task("synthetic"), 0)).fingerprint


def hello(sender: str, fingerprint: str) -> list[bytes]:
    """A well-formed hello: a node that heard it would take ``sender`` as a member."""
    header = {"kind": "hello", "from": sender, "seq": 0, "round": 0, "prog": 0, "fp": fingerprint,
              "x": {"inc": 1, "status": "waiting", "dc": ""}}
    return [wire.TAG, msgpack.packb(header)]


# -- key files --------------------------------------------------------------------------------

def test_key_file_names():
    assert key_file_name("10.0.0.1:5555") == "10.0.0.1_5555"
    assert key_file_name("node-3.example.org:80") == "node-3.example.org_80"
    assert key_file_name("[::1]:7000") == "___1__7000"


def test_gossip_keys_writes_one_directory_per_node_and_adds_nodes_later(tmp_path, capsys):
    out = tmp_path / "keys"
    assert keys_main([str(out), "127.0.0.1:7001", "127.0.0.1:7002"]) == 0
    for name in ("127.0.0.1_7001", "127.0.0.1_7002"):
        secret = out / name / "node.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        public, secret_key = zmq.auth.load_certificate(secret)
        assert secret_key is not None and zmq.auth.load_certificate(out / "allowed" / f"{name}.key")[0] == public
        assert sorted(p.name for p in (out / name / "allowed").iterdir()) == ["127.0.0.1_7001.key",
                                                                              "127.0.0.1_7002.key"]
    first = zmq.auth.load_certificate(out / "127.0.0.1_7001" / "node.key_secret")
    # a third node later: it learns the others, and the existing directories learn it
    assert keys_main([str(out), "127.0.0.1:7003"]) == 0
    for name in ("127.0.0.1_7001", "127.0.0.1_7002", "127.0.0.1_7003"):
        assert len(list((out / name / "allowed").glob("*.key"))) == 3
    assert zmq.auth.load_certificate(out / "127.0.0.1_7001" / "node.key_secret") == first  # untouched
    sec = load_curve(out / "127.0.0.1_7003", "127.0.0.1:7003")
    assert sec.keys.public == zmq.auth.load_certificate(out / "allowed" / "127.0.0.1_7003.key")[0]
    assert sec.keys.secret.decode() not in repr(sec.keys)
    # never overwrites a key pair
    assert keys_main([str(out), "127.0.0.1:7001"]) == 2
    assert "exists already" in capsys.readouterr().err
    assert zmq.auth.load_certificate(out / "127.0.0.1_7001" / "node.key_secret") == first


def _broken(kind: str, keys: Path) -> Path:
    d = keys / "127.0.0.1_7101"
    if kind == "no-dir":
        return keys / "nowhere"
    if kind == "no-secret":
        (d / "node.key_secret").unlink()
    elif kind == "public-only":
        (d / "node.key_secret").write_bytes((d / "node.key").read_bytes())
    elif kind == "no-allowed":
        for f in (d / "allowed").iterdir():
            f.unlink()
        (d / "allowed").rmdir()
    elif kind == "empty-allowed":
        for f in (d / "allowed").iterdir():
            f.unlink()
    elif kind == "not-self":
        (d / "allowed" / "127.0.0.1_7101.key").unlink()
    elif kind == "wrong-self":
        (d / "allowed" / "127.0.0.1_7101.key").write_bytes((keys / "allowed" / "127.0.0.1_7102.key").read_bytes())
    elif kind == "garbage":
        (d / "allowed" / "junk.key").write_text("not a certificate\n")
    return d


@pytest.mark.parametrize("kind,needle", [
    ("no-dir", "no such directory"),
    ("no-secret", "missing node.key_secret"),
    ("public-only", "holds no secret key"),
    ("no-allowed", "missing allowed/"),
    ("empty-allowed", "no *.key public-key files"),
    ("not-self", "missing allowed/127.0.0.1_7101.key, this node's public key"),
    ("wrong-self", "allowed/127.0.0.1_7101.key is not the public key of node.key_secret"),
    ("garbage", "junk.key: not a readable zmq certificate"),
])
def test_bad_key_directory_is_a_one_line_error_exit_2(tmp_path, capsys, kind, needle):
    generate_keys(tmp_path, ["127.0.0.1:7101", "127.0.0.1:7102"])
    d = _broken(kind, tmp_path)
    with pytest.raises(KeyDirError, match="--curve-keys"):
        load_curve(d, "127.0.0.1:7101")
    from gossip.cli import node_main

    code = node_main(["--listen", "tcp://127.0.0.1:7101", "--curve-keys", str(d), "--steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("gossip-node: error: --curve-keys") and needle in err[0], err


def test_allow_list_policy_counts_and_rereads_the_directory(tmp_path):
    generate_keys(tmp_path, ["127.0.0.1:1", "127.0.0.1:2"])
    now = [0.0]
    allow = AllowList(tmp_path / "allowed", rescan_interval=1.0, clock=lambda: now[0])
    k1 = zmq.auth.load_certificate(tmp_path / "allowed" / "127.0.0.1_1.key")[0]
    stranger = zmq.curve_keypair()[0]
    assert allow.callback("gossip", k1) is True
    assert allow.callback("gossip", stranger) is False
    assert allow.owns("127.0.0.1:1", k1.decode()) and not allow.owns("127.0.0.1:2", k1.decode())
    assert allow.server_key("127.0.0.1:2") is not None and allow.server_key("127.0.0.1:3") is None
    # a key added to the directory is let in at the next re-read, at most once per interval
    generate_keys(tmp_path, ["127.0.0.1:3"])
    k3 = zmq.auth.load_certificate(tmp_path / "allowed" / "127.0.0.1_3.key")[0]
    assert allow.callback("gossip", k3) is False  # re-read less than 1 s ago
    now[0] = 1.5
    assert allow.callback("gossip", k3) is True
    assert allow.server_key("127.0.0.1:3") == k3
    report = allow.report()
    assert report["handshakes_allowed"] == 2 and report["handshakes_denied"] == 2
    assert report["denied_keys"] == [stranger.decode(), k3.decode()] and report["allowed_keys"] == 3


# -- real nodes -------------------------------------------------------------------------------

def pair_args(keys: Path | None, name: str, peer: str, steps: int, *extra: str) -> list[str]:
    curve = ["--curve-keys", str(keys / name)] if keys is not None else []
    return ["--peers", peer, "--task", "synthetic", "--steps", str(steps), "--seed", "0", "--json", *FAST,
            *curve, *extra]


def test_two_nodes_with_allowed_keys_train_together(tmp_path):
    pa, pb = free_port(), free_port()
    ids = [f"127.0.0.1:{pa}", f"127.0.0.1:{pb}"]
    generate_keys(tmp_path / "keys", ids)
    with Cluster(tmp_path) as c:
        a = c.start("a", pair_args(tmp_path / "keys", key_file_name(ids[0]), ids[1], 100), port=pa)
        b = c.start("b", pair_args(tmp_path / "keys", key_file_name(ids[1]), ids[0], 100), port=pb)
        assert c.wait_all(120) == [0, 0]
        sa, sb = a.summary(), b.summary()
    for s in (sa, sb):
        assert s["steps"] == 100 and s["members"] == 2 and s["missing_neighbors"] == 0, s
        assert s["rejected"] == {} and s["curve"]["handshakes_denied"] == 0, s
        assert s["curve"]["handshakes_allowed"] >= 1 and s["curve"]["allowed_keys"] == 2, s
        assert s["final_accuracy"] > 0.7 and s["neighbor_distance"] < 0.05, s


def test_a_node_whose_key_is_not_allowed_gets_nothing_in(tmp_path):
    pa, pb, pr = free_port(), free_port(), free_port()
    a_id, b_id, r_id = (f"127.0.0.1:{p}" for p in (pa, pb, pr))
    keys = tmp_path / "keys"
    generate_keys(keys, [a_id, b_id])
    generate_keys(tmp_path / "rogue", [r_id])
    rogue_dir = tmp_path / "rogue" / key_file_name(r_id)
    for f in (keys / "allowed").iterdir():  # the rogue knows the cluster's public keys; they are public
        (rogue_dir / "allowed" / f.name).write_bytes(f.read_bytes())
    rogue_public = zmq.auth.load_certificate(rogue_dir / "node.key_secret")[0].decode()
    with Cluster(tmp_path) as c:
        a = c.start("a", pair_args(keys, key_file_name(a_id), b_id, 150), port=pa)
        b = c.start("b", pair_args(keys, key_file_name(b_id), a_id, 150), port=pb)
        r = c.start("rogue", pair_args(tmp_path / "rogue", key_file_name(r_id), f"{a_id},{b_id}", 20,
                                       "--join-timeout", "4"), port=pr)
        assert c.wait_all(120) == [0, 0, 0]
        sa, sb, sr = a.summary(), b.summary(), r.summary()
        logs = a.log() + b.log()
    for s in (sa, sb):
        # the rogue never became a member, and not one of its messages reached the message layer
        assert s["members"] == 2 and s["steps"] == 150 and s["rejected"] == {}, s
        assert s["curve"]["handshakes_denied"] >= 1 and s["curve"]["denied_keys"] == [rogue_public], s
    assert r_id not in logs.replace(f"public key {rogue_public}", "")  # never heard of, by id
    assert sr["members"] == 1 and "training alone" in r.log(), sr


def test_plain_and_impostor_clients_get_nothing_in(tmp_path):
    """A client without CURVE cannot even finish a handshake, an unknown key is refused by
    ZAP, and an allowed key cannot speak as another node id."""
    pa, pb = free_port(), free_port()
    a_id, b_id = f"127.0.0.1:{pa}", f"127.0.0.1:{pb}"
    keys = tmp_path / "keys"
    generate_keys(keys, [a_id, b_id])
    fp = synthetic_fingerprint()
    a_public = zmq.auth.load_certificate(keys / "allowed" / f"{key_file_name(a_id)}.key")[0]
    b_public, b_secret = zmq.auth.load_certificate(keys / key_file_name(b_id) / "node.key_secret")
    with Cluster(tmp_path) as c:
        a = c.start("a", ["--steps", "1000000", "--json", "--curve-keys", str(keys / key_file_name(a_id)), *FAST],
                    port=pa)
        a.wait_for_log("training as", 60)
        ctx = zmq.Context()
        try:
            socks = []

            def client(routing_id: str, public=None, secret=None):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.ROUTING_ID, routing_id.encode())
                if public is not None:
                    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = public, secret, a_public
                s.connect(f"tcp://{a_id}")
                socks.append(s)
                return s

            plain = client("127.0.0.1:1")
            stranger_public, stranger_secret = zmq.curve_keypair()
            stranger = client("127.0.0.1:2", stranger_public, stranger_secret)
            impostor = client("127.0.0.1:3", b_public, b_secret)  # B's key, another id
            for _ in range(20):  # well-formed hellos with the right fingerprint: any that got in would join
                for s, sender in ((plain, "127.0.0.1:1"), (stranger, "127.0.0.1:2"), (impostor, "127.0.0.1:3")):
                    try:
                        # a refused connection leaves a socket with no peer, where a send would block
                        s.send_multipart(hello(sender, fp), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                time.sleep(0.02)
            time.sleep(1.5)
            for s in socks:
                s.close(0)
        finally:
            ctx.term()
        a.proc.send_signal(signal.SIGTERM)  # it trained all along; stop it and read its summary
        assert c.wait_all(60) == [0]
        s = a.summary()
    assert s["members"] == 1 and s["interrupted"] and s["steps"] > 0, s
    assert s["rejected"] == {"identity": 20}, s  # the impostor's messages: every one refused
    assert s["curve"]["identity_refused"] == 20
    assert s["curve"]["handshakes_denied"] >= 1 and s["curve"]["denied_keys"] == [stranger_public.decode()], s
    assert s["curve"]["handshakes_allowed"] >= 1, s  # the impostor's key itself is allowed
    # the plain client: libzmq reports the mechanism mismatch as a protocol error, or without
    # detail when the connection ends while it is being refused (either way, no handshake)
    failed = s["connections"].get("handshake-failed-protocol", 0) + s["connections"].get("handshake-failed", 0)
    assert failed >= 1, s
    assert s["connections"].get("handshake-failed-auth", 0) >= 1, s      # the stranger


class RecordingProxy:
    """Forward TCP connections on a local port to ``target_port``, recording every byte
    that travels towards the target (what an eavesdropper on that link would see)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.data = bytearray()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                conn.close()
                continue
            upstream.settimeout(None)
            self.sockets += [conn, upstream]
            threading.Thread(target=self._pump, args=(conn, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while True:
                chunk = src.recv(65536)
                if not chunk:
                    break
                if record:
                    with self.lock:
                        self.data += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for s in self.sockets:
            s.close()


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_traffic_is_encrypted_on_the_wire(tmp_path, curve):
    """B reaches A through a recording proxy (A advertises the proxy's address). Without
    CURVE the protocol tag, the model fingerprint and the node ids are readable in the
    bytes; with it none of them is, although as much traffic flowed."""
    pa, pb = free_port(), free_port()
    proxy = RecordingProxy(pa)
    a_id, b_id = f"127.0.0.1:{proxy.port}", f"127.0.0.1:{pb}"
    keys = tmp_path / "keys" if curve else None
    if keys is not None:
        generate_keys(keys, [a_id, b_id])
    try:
        with Cluster(tmp_path) as c:
            a = c.start("a", pair_args(keys, key_file_name(a_id), b_id, 30, "--advertise", a_id), port=pa)
            b = c.start("b", pair_args(keys, key_file_name(b_id), a_id, 30), port=pb)
            assert c.wait_all(120) == [0, 0]
            sa, sb = a.summary(), b.summary()
    finally:
        proxy.close()
    assert sa["node"] == a_id and sa["members"] == 2 and sa["missing_neighbors"] == 0, sa
    assert sb["members"] == 2 and sb["rejected"] == {}, sb
    seen = bytes(proxy.data)
    assert len(seen) > 30 * 2762 * 4  # 30 rounds of B's float32 model went through the proxy
    secrets = [wire.TAG, synthetic_fingerprint().encode(), b_id.encode()]
    found = [s for s in secrets if s in seen]
    if curve:
        assert found == [] and b"CURVE" in seen[:64], found  # the greeting names the mechanism, nothing else
    else:
        assert found == secrets


# -- connections libzmq named itself ---------------------------------------------------------
def _unnamed_dealer_sends(transport_id: str, messages: list[list[bytes]], keys=None, client_keys=None) -> tuple:
    """Send ``messages`` from a DEALER that sets no routing id (so libzmq names its
    connection, as it does in the handover race of libzmq issue 3771) to a transport
    listening as ``transport_id``; return what reached ``on_frames`` and the transport."""
    from gossip.transport.zmq import ZmqTransport

    got: queue.SimpleQueue = queue.SimpleQueue()
    t = ZmqTransport(transport_id, f"tcp://{transport_id}", on_frames=lambda ident, f: got.put((ident, bytes(f[0]))),
                     curve=None if keys is None else load_curve(keys, transport_id))
    t.start()
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = *client_keys, zmq.auth.load_certificate(
                keys / "node.key_secret")[0]
        s.connect(f"tcp://{transport_id}")
        for frames in messages:
            s.send_multipart(frames)
        arrived = []
        deadline = time.monotonic() + 10
        while len(arrived) + sum(t.rejected.values()) < len(messages) and time.monotonic() < deadline:
            try:
                arrived.append(got.get(timeout=0.1))
            except queue.Empty:
                pass
        s.close(0)
    finally:
        ctx.term()
        t.close()
    return arrived, t


def test_a_message_on_a_connection_libzmq_named_is_filed_under_its_header_id():
    me = f"127.0.0.1:{free_port()}"
    fp = synthetic_fingerprint()
    arrived, t = _unnamed_dealer_sends(me, [hello("127.0.0.1:9", fp), [b"not a gossip message"]])
    assert [ident for ident, _ in arrived][0] == b"127.0.0.1:9"  # the header's id, not libzmq's
    junk = arrived[1][0]
    assert junk[:1] == b"\x00" and len(junk) == 5  # not one of ours: it keeps libzmq's name, decoding refuses it
    assert t.events["named-by-libzmq"] == 1 and not t.rejected


def test_with_curve_a_libzmq_named_connection_still_speaks_only_for_its_key(tmp_path):
    a_id, b_id = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    keys = tmp_path / "keys"
    generate_keys(keys, [a_id, b_id])
    b_key = zmq.auth.load_certificate(keys / key_file_name(b_id) / "node.key_secret")
    fp = synthetic_fingerprint()
    arrived, t = _unnamed_dealer_sends(a_id, [hello(b_id, fp), hello("127.0.0.1:3", fp)],
                                       keys=keys / key_file_name(a_id), client_keys=b_key)
    assert [ident for ident, _ in arrived] == [b_id.encode()]  # B's key, B's id: let in
    assert t.rejected == {"identity": 1}  # B's key claiming another id: refused, as with a named connection
    assert t.events["named-by-libzmq"] == 2

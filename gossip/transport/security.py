"""CurveZMQ for real nodes: key files, the allow-list, and who may speak as whom.

With ``gossip-node --curve-keys DIR`` every connection between nodes is
encrypted and authenticated with CurveZMQ. A node accepts a connection only
from a client whose public key is in its allow-list (ZeroMQ's ZAP handshake
hook), and it accepts a message only when the key of the connection it came
on is the key filed under the node id the message claims, so an allowed node
cannot speak as another one.

One key directory per node::

    DIR/node.key_secret     this node's key pair (a zmq.auth certificate; keep it private)
    DIR/allowed/NAME.key    the public key of every node allowed in the cluster, this one
                            included; NAME is the node id (HOST:PORT, as given to --listen
                            or --advertise) with ":" and any other character outside
                            [A-Za-z0-9.-] written as "_": 10.0.0.1:5555 -> 10.0.0.1_5555.key

The file names carry the trust: a node dialling 10.0.0.2:5555 expects the
server key in ``allowed/10.0.0.2_5555.key``, so the peer must prove it holds
that key's secret; and the peer's own messages must come from a connection
authenticated with that same key. ``gossip-keys OUT ID [ID ...]`` writes one
ready-to-copy directory per node (``OUT/NAME/``) and the shared allow-list
``OUT/allowed/``; run it again with new ids to add nodes. Keys copied into a
running node's ``allowed/`` are picked up without a restart: the directory is
re-read (at most once a second) when an unknown key knocks or an unknown peer
has to be dialled.

The policy (:class:`AllowList`: which keys, owned by which node ids) is kept
apart from the thread that drives the ZAP handshake (pyzmq's
:class:`~zmq.auth.thread.ThreadAuthenticator`), as pyzmq's ``zmq.auth`` does.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import stat
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import zmq
import zmq.auth

__all__ = ["KeyDirError", "NodeKeys", "AllowList", "CurveSecurity", "key_file_name", "load_curve",
           "generate_keys", "keys_main", "SECRET_FILE", "ALLOWED_DIR", "ZAP_DOMAIN"]

log = logging.getLogger("gossip.security")

SECRET_FILE = "node.key_secret"
ALLOWED_DIR = "allowed"
ZAP_DOMAIN = "gossip"


class KeyDirError(ValueError):
    """A key directory that cannot be used (missing, unreadable or inconsistent files)."""


def key_file_name(node_id: str) -> str:
    """The file stem under which ``node_id``'s public key is filed.

    >>> key_file_name("10.0.0.1:5555")
    '10.0.0.1_5555'
    """
    from gossip.transport.addresses import node_file_name

    return node_file_name(node_id)


def _load_public(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyDirError(f"{path}: not a readable zmq certificate ({e})") from None
    if not public or len(public) != 40:
        raise KeyDirError(f"{path}: the public key must be 40 z85 characters")
    return public


@dataclass(frozen=True)
class NodeKeys:
    """This node's CURVE key pair (z85-encoded, as ZeroMQ's socket options take them)."""

    public: bytes
    secret: bytes
    path: Path

    def __repr__(self) -> str:  # never print the secret
        return f"NodeKeys(public={self.public.decode()!r}, path={str(self.path)!r})"


class AllowList:
    """The ZAP policy: the public keys filed in ``directory``, by node name.

    It is also the credentials provider of pyzmq's authenticator
    (:meth:`callback`), so the same object answers the handshake (on the
    authenticator's thread) and the per-message and per-peer questions (on
    the transport's I/O thread); a lock keeps the two consistent while the
    directory is re-read.

    Parameters
    ----------
    directory : folder of ``NAME.key`` public-key certificates
    rescan_interval : seconds between two re-reads triggered by unknown keys or peers
    clock : time source (tests pass a fake one)
    """

    def __init__(self, directory: str | Path, *, rescan_interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = Path(directory)
        self.rescan_interval = rescan_interval
        self.clock = clock
        self.lock = threading.Lock()
        self.by_name: dict[str, bytes] = {}
        self.owners: dict[bytes, set[str]] = {}
        self.handshakes: Counter[str] = Counter()  # "allowed" / "denied"
        self.denied_keys: list[str] = []  # the first few keys refused, for the operator
        self._last_scan = -float("inf")
        self._scan(strict=True)

    # -- the directory ---------------------------------------------------------------------
    def _scan(self, strict: bool) -> None:
        if not self.directory.is_dir():
            raise KeyDirError(f"{self.directory}: no such directory (the allow-list of public keys)")
        by_name: dict[str, bytes] = {}
        for path in sorted(self.directory.glob("*.key")):
            try:
                by_name[path.stem] = _load_public(path)
            except KeyDirError as e:
                if strict:
                    raise
                # a file half-copied into a running node's allow-list must not stop it
                log.warning("skipping %s", e)
        if strict and not by_name:
            raise KeyDirError(f"{self.directory}: no *.key public-key files (make them with gossip-keys)")
        owners: dict[bytes, set[str]] = {}
        for name, key in by_name.items():
            owners.setdefault(key, set()).add(name)
        with self.lock:
            self.by_name, self.owners = by_name, owners
            self._last_scan = self.clock()

    def _rescan(self) -> bool:
        """Re-read the directory unless that was done less than ``rescan_interval`` ago."""
        if self.clock() - self._last_scan < self.rescan_interval:
            return False
        try:
            self._scan(strict=False)
        except KeyDirError as e:
            log.warning("cannot re-read the allow-list: %s", e)
            self._last_scan = self.clock()
            return False
        return True

    # -- questions -------------------------------------------------------------------------
    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: may a client with public key ``key`` (z85) connect? (pyzmq's provider interface)"""
        allowed = key in self.owners or (self._rescan() and key in self.owners)
        with self.lock:
            self.handshakes["allowed" if allowed else "denied"] += 1
            if not allowed:
                text = key.decode("ascii", "replace")
                if text not in self.denied_keys and len(self.denied_keys) < 8:
                    self.denied_keys.append(text)
                    log.warning("refused a connection: public key %s is not in %s", text, self.directory)
        return allowed

    def server_key(self, node_id: str) -> bytes | None:
        """The public key filed for ``node_id`` (None if there is none, even after a re-read)."""
        name = key_file_name(node_id)
        key = self.by_name.get(name)
        if key is None and self._rescan():
            key = self.by_name.get(name)
        return key

    def owns(self, node_id: str, user_id: str) -> bool:
        """Whether the z85 key ``user_id`` is the one filed for ``node_id``."""
        names = self.owners.get(user_id.encode("ascii", "replace"))
        return names is not None and key_file_name(node_id) in names

    def report(self) -> dict[str, Any]:
        with self.lock:
            return {"allowed_keys": len(self.by_name), "handshakes_allowed": self.handshakes["allowed"],
                    "handshakes_denied": self.handshakes["denied"], "denied_keys": list(self.denied_keys)}


class CurveSecurity:
    """What :class:`~gossip.transport.zmq.ZmqTransport` calls when built with ``curve=``.

    ``setup_server(router)`` makes the ROUTER a CURVE server and starts the ZAP
    handler on the router's context; ``setup_client(dealer, dst)`` makes a
    DEALER a CURVE client of peer ``dst``; ``check(ident, frame)`` returns
    ``"identity"`` when the connection's key is not the one filed for the
    routing id ``ident`` (None when it is); ``close()`` stops the ZAP handler
    (before the context is destroyed).
    """

    def __init__(self, keys: NodeKeys, allow: AllowList) -> None:
        self.keys = keys
        self.allow = allow
        self.authenticator: Any = None
        self.identity_refused = 0
        self._unknown_peers: set[str] = set()
        self._impostors: set[str] = set()

    def setup_server(self, router: zmq.Socket) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        if self.authenticator is None:
            self.authenticator = ThreadAuthenticator(router.context, log=logging.getLogger("gossip.security.zap"))
            self.authenticator.start()
            self.authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.allow)
        router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        router.setsockopt(zmq.CURVE_SERVER, 1)
        router.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
        router.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)

    def setup_client(self, dealer: zmq.Socket, dst: str) -> None:
        server = self.allow.server_key(dst)
        if server is None:
            # Nothing may reach a peer we cannot authenticate. A throwaway server key
            # makes every handshake with it fail, so no byte of ours is ever read there.
            if dst not in self._unknown_peers and len(self._unknown_peers) < 1024:
                self._unknown_peers.add(dst)
                log.warning("no public key for peer %s in %s (expected %s.key); not talking to it",
                            dst[:64], self.allow.directory, key_file_name(dst)[:64])
            server = zmq.curve_keypair()[0]
        dealer.setsockopt(zmq.CURVE_SERVERKEY, server)
        dealer.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
        dealer.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)

    def check(self, ident: bytes, frame: Any) -> str | None:
        """Refuse a message whose routing id is not the node its CURVE key belongs to."""
        try:
            user = frame.get("User-Id")
        except (zmq.ZMQError, AttributeError, TypeError):
            user = ""
        peer = ident.decode("utf-8", "replace")
        if user and self.allow.owns(peer, user):
            return None
        self.identity_refused += 1
        if peer not in self._impostors and len(self._impostors) < 1024:
            self._impostors.add(peer)
            log.warning("refused messages claiming to be %s from key %s (not the key filed for that id)",
                        peer[:64], user or "?")
        return "identity"

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None

    def report(self) -> dict[str, Any]:
        """For the node summary: what the allow-list let in and kept out."""
        return {"public_key": self.keys.public.decode(), **self.allow.report(),
                "identity_refused": self.identity_refused}


def load_curve(directory: str | Path, node_id: str) -> CurveSecurity:
    """Read ``--curve-keys DIR`` for node ``node_id``; :class:`KeyDirError` names what is wrong."""
    root = Path(directory)
    if not root.is_dir():
        raise KeyDirError(f"--curve-keys {directory}: no such directory")
    secret_path = root / SECRET_FILE
    if not secret_path.is_file():
        raise KeyDirError(f"--curve-keys {directory}: missing {SECRET_FILE} (this node's key pair; "
                          f"make one with: gossip-keys OUT {node_id})")
    try:
        public, secret = zmq.auth.load_certificate(secret_path)
    except (OSError, ValueError) as e:
        raise KeyDirError(f"--curve-keys {directory}: {SECRET_FILE} is not a zmq certificate ({e})") from None
    if not secret or not public or len(public) != 40 or len(secret) != 40:
        raise KeyDirError(f"--curve-keys {directory}: {SECRET_FILE} holds no secret key")
    mode = secret_path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s is readable by other users (mode %o); chmod 600 it", secret_path, stat.S_IMODE(mode))
    allowed_dir = root / ALLOWED_DIR
    if not allowed_dir.is_dir():
        raise KeyDirError(f"--curve-keys {directory}: missing {ALLOWED_DIR}/ (the public keys of the "
                          "nodes allowed in the cluster)")
    try:
        allow = AllowList(allowed_dir)
    except KeyDirError as e:
        raise KeyDirError(f"--curve-keys {directory}: {e}") from None
    mine = allow.by_name.get(key_file_name(node_id))
    own_file = f"{ALLOWED_DIR}/{key_file_name(node_id)}.key"
    if mine is None:
        raise KeyDirError(f"--curve-keys {directory}: missing {own_file}, this node's public key in the "
                          f"allow-list (peers find it under the node id {node_id})")
    if mine != public:
        raise KeyDirError(f"--curve-keys {directory}: {own_file} is not the public key of {SECRET_FILE}")
    return CurveSecurity(NodeKeys(public, secret, secret_path), allow)


def generate_keys(out: str | Path, node_ids: Sequence[str]) -> list[Path]:
    """Make a key pair for each node id; returns the per-node directories written.

    ``OUT/allowed/`` collects every public key; each ``OUT/NAME/`` holds that
    node's ``node.key_secret`` and a copy of the whole allow-list, ready to be
    copied to its machine and named by ``--curve-keys``. Existing nodes'
    directories get the new public keys too. Refuses (``KeyDirError``) to
    overwrite a key pair that exists.
    """
    from gossip.transport.addresses import parse_address

    root = Path(out)
    ids = [parse_address(i, "node id") for i in node_ids]
    if not ids:
        raise KeyDirError("name at least one node id (HOST:PORT)")
    names = [key_file_name(i) for i in ids]
    if len(set(names)) != len(names):
        raise KeyDirError("node ids repeat: " + ", ".join(sorted({i for i in ids if ids.count(i) > 1})))
    for name in names:
        if (root / name / SECRET_FILE).exists() or (root / ALLOWED_DIR / f"{name}.key").exists():
            raise KeyDirError(f"{root / name}: a key for this node exists already; delete it to make a new one")
    shared = root / ALLOWED_DIR
    shared.mkdir(parents=True, exist_ok=True)
    made = []
    for name in names:
        node_dir = root / name
        node_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        public_file, secret_file = zmq.auth.create_certificates(node_dir, "node")
        os.chmod(secret_file, 0o600)
        shutil.copyfile(public_file, shared / f"{name}.key")
        made.append(node_dir)
    # every node directory gets every public key (new nodes learn the old, old ones the new)
    for node_dir in sorted(p for p in root.iterdir() if (p / SECRET_FILE).is_file()):
        allowed = node_dir / ALLOWED_DIR
        allowed.mkdir(exist_ok=True)
        for key in shared.glob("*.key"):
            if not (allowed / key.name).exists():
                shutil.copyfile(key, allowed / key.name)
    return made


def keys_main(argv: Sequence[str] | None = None) -> int:
    """``gossip-keys OUT ID [ID ...]``: make CURVE key directories; exit 2 on bad input."""
    p = argparse.ArgumentParser(
        prog="gossip-keys",
        description="Make CurveZMQ key pairs for gossip-node --curve-keys. Writes OUT/NAME/ for each node "
                    "(its secret key and the allow-list of every node's public key) and OUT/allowed/. Copy "
                    "OUT/NAME/ to that node and run gossip-node --curve-keys DIR. Run again with new ids to "
                    "add nodes, then copy their OUT/allowed/*.key into the running nodes' DIR/allowed/.")
    p.add_argument("out", metavar="OUT", help="output directory (created if missing)")
    p.add_argument("ids", nargs="+", metavar="ID", help="node ids, HOST:PORT as given to --listen / --advertise")
    args = p.parse_args(argv)
    try:
        made = generate_keys(args.out, args.ids)
    except (KeyDirError, ValueError) as e:
        print(f"gossip-keys: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"gossip-keys: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 2
    for node_dir in made:
        print(f"{node_dir}/  ->  gossip-node --curve-keys DIR  (copy this folder to the node as DIR)")
    print(f"{Path(args.out) / ALLOWED_DIR}/  holds every public key; copy new ones into running nodes' allowed/")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(keys_main())

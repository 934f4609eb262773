"""From a launcher's environment to node settings: host lists, peers files, SLURM.

``gossip-node`` needs three things to join a cluster: an address to listen on,
the address others reach it at, and a few existing members (``--peers``). On a
laptop you type them; on a cluster they follow from where the launcher put the
process. This module derives them, without touching the network:

- :func:`expand_hostlist` reads SLURM's compressed host lists (``node[01-03,07]``);
- :func:`read_peers_file` reads a file of ``HOST:PORT`` entries (``--peers-file``);
- :func:`from_slurm` turns an ``srun`` task's environment into a :class:`SlurmTask`
  (``--slurm``): every task of the job step is a member, each at
  ``HOST:(base_port + SLURM_LOCALID)``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from os import PathLike
from typing import Mapping

from gossip.transport.addresses import parse_address

__all__ = ["expand_hostlist", "read_peers_file", "parse_peer_entries", "tasks_per_node", "from_slurm",
           "SlurmTask", "DEFAULT_SLURM_PORT", "MAX_HOSTS"]

DEFAULT_SLURM_PORT = 29400
MAX_HOSTS = 65536  # a typo like n[0-9999999] must not build a list of ten million names

_HOST_CHARS = re.compile(r"^[A-Za-z0-9_.\-]*$")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str, seps: str) -> list[str]:
    """Split on any of ``seps`` outside brackets (``a[1,2],b`` -> ``a[1,2]``, ``b``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch in seps and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _expand_group(body: str, item: str) -> list[str]:
    """The numbers of one bracket group, ``01-03,07`` -> ``01 02 03 07`` (zero padding kept)."""
    out: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(f"host list {item!r}: bad range {part.strip()!r} in [{body}] "
                             "(expected N or N-M, e.g. node[01-04,07])")
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise ValueError(f"host list {item!r}: range {part.strip()!r} runs backwards")
        if hi - lo + 1 > MAX_HOSTS:
            raise ValueError(f"host list {item!r}: range {part.strip()!r} names more than {MAX_HOSTS} hosts")
        width = len(lo_text)  # SLURM pads to the width of the lower bound: [08-10] -> 08 09 10
        out.extend(str(v).zfill(width) for v in range(lo, hi + 1))
    return out


def _expand_item(item: str) -> list[str]:
    """One host expression without top-level commas, e.g. ``r[1-2]n[01-02]``."""
    pieces: list[list[str]] = []  # literal text and bracket groups, in order
    rest = item
    while rest:
        open_at = rest.find("[")
        close_at = rest.find("]")
        if open_at < 0:
            if close_at >= 0:
                raise ValueError(f"host list {item!r}: ']' without '['")
            pieces.append([rest])
            break
        if 0 <= close_at < open_at:
            raise ValueError(f"host list {item!r}: ']' without '['")
        end = rest.find("]", open_at)
        if end < 0:
            raise ValueError(f"host list {item!r}: '[' without ']'")
        body = rest[open_at + 1:end]
        if "[" in body:
            raise ValueError(f"host list {item!r}: nested brackets")
        if not body.strip():
            raise ValueError(f"host list {item!r}: empty brackets")
        pieces.append([rest[:open_at]])
        pieces.append(_expand_group(body, item))
        rest = rest[end + 1:]
    literal = "".join(p[0] for p in pieces if len(p) == 1)
    if not _HOST_CHARS.match(literal):
        raise ValueError(f"host list {item!r}: a host name may hold only letters, digits, '.', '-' and '_'")
    total = 1
    for p in pieces:
        total *= len(p)
    if total > MAX_HOSTS:
        raise ValueError(f"host list {item!r} names more than {MAX_HOSTS} hosts")
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM compressed host list into host names, in order.

    Parameters
    ----------
    text : str
        Comma-separated host expressions; brackets hold comma-separated numbers
        and ranges, zero padding follows the lower bound, and several bracket
        groups in one name expand as a product (last group fastest).

    Returns
    -------
    list of str
        The host names; a malformed list raises ``ValueError`` naming the bad text.

    Examples
    --------
    >>> expand_hostlist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    >>> expand_hostlist("r[1-2]n[3-4]")
    ['r1n3', 'r1n4', 'r2n3', 'r2n4']
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"host list {text!r} is empty")
    hosts: list[str] = []
    for item in _split_top_level(text.strip(), ","):
        item = item.strip()
        if not item:
            raise ValueError(f"host list {text!r}: empty entry (two commas in a row?)")
        expanded = _expand_item(item)
        if any(not h for h in expanded):
            raise ValueError(f"host list {text!r}: empty host name in {item!r}")
        hosts.extend(expanded)
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"host list {text!r} names more than {MAX_HOSTS} hosts")
    return hosts


def parse_peer_entries(text: str, what: str = "peer") -> list[str]:
    """``HOST:PORT`` entries separated by commas or spaces; hosts may be host lists.

    ``node[01-02]:5555`` stands for ``node01:5555,node02:5555``. Each entry is
    validated (and normalised) like a ``--peers`` entry; ``tcp://`` is allowed.
    """
    out: list[str] = []
    for token in _split_top_level(text, ", \t"):
        token = token.strip()
        if not token:
            continue
        try:
            out.append(parse_address(token, what))  # also [IPv6]:PORT
            continue
        except ValueError:
            if "[" not in token:
                raise
        # a host list: node[01-04]:5555
        body = token[len("tcp://"):] if token.startswith("tcp://") else token
        hosts, sep, port = body.rpartition(":")
        if not sep or "]" in port:
            raise ValueError(f"{what} {token!r} is not HOST:PORT (a host list needs a port: node[01-04]:5555)")
        try:
            names = expand_hostlist(hosts)
        except ValueError as e:
            raise ValueError(f"{what} {token!r}: {e}") from None
        out.extend(parse_address(f"{h}:{port}", what) for h in names)
    return out


def read_peers_file(path: str | PathLike[str]) -> list[str]:
    """Read ``HOST:PORT`` entries (the members to contact) from a file.

    One entry per line, or several separated by commas or spaces; ``#`` starts a
    comment, blank lines are ignored, hosts may be SLURM host lists
    (``node[01-08]:29400``). Duplicates are dropped, the order is kept.

    Raises ``ValueError`` naming the file and the line of a bad entry, or the
    file when it cannot be read.

    Examples
    --------
    A file listing every node may be given to every node: each one leaves
    itself out (``gossip-node --peers-file hosts.txt``)::

        # hosts.txt
        10.0.0.1:5555
        10.0.0.2:5555, 10.0.0.3:5555
        gpu[01-04]:5555
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"peers file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"peers file {path}: not a UTF-8 text file") from None
    peers: list[str] = []
    for number, line in enumerate(lines, start=1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        try:
            entries = parse_peer_entries(content, "entry")
        except ValueError as e:
            raise ValueError(f"peers file {path}, line {number}: {e}") from None
        peers.extend(p for p in entries if p not in peers)
    return peers


def tasks_per_node(text: str, nodes: int | None = None, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand SLURM's tasks-per-node form, ``2(x3),1`` -> ``[2, 2, 2, 1]``.

    A single number with ``nodes`` given means that many tasks on every node
    (the ``SLURM_NTASKS_PER_NODE`` form).
    """
    counts: list[int] = []
    for part in str(text).split(","):
        m = re.match(r"^\s*(\d+)\s*(?:\(x(\d+)\))?\s*$", part)
        if not m:
            raise ValueError(f"{name}={text!r} is not a tasks-per-node list (expected e.g. 2(x3),1)")
        count, repeat = int(m.group(1)), int(m.group(2) or 1)
        if repeat < 1 or repeat > MAX_HOSTS:
            raise ValueError(f"{name}={text!r}: bad repeat count in {part.strip()!r}")
        counts.extend([count] * repeat)
    if nodes is not None and len(counts) == 1 and nodes > 1:
        counts = counts * nodes
    return counts


@dataclass(frozen=True)
class SlurmTask:
    """This task's place in a SLURM job step, as ``gossip-node`` settings."""

    listen: str                 # tcp://0.0.0.0:PORT: bind every interface of this host
    node_id: str                # HOST:PORT others reach this task at (--advertise)
    peers: tuple[str, ...]      # every other task of the step, HOST:PORT
    rank: int                   # SLURM_PROCID: the data shard
    world_size: int             # SLURM_NTASKS: the number of shards
    host: str                   # this task's host, from the node list
    local_id: int               # SLURM_LOCALID: the task's index on its host


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for n in names:
        v = environ.get(n)
        if v is not None and v.strip():
            return n, v.strip()
    return None


def _int_var(environ: Mapping[str, str], name: str) -> int:
    text = environ.get(name)
    if text is None or not text.strip():
        raise ValueError(f"--slurm: {name} is not set (run gossip-node --slurm under srun)")
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--slurm: {name}={text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"--slurm: {name}={text!r} must be >= 0")
    return value


def from_slurm(environ: Mapping[str, str], base_port: int = DEFAULT_SLURM_PORT) -> SlurmTask:
    """Derive this task's listen address, node id, peers, rank and world size.

    Parameters
    ----------
    environ : mapping
        The task's environment (``os.environ`` under ``srun``). Read:
        ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``, ``SLURM_NODELIST``),
        ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``,
        ``SLURM_NTASKS_PER_NODE``), ``SLURM_NTASKS``, ``SLURM_PROCID``,
        ``SLURM_LOCALID``, and ``SLURMD_NODENAME`` or ``SLURM_NODEID`` for this
        task's host.
    base_port : int
        Task ``SLURM_LOCALID`` of every host listens on ``base_port + SLURM_LOCALID``.

    Returns
    -------
    SlurmTask
        A missing or ill-formed variable raises ``ValueError`` naming it.

    Examples
    --------
    >>> env = {"SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4",
    ...        "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURMD_NODENAME": "gpu2"}
    >>> t = from_slurm(env, 29400)
    >>> t.node_id, t.peers, t.rank, t.world_size
    ('gpu2:29401', ('gpu1:29400', 'gpu1:29401', 'gpu2:29400'), 3, 4)
    """
    if isinstance(base_port, bool) or not isinstance(base_port, int) or not 0 < base_port < 65536:
        raise ValueError(f"--slurm-port must be a port in 1..65535, got {base_port!r}")
    found = _first(environ, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if found is None:
        raise ValueError("--slurm: SLURM_JOB_NODELIST is not set (run gossip-node --slurm under srun)")
    hosts_var, hosts_text = found
    try:
        hosts = expand_hostlist(hosts_text)
    except ValueError as e:
        raise ValueError(f"--slurm: {hosts_var}: {e}") from None
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"--slurm: {hosts_var}={hosts_text!r} names a host twice")
    found = _first(environ, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"))
    if found is None:
        raise ValueError("--slurm: SLURM_TASKS_PER_NODE is not set (run gossip-node --slurm under srun)")
    tasks_var, tasks_text = found
    counts = tasks_per_node(tasks_text, len(hosts), tasks_var)
    if len(counts) != len(hosts):
        raise ValueError(f"--slurm: {tasks_var}={tasks_text!r} gives {len(counts)} node(s) but "
                         f"{hosts_var}={hosts_text!r} names {len(hosts)}")
    world = _int_var(environ, "SLURM_NTASKS")
    if world < 1 or sum(counts) != world:
        raise ValueError(f"--slurm: SLURM_NTASKS={world} does not match {tasks_var}={tasks_text!r} "
                         f"({sum(counts)} tasks)")
    rank = _int_var(environ, "SLURM_PROCID")
    if rank >= world:
        raise ValueError(f"--slurm: SLURM_PROCID={rank} is not below SLURM_NTASKS={world}")
    local = _int_var(environ, "SLURM_LOCALID")
    if base_port + max(counts) - 1 > 65535:
        raise ValueError(f"--slurm-port {base_port} + {max(counts)} tasks per node runs past port 65535")

    name = (environ.get("SLURMD_NODENAME") or "").strip()
    if name in hosts:
        host_index = hosts.index(name)
    elif "SLURM_NODEID" in environ:
        host_index = _int_var(environ, "SLURM_NODEID")
        if host_index >= len(hosts):
            raise ValueError(f"--slurm: SLURM_NODEID={host_index} but {hosts_var} names {len(hosts)} host(s)")
    elif name:
        raise ValueError(f"--slurm: SLURMD_NODENAME={name!r} is not in {hosts_var}={hosts_text!r}")
    else:
        raise ValueError("--slurm: SLURMD_NODENAME is not set (nor SLURM_NODEID): cannot tell this task's host")
    host = hosts[host_index]
    if local >= counts[host_index]:
        raise ValueError(f"--slurm: SLURM_LOCALID={local} but {tasks_var}={tasks_text!r} puts "
                         f"{counts[host_index]} task(s) on {host}")

    # every (host, local id) pair is a task: the set does not depend on how ranks were distributed
    members = [parse_address(f"{h}:{base_port + i}", f"--slurm: {hosts_var} host")
               for h, n in zip(hosts, counts) for i in range(n)]
    node_id = parse_address(f"{host}:{base_port + local}", f"--slurm: {hosts_var} host")
    return SlurmTask(listen=f"tcp://0.0.0.0:{base_port + local}", node_id=node_id,
                     peers=tuple(m for m in members if m != node_id), rank=rank, world_size=world, host=host,
                     local_id=local)

"""Command-line entry points: ``gossip-sim`` (and, with the ZeroMQ peer, ``gossip-node``).

Thin by design: parse, build a config, call the library, print. Bad input
prints one line naming the problem and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from typing import Any, Sequence

from gossip.protocol.timing import DEFAULT_DETECTOR, DETECTORS, Timing

__all__ = ["sim_main", "build_sim_parser", "node_main", "build_node_parser", "mixing_settings"]

EXIT_USAGE = 2

TIMING = Timing()  # the defaults the flags show


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return parse


def _nonneg_int(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {v}")
        return v

    return parse


def _positive_float(name: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"{name} must be a positive number, got {text}")
        return v

    return parse


def _gamma(text: str) -> float | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gamma must be a number in (0, 1] or 'auto', got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"--gamma must be in (0, 1], got {text}")
    return v


def mixing_settings(options: Any) -> Any:
    """The one :class:`~gossip.mixing.settings.MixingSettings` of a command line (flags and
    TOML keys merged): an argparse namespace or a dict, read for the mixing options only.
    A bad value raises ValueError naming the flag."""
    from gossip.mixing.settings import MIXING_OPTIONS, MixingSettings, OptionError

    values = options if isinstance(options, dict) else vars(options)
    flat = {k: values[k] for k in MIXING_OPTIONS if values.get(k) is not None}
    if "link_policy" in flat:
        flat["link_policy"] = tuple(flat["link_policy"])
    try:
        return MixingSettings(**flat)
    except OptionError as e:
        raise ValueError(e.for_cli()) from None


def add_progress_args(p: argparse.ArgumentParser) -> None:
    """--progress / --no-progress (default: a bar only when stderr is a terminal)."""
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always draw the progress bar (default: only when stderr is a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="never draw it")


def add_training_args(p: argparse.ArgumentParser) -> None:
    """Options shared by gossip-sim and gossip-node."""
    from gossip.mixing import ALGORITHMS

    p.add_argument("--topology", default="ring", metavar="SPEC",
                   help="graph: ring, torus[:RxC], exponential, one-peer-exponential, complete, star, "
                        "random-regular[:D], small-world[:K,P], hierarchical:S1,S2[,intra=..,inter=..], file:PATH "
                        "(default: ring)")
    p.add_argument("--algorithm", default="gossip", choices=ALGORITHMS,
                   help="mixing rule: synchronous gossip (D-PSGD; CHOCO when compressed), choco, naive "
                        "(compressed averaging without error feedback, an ablation) or push-sum (SGP) "
                        "(default: gossip)")
    p.add_argument("--compression", default="none", metavar="CODEC",
                   help="codec: none, fp16, bf16, int8[:BLOCK], topk:RATIO, randk:RATIO, sign (default: none)")
    p.add_argument("--gamma", type=_gamma, default=None, metavar="G",
                   help="CHOCO consensus step size in (0, 1], or 'auto' to tune it on the mixing matrix "
                        "(default: the codec's own, e.g. 0.04 for topk:0.01)")
    p.add_argument("--period", type=_positive_int("--period"), default=1, metavar="K",
                   help="local steps between exchanges (default: 1)")
    p.add_argument("--async", dest="asynchronous", action="store_true", default=False,
                   help="never wait for neighbours: mix what has arrived, weighted by staleness")
    p.add_argument("--staleness", default=None, metavar="DECAY",
                   help="with --async: weight of a message s steps old: constant, poly:A ((1+s)^-A), "
                        "hinge:A,B, exp:A (default: hinge:1,2)")
    p.add_argument("--overlap", action="store_true", default=False,
                   help="let a round's messages travel while the next local steps compute")
    p.add_argument("--link-policy", action="append", default=None, metavar="CLASS:OPTIONS",
                   help="per link class (intra, inter): period=K, codec=C, algorithm=A, gamma=G, staleness=D, "
                        "clip=TAU|auto|none, outer=SPEC, async|sync (options left out are the run's own); e.g. inter:period=20,codec=topk:0.01,async (repeatable)")
    p.add_argument("--clip", default=None, metavar="TAU|auto",
                   help="robust mixing: clip each neighbour's difference to radius TAU, or 'auto' (the lower "
                        "median of the neighbours' distances)")
    p.add_argument("--outer", default=None, metavar="SPEC",
                   help="outer optimizer on each exchange (pseudo-gradient = parameters at the last exchange - "
                        "mixed parameters now): sgd:lr=1 (the default: plain gossip), nesterov:lr=0.7,momentum=0.9 "
                        "(DiLoCo), noloco[:lr=0.7,momentum=0.5] (NoLoCo); also per link class in --link-policy")
    p.add_argument("--task", default="synthetic", metavar="TASK",
                   help="synthetic, digits (needs scikit-learn), or module:attr; built-ins take options, "
                        "e.g. digits:lr=0.1,batch_size=64 (default: synthetic)")
    p.add_argument("--split", default="iid", metavar="SPLIT", help="iid or dirichlet:ALPHA (default: iid)")
    p.add_argument("--steps", type=_nonneg_int("--steps"), default=200, metavar="S",
                   help="local steps per node (default: 200)")
    p.add_argument("--seed", type=int, default=0, metavar="X", help="run seed (default: 0)")
    p.add_argument("--timeout", type=_positive_float("--timeout"), default=30.0, metavar="SEC",
                   help="how long a synchronous round waits for a neighbour (default: 30)")
    p.add_argument("--device", default="auto", metavar="DEV",
                   help="auto, cpu, cuda or cuda:N (default: auto = cuda:LOCAL_RANK when CUDA is present, else cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON line with the final figures")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")


def build_sim_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gossip-sim",
        description="Simulate decentralized gossip training of N nodes on one machine, on a virtual clock "
                    "with modelled links and compute.")
    p.add_argument("--nodes", type=_positive_int("--nodes"), default=8, metavar="N", help="number of nodes (default: 8)")
    add_training_args(p)
    p.add_argument("--link", default="lan", metavar="SPEC",
                   help="intra-datacenter link: lan, wan, or latency=0.1ms,bandwidth=10Gbit,jitter=0,loss=0 "
                        "(default: lan = 0.1 ms, 10 Gbit/s)")
    p.add_argument("--inter-link", default="wan", metavar="SPEC",
                   help="inter-datacenter link, same syntax (default: wan = 50 ms, 100 Mbit/s)")
    p.add_argument("--compute", default="fixed:0.01", metavar="MODEL",
                   help="step time: fixed:SEC, lognormal:MEAN,CV, exponential:MEAN, measured[:SCALE] "
                        "(default: fixed:0.01)")
    p.add_argument("--slow", default=None, metavar="NODE=FACTOR,...", help="slow nodes, e.g. 3=5 (node 3 five times slower)")
    p.add_argument("--eval-every", type=_nonneg_int("--eval-every"), default=0, metavar="S",
                   help="local steps between evaluations (default: 0 = about 20 per run)")
    p.add_argument("--byzantine", default=None, metavar="NODE=FACTOR,...",
                   help="misbehaving nodes for robustness studies: node NODE sends its parameters x FACTOR")
    p.add_argument("--fault", action="append", default=None, metavar="EVENT",
                   help="crash:N@T, join:N@T or partition:A|B@T1-T2 (node groups like 0-3,7; repeatable); a run "
                        "with faults runs every node's real control plane (gossip-node's membership, failure "
                        "detector, joins with a state pull, merges; their log lines with -v)")
    p.add_argument("--detect", type=float, default=TIMING.dead_after, metavar="SEC",
                   help="with --fault: the failure detector's --dead-after, with --heartbeat SEC/4 and --settle "
                        "SEC/4 (default: 3)")
    p.add_argument("--detector", choices=DETECTORS, default=DEFAULT_DETECTOR,
                   help="with --fault: the nodes' failure detector, as gossip-node --detector (default: "
                        "%(default)s)")
    p.add_argument("--engine", default="auto", metavar="auto|lockstep|batched|per-node",
                   help="how nodes run: lockstep = every node a round at a time, one vectorised step and one "
                        "sparse mixing product (synchronous exact gossip, fixed compute, no faults), batched = "
                        "all nodes' steps due together as one vectorised call (tasks that allow it), per-node = "
                        "one model at a time, auto = the first of these the run allows (default: auto); with "
                        "--fault only auto or per-node (the real control plane, one model at a time)")
    p.add_argument("--out", default=None, metavar="FILE.jsonl", help="write metrics as JSON lines")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write the metrics as TensorBoard scalars in DIR (needs the tensorboard extra)")
    add_progress_args(p)
    return p


def setup_logging(verbosity: int, node: str | None = None) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    prefix = f"[{node}] " if node else ""
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
                        stream=sys.stderr)


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def sim_main(argv: Sequence[str] | None = None) -> int:
    """``gossip-sim``: run one simulation; exit 0 on success, 2 on bad input."""
    args = build_sim_parser().parse_args(argv)
    setup_logging(args.verbose)
    # every simulated node's control plane logs its view of each fault (removals, merges,
    # joins) as a real node does: dozens of lines per fault; shown with -v
    quiet = [logging.getLogger(name) for name in ("gossip.peer", "gossip.control", "gossip.membership",  # logger names
                                                  "gossip.detector", "gossip.simcluster")] \
        if args.fault and args.verbose <= 0 else []
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        return _sim(args)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)


def _sim(args: argparse.Namespace) -> int:
    from gossip.api import SimConfig, simulate

    try:
        cfg = SimConfig(nodes=args.nodes, topology=args.topology, mixing=mixing_settings(args), task=args.task,
                        split=args.split, steps=args.steps, seed=args.seed, link=args.link, inter_link=args.inter_link,
                        compute=args.compute, slow=args.slow, timeout=args.timeout, eval_every=args.eval_every,
                        faults=args.fault, detect=args.detect, detector=args.detector, byzantine=args.byzantine,
                        device=args.device, engine=args.engine)
        out: Any = args.out
        if args.tensorboard:  # the JSONL records, also as TensorBoard scalars
            from gossip.peer.tensorboard_log import open_metrics

            out = open_metrics(args.out, args.tensorboard)
        try:
            result = simulate(cfg, out=out, progress=args.progress)
        finally:
            if out is not args.out:
                out.close()
    except ValueError as e:
        return _fail("gossip-sim", str(e))
    except OSError as e:
        return _fail("gossip-sim", f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    if args.json:
        print(json.dumps(result.summary, default=_json_default))
    elif not args.out:
        s = result.summary
        print(f"{s['nodes']} nodes, {s['topology']}, {s['algorithm']}: averaged-model accuracy "
              f"{s['final_accuracy']:.4f}, mean node accuracy {s['mean_node_accuracy']:.4f}, "
              f"consensus distance {s['consensus_distance']:.3g}, {s['bytes_sent'] / 1e6:.2f} MB sent, "
              f"{s['sim_time_s']:.2f} s simulated in {s['wall_time_s']:.2f} s")
    return 0


# -- gossip-node ----------------------------------------------------------------------------

NODE_FLAGS = {
    # dest: (type for TOML values, help)
    "listen": str, "advertise": str, "peers": str, "topology": str, "algorithm": str, "compression": str,
    "period": int, "task": str, "split": str, "steps": int, "seed": int, "rank": int, "world_size": int,
    "device": str, "dc": str, "timeout": float, "heartbeat": float, "dead_after": float, "settle": float,
    "join_timeout": float, "start_hold": float, "join_margin": int, "grace": float, "checkpoint_dir": str, "checkpoint_every": int,
    "resume": bool, "log": str, "eval_every": int, "max_message_mb": float, "json": bool, "gamma": (float, str),
    "threads": int, "emulate": list, "emulate_origin": float, "curve_keys": str, "peers_file": str, "slurm": bool, "slurm_port": int,
    "progress": bool, "tensorboard": str, "clip": (float, str), "asynchronous": bool, "staleness": str, "overlap": bool, "link_policy": list,
    "outer": str, "detector": str, "wait_for_suspects": bool, "nproc_per_node": int, "intra": str, "max_restarts": int, "as_group": int,
}
INTRA = ("ddp", "fsdp")  # inside a group of --nproc-per-node processes (gossip.groups.group)


def build_node_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gossip-node",
        description="Run one masterless gossip training node. Start one per machine (or GPU); name any "
                    "existing nodes with --peers. Options may also come from --config FILE.toml (flags win).")
    p.add_argument("--config", metavar="FILE.toml", help="read options from a TOML file (keys as the long flags)")
    p.add_argument("--listen", metavar="tcp://HOST:PORT", help="address to bind (required)")
    p.add_argument("--advertise", metavar="HOST:PORT", help="address peers use to reach this node "
                                                            "(default: the listen address)")
    p.add_argument("--peers", metavar="HOST:PORT[,...]", help="some existing nodes to contact (any will do)")
    p.add_argument("--peers-file", metavar="FILE",
                   help="more peers, HOST:PORT per line (# comments; host lists like node[01-08]:5555); "
                        "a file listing every node may be given to all: each leaves itself out")
    p.add_argument("--slurm", action="store_true",
                   help="under srun: take --listen, --advertise, --peers, --rank and --world-size from the SLURM "
                        "environment (every task of the step is a member; flags given explicitly win)")
    p.add_argument("--slurm-port", type=_positive_int("--slurm-port"), default=None, metavar="PORT",
                   help="with --slurm: task SLURM_LOCALID listens on PORT + SLURM_LOCALID (default: 29400)")
    add_training_args(p)
    p.set_defaults(device="auto", timeout=5.0)  # real rounds: a few heartbeats, not the simulator's 30 s
    p.add_argument("--rank", type=int, metavar="R", help="data shard index (with --world-size); default: this "
                                                         "node's index in the sorted member list")
    p.add_argument("--world-size", type=int, metavar="W", help="number of data shards (with --rank)")
    p.add_argument("--dc", default="", metavar="NAME", help="datacenter label; links between labels are inter-DC")
    p.add_argument("--heartbeat", type=_positive_float("--heartbeat"), default=TIMING.heartbeat, metavar="SEC",
                   help="probe interval (default: %(default)s)")
    p.add_argument("--dead-after", type=_positive_float("--dead-after"), default=TIMING.dead_after, metavar="SEC",
                   help="silence before a member is declared dead (default: %(default)s)")
    p.add_argument("--detector", choices=DETECTORS, default=DEFAULT_DETECTOR,
                   help="failure detector: heartbeat (every member pings every other each --heartbeat) or swim "
                        "(each pings one member per --heartbeat, with indirect probes; constant traffic per "
                        "node); every member must use the same (default: %(default)s)")
    p.add_argument("--wait-for-suspects", action="store_true",
                   help="a synchronous round waits for a neighbour the failure detector suspects (it failed a "
                        "direct and the indirect probes) until it is declared dead or --timeout passes; by "
                        "default the round goes on without a suspect that also sent nothing for 4 of its usual "
                        "gaps between messages (a live neighbour answers probes, however slow its training; "
                        "one behind a slow link keeps sending)")
    p.add_argument("--settle", type=float, default=TIMING.settle, metavar="SEC",
                   help="member set stable this long before a fresh cluster starts (default: %(default)s)")
    p.add_argument("--join-timeout", type=_positive_float("--join-timeout"), default=TIMING.join_timeout,
                   metavar="SEC", help="wait this long for peers before training alone (default: %(default)s)")
    p.add_argument("--start-hold", type=_positive_float("--start-hold"), default=TIMING.start_hold, metavar="SEC",
                   help="a peer that has not answered holds the start of those that did back this long at most; "
                        "it joins when it comes (default: %(default)s)")
    p.add_argument("--join-margin", type=_nonneg_int("--join-margin"), default=TIMING.join_margin, metavar="ROUNDS",
                   help="rounds between announcing a join and adopting it (default: %(default)s)")
    p.add_argument("--grace", type=float, default=TIMING.grace, metavar="SEC",
                   help="a finished node keeps serving others this long at most (default: %(default)s)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints here (atomic files)")
    p.add_argument("--checkpoint-every", type=_nonneg_int("--checkpoint-every"), default=0, metavar="S",
                   help="local steps between checkpoints (default: 0 = only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--log", metavar="FILE.jsonl", help="write metrics as JSON lines")
    p.add_argument("--eval-every", type=_nonneg_int("--eval-every"), default=0, metavar="S",
                   help="local steps between evaluations in --log (default: steps/10)")
    p.add_argument("--max-message-mb", type=float, default=0.0, metavar="MB",
                   help="largest message accepted (default: three models, more with outer momenta, + 1 MiB)")
    p.add_argument("--emulate", action="append", default=None, metavar="CLASS:SPEC",
                   help="emulate slow links on one machine (off by default): CLASS intra, inter or all, SPEC as "
                        "--link in gossip-sim, e.g. inter:latency=50ms,bandwidth=100Mbit,loss=0.01; "
                        "inter:down=10s-30s cuts the datacenters apart from 10 to 30 s after start (down= may "
                        "repeat: several outages); repeatable")
    p.add_argument("--emulate-origin", type=float, default=None, metavar="UNIX_S",
                   help="count --emulate's down windows from this UNIX time (seconds) instead of this node's start: "
                        "nodes started at different moments then cut their links at the same moment")
    p.add_argument("--curve-keys", metavar="DIR",
                   help="encrypt and authenticate with CurveZMQ: DIR/node.key_secret is this node's key pair, "
                        "DIR/allowed/*.key the public keys of the nodes allowed in (make them with gossip-keys)")
    p.add_argument("--nproc-per-node", type=_positive_int("--nproc-per-node"), default=1, metavar="K",
                   help="run this member as a group of K processes, one per device, under torchrun's launcher: "
                        "torch.distributed inside (--intra), sharded gossip between groups; rank r listens on "
                        "the --listen port + r (default: 1, a single process)")
    p.add_argument("--intra", choices=INTRA, default="ddp",
                   help="inside a group: ddp (a replica per rank, gradients all-reduced) or fsdp (fully_shard: "
                        "the model only has to fit across the group) (default: %(default)s)")
    p.add_argument("--as-group", type=_positive_int("--as-group"), default=1, metavar="K",
                   help="gossip as a DDP group of K ranks from this one process, to train in a cluster of such "
                        "groups (gossip-node --nproc-per-node K --intra ddp): the model in K slices, slice r "
                        "exchanged at the --listen port + r (default: 1)")
    p.add_argument("--max-restarts", type=_nonneg_int("--max-restarts"), default=0, metavar="N",
                   help="with --nproc-per-node: start the group again this many times after a rank dies; each "
                        "start is a new life that rejoins the cluster (default: 0)")
    p.add_argument("--threads", type=_positive_int("--threads"), default=None, metavar="N",
                   help="torch intra-op threads (default: torch's choice; use 1 when several nodes share a machine)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write the metrics as TensorBoard scalars in DIR/<node id>/ (needs the tensorboard extra)")
    add_progress_args(p)
    return p


def _load_toml(path: str) -> dict[str, Any]:
    try:
        import tomllib  # type: ignore[import-not-found]
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config {path}: {e}") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = {"async": "asynchronous"}.get(key, key.replace("-", "_"))
        if dest not in NODE_FLAGS or dest == "config":
            raise ValueError(f"config {path}: unknown option {key!r}; valid: "
                             + ", ".join(sorted(k.replace('_', '-') for k in NODE_FLAGS)))
        wants = NODE_FLAGS[dest] if isinstance(NODE_FLAGS[dest], tuple) else (NODE_FLAGS[dest],)
        if dest == "peers" and isinstance(value, list):
            value = ",".join(map(str, value))
        ok = isinstance(value, wants) and not (bool not in wants and isinstance(value, bool))
        if float in wants and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ValueError(f"config {path}: option {key!r} must be {' or '.join(w.__name__ for w in wants)}, "
                             f"got {value!r}")
        out[dest] = value
    return out


def _own_peers(peers: list[str], listen: str, advertise: str | None) -> tuple[str, ...]:
    """Peers in order, each once, without this node (a shared host list names every node)."""
    from gossip.transport.addresses import parse_address

    normal = [parse_address(p, "--peers entry") for p in peers]
    me = {parse_address(listen, "--listen")}
    if advertise:
        me.add(parse_address(advertise, "--advertise"))
    return tuple(dict.fromkeys(p for p in normal if p not in me))


def node_config_from_args(argv: Sequence[str] | None) -> tuple[Any, argparse.Namespace]:
    """Parse flags (and --config), returning (PeerConfig, namespace)."""
    from gossip.protocol.config import PeerConfig

    parser = build_node_parser()
    defaults = {a.dest: a.default for a in parser._actions if a.dest != "help"}
    parser.set_defaults(**{k: None for k in defaults})  # to tell "given" from "defaulted"
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None and (v is not False or k == "progress")}
    merged = dict(defaults)
    if args.config:
        merged.update(_load_toml(args.config))
    merged.update(given)
    peers = [p.strip() for p in (merged.get("peers") or "").split(",") if p.strip()]
    if merged.get("peers_file"):
        from gossip.peer.launch import read_peers_file

        peers += read_peers_file(merged["peers_file"])
    if merged.get("slurm"):
        import os

        from gossip.peer.launch import DEFAULT_SLURM_PORT, from_slurm

        task = from_slurm(os.environ, merged.get("slurm_port") or DEFAULT_SLURM_PORT)
        if not merged.get("listen"):  # what the flags or the config file name explicitly wins
            merged["listen"] = task.listen
            if not merged.get("advertise"):
                merged["advertise"] = task.node_id
        if merged.get("rank") is None and merged.get("world_size") is None:
            merged["rank"], merged["world_size"] = task.rank, task.world_size
        if not peers:
            peers = list(task.peers)
    elif merged.get("slurm_port") is not None:
        raise ValueError("--slurm-port goes with --slurm")
    if not merged.get("listen"):
        raise ValueError("--listen tcp://HOST:PORT is required (flag or config file)")
    peers = _own_peers(peers, merged["listen"], merged.get("advertise"))
    cfg = PeerConfig(listen=merged["listen"], peers=peers, advertise=merged.get("advertise"),
                     topology=merged["topology"], mixing=mixing_settings(merged), task=merged["task"], split=merged["split"], steps=merged["steps"],
                     seed=merged["seed"], rank=merged.get("rank"), world_size=merged.get("world_size"),
                     device=merged["device"], dc=merged["dc"], timeout=merged["timeout"],
                     heartbeat=merged["heartbeat"], dead_after=merged["dead_after"], settle=merged["settle"],
                     join_timeout=merged["join_timeout"], start_hold=merged["start_hold"], join_margin=merged["join_margin"], grace=merged["grace"],
                     checkpoint_dir=merged.get("checkpoint_dir"), checkpoint_every=merged["checkpoint_every"],
                     resume=bool(merged.get("resume")), log=merged.get("log"), eval_every=merged["eval_every"],
                     max_message_mb=merged["max_message_mb"], curve_keys=merged.get("curve_keys"),
                     emulate=tuple(merged.get("emulate") or ()), emulate_origin=merged.get("emulate_origin"),
                     tensorboard=merged.get("tensorboard"),
                     detector=merged["detector"], wait_for_suspects=bool(merged.get("wait_for_suspects")))
    if cfg.tensorboard:
        from gossip.peer.tensorboard_log import require_tensorboard

        require_tensorboard()  # the install command, before anything starts
    args.json = bool(merged.get("json"))
    args.progress = merged.get("progress")
    args.threads = merged.get("threads")
    args.verbose = merged.get("verbose") or 0
    args.nproc_per_node, args.intra, args.max_restarts = merged["nproc_per_node"], merged["intra"], merged["max_restarts"]
    args.as_group = merged["as_group"]
    if args.intra not in INTRA:
        raise ValueError(f"--intra must be one of {', '.join(INTRA)}, got {args.intra!r}")
    if args.as_group > 1 and args.nproc_per_node > 1:
        raise ValueError("--as-group K is one process gossiping as a group of K; --nproc-per-node K starts K "
                         "processes: give one of them")
    if args.as_group > 1 and args.intra != "ddp":
        raise ValueError("--as-group K gossips in the layout of a DDP group (--intra ddp): an FSDP group's "
                         "shards follow its wrapped modules, which one process does not have")
    if args.as_group > 1 and (cfg.checkpoint_dir or cfg.resume):
        raise ValueError("--as-group does not write or read checkpoints yet: leave out --checkpoint-dir and "
                         "--resume (a restarted node takes the cluster's state when it joins)")
    if args.max_restarts and args.nproc_per_node == 1:
        raise ValueError("--max-restarts goes with --nproc-per-node K (a group restarted by its launcher)")
    return cfg, args


def _progress_bar(peer: Any, progress: bool | None) -> Any:
    """A one-line progress bar on stderr (when it is a terminal, or forced), fed after every step."""
    from gossip.core.progress import ClearBarBeforeLogging, PeerProgress, ProgressBar

    bar = ProgressBar(peer.cfg.steps, enabled=progress)
    if not bar.enabled:
        return None
    for handler in logging.getLogger().handlers:  # log lines erase the bar first, the next step redraws it
        if getattr(handler, "stream", None) is bar.stream:
            handler.addFilter(ClearBarBeforeLogging(bar))
    peer.on_step = PeerProgress(bar, peer.cfg.steps)
    return bar


def node_main(argv: Sequence[str] | None = None) -> int:
    """``gossip-node``: train as one member, a single process or a group of K; exit 0 when
    done, 2 on bad input or when it cannot join."""
    import signal

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, args = node_config_from_args(argv)
        from gossip.groups.group import group_env

        env = group_env()
        if env.launched:  # a rank of a group, under torchrun (gossip-node --nproc-per-node, or the user's)
            return _group_worker(cfg, args, env)
        if args.intra == "fsdp" and args.nproc_per_node == 1:
            raise ValueError("--intra fsdp shards the model over a group's ranks: give --nproc-per-node K "
                             "(or start the node with torchrun --nproc-per-node K -m gossip.node)")
        if args.nproc_per_node > 1:  # checked here, once: the launcher would restart a bad worker
            from gossip.groups.run import launch
            from gossip.training.tasks import get_task

            get_task(cfg.task)  # a bad task spec, before any worker starts
            return launch(argv, args.nproc_per_node, args.max_restarts)
        if args.as_group > 1:
            return _slices(cfg, args)
        setup_logging(args.verbose, cfg.node_id)
        _set_threads(args)
        from gossip.peer.driver import Peer
        from gossip.protocol.errors import PeerError

        peer = Peer(cfg)
    except ValueError as e:
        return _fail("gossip-node", str(e))
    bar = _progress_bar(peer, args.progress)

    def stop(signum: int, frame: Any) -> None:
        if peer.stop.is_set():  # a second signal: leave now
            raise KeyboardInterrupt
        logging.getLogger("gossip.node").warning("%s: signal %d: finishing the current step", cfg.node_id, signum)
        peer.request_stop()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    from gossip.transport.zmq import BindError

    from gossip.protocol.joining import ClusterFinished

    try:
        summary = peer.run()
    except BindError as e:
        return _fail("gossip-node", str(e))
    except ClusterFinished as e:  # started (or restarted) after the end: nothing left to train
        print(f"gossip-node: {e}; nothing left to train", file=sys.stderr)
        return 0
    except PeerError as e:
        return _fail("gossip-node", str(e))
    finally:
        if bar is not None:
            bar.close()
    _print_summary(summary, args, f"{summary['steps']} steps, accuracy {summary.get('final_accuracy')}, "
                   f"neighbour distance {summary.get('neighbor_distance')}, {summary['bytes_sent'] / 1e6:.2f} MB sent")
    return 0


def _print_summary(summary: dict[str, Any], args: argparse.Namespace, line: str) -> None:
    """The run's summary on stdout: one JSON line with --json, else ``NODE: line``."""
    if args.json:
        print(json.dumps(summary, default=_json_default), flush=True)
    else:
        print(f"{summary['node']}: {line}")


def _set_threads(args: argparse.Namespace) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def _group_worker(cfg: Any, args: argparse.Namespace, env: Any) -> int:
    """One rank of a group under torchrun: rank 0 leads (the member's protocol), the others follow."""
    from gossip.groups.group import GroupError
    from gossip.groups.run import run_group
    from gossip.protocol.errors import PeerError
    from gossip.protocol.joining import ClusterFinished
    from gossip.transport.zmq import BindError

    setup_logging(args.verbose, f"{cfg.node_id} rank {env.rank}")
    if args.nproc_per_node not in (1, env.size):
        return _fail("gossip-node", f"--nproc-per-node {args.nproc_per_node} but torchrun started {env.size} "
                                    "processes for this group") if env.rank == 0 else EXIT_USAGE
    _set_threads(args)
    # rank r ignores the signal: rank 0 decides when the group stops (it got the signal too)
    holder, on_leader = _leader_stops(cfg, args, before_leader=lambda: None)
    try:
        summary = run_group(cfg, args.intra, on_leader=on_leader)
    except ClusterFinished as e:  # every rank: rank 0 told the others (nothing left to train)
        if env.rank == 0:
            print(f"gossip-node: {e}; nothing left to train", file=sys.stderr)
        return 0
    except (ValueError, GroupError, BindError, PeerError) as e:
        return _fail("gossip-node", str(e)) if env.rank == 0 else EXIT_USAGE
    finally:
        if holder.get("bar") is not None:
            holder["bar"].close()
    if env.rank == 0:
        _print_summary(summary, args, f"a group of {summary['group_size']}, {summary['steps']} steps, accuracy "
                                      f"{summary.get('final_accuracy')}, {summary['bytes_sent'] / 1e6:.2f} MB sent "
                                      "by rank 0")
    return 0


def _leader_stops(cfg: Any, args: argparse.Namespace, before_leader: Any) -> tuple[dict[str, Any], Any]:
    """SIGINT / SIGTERM for a group's process: rank 0 stops at the group's next exchange (a
    second signal leaves at once); ``before_leader()`` runs for a signal before rank 0 exists.
    Returns the holder (rank 0, its progress bar) and the ``on_leader`` hook that fills it."""
    import signal

    holder: dict[str, Any] = {}

    def on_leader(leader: Any) -> None:
        holder["leader"] = leader
        holder["bar"] = _progress_bar(leader.peer, args.progress)

    def stop(signum: int, frame: Any) -> None:
        leader = holder.get("leader")
        if leader is None:
            before_leader()
            return
        if leader.peer.stop.is_set():
            raise KeyboardInterrupt
        logging.getLogger("gossip.node").warning("%s: signal %d: finishing at the group's next exchange",
                                                 cfg.node_id, signum)
        leader.peer.request_stop()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return holder, on_leader


def _interrupt() -> None:
    raise KeyboardInterrupt


def _slices(cfg: Any, args: argparse.Namespace) -> int:
    """One process gossiping as a DDP group of ``--as-group K`` (gossip.groups.run.run_slices)."""
    from gossip.groups.run import run_slices
    from gossip.protocol.errors import PeerError
    from gossip.protocol.joining import ClusterFinished
    from gossip.transport.zmq import BindError

    setup_logging(args.verbose, cfg.node_id)
    _set_threads(args)
    holder, on_leader = _leader_stops(cfg, args, before_leader=_interrupt)
    try:
        summary = run_slices(cfg, args.as_group, on_leader=on_leader)
    except ClusterFinished as e:
        print(f"gossip-node: {e}; nothing left to train", file=sys.stderr)
        return 0
    except (BindError, PeerError) as e:
        return _fail("gossip-node", str(e))
    finally:
        if holder.get("bar") is not None:
            holder["bar"].close()
    _print_summary(summary, args, f"one process as a group of {summary['group_size']}, {summary['steps']} steps, "
                                  f"accuracy {summary.get('final_accuracy')}, {summary['bytes_sent'] / 1e6:.2f} MB "
                                  "sent by slice 0")
    return 0


def main() -> int:  # pragma: no cover - ``python -m gossip.cli`` runs the simulator
    return sim_main()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(sim_main())

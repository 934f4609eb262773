"""Real gossip-node processes on loopback: training together, equality with the
simulator, late joins, and every kind of bad input from the issue."""

from __future__ import annotations

import json
import signal
import socket
import time

import msgpack
import pytest
import torch
import zmq

import gossip
from gossip.core.checkpoint import latest_checkpoint, load_checkpoint
from tests.cluster import EXACT, Cluster, free_port

FAST = ["--heartbeat", "0.2", "--dead-after", "2", "--settle", "1", "--grace", "5"]


def ring_args(peer: str, steps: int, *extra: str, timing: list[str] = FAST) -> list[str]:
    return ["--peers", peer, "--topology", "ring", "--algorithm", "gossip", "--task", "synthetic",
            "--steps", str(steps), "--seed", "0", "--json", *timing, *extra]


def test_four_nodes_train_together_and_finish(tmp_path):
    ports = [free_port() for _ in range(4)]
    with Cluster(tmp_path) as c:
        nodes = [c.start(f"n{i}", ring_args(f"127.0.0.1:{ports[(i + 1) % 4]}", 200, "--log",
                                            str(tmp_path / f"n{i}.jsonl"), "--eval-every", "50"), port=ports[i])
                 for i in range(4)]
        assert c.wait_all(180) == [0, 0, 0, 0]
        summaries = [n.summary() for n in nodes]
    for s, n in zip(summaries, nodes):
        assert s["steps"] == 200 and s["members"] == 4 and s["rejected"] == {}, s
        assert s["final_accuracy"] > 0.8, s
        assert s["neighbor_distance"] < 0.05, s   # replicas agree closely at the end
        assert s["bytes_sent"] > 200 * 2 * 2762 * 4  # two neighbours, one float32 model each, every round
        evals = [json.loads(x) for x in (tmp_path / f"{n.name}.jsonl").read_text().splitlines()]
        losses = [e["loss"] for e in evals if e["event"] == "eval"]
        assert losses[-1] < losses[0] * 0.6, losses  # the loss really decreased
    for n in nodes:  # reaped
        assert n.proc.poll() is not None


def test_wire_mixing_equals_the_simulator(tmp_path):
    """Same seed, same schedule: real nodes end where the simulated ones do."""
    steps, n = 6, 3
    ports = sorted(free_port() for _ in range(n))  # sorted ids = simulator ranks
    with Cluster(tmp_path) as c:
        nodes = [c.start(f"n{i}", ring_args(f"127.0.0.1:{ports[(i + 1) % n]}", steps, "--checkpoint-dir",
                                            str(tmp_path / f"ck{i}"), timing=EXACT), port=ports[i]) for i in range(n)]
        assert c.wait_all(120) == [0] * n
    for node in nodes:  # every round mixed every neighbour, as the simulator's do
        s = node.summary()
        assert (s["timed_out_rounds"], s["skipped_rounds"]) == (0, 0), s
    sim = gossip.simulate(nodes=n, topology="ring", algorithm="gossip", task="synthetic", steps=steps, seed=0,
                          eval_every=steps)
    ids = sorted(f"127.0.0.1:{p}" for p in ports)
    for i, node in enumerate(nodes):
        rank = ids.index(node.summary()["node"])
        real = load_checkpoint(latest_checkpoint(tmp_path / f"ck{i}"))["flat"]
        torch.testing.assert_close(real, sim.params[rank], rtol=1e-5, atol=1e-6)


def test_late_node_joins_receives_state_and_trains(tmp_path):
    ports = [free_port() for _ in range(3)]
    steps = 3000
    with Cluster(tmp_path) as c:
        first = [c.start(f"n{i}", ring_args(f"127.0.0.1:{ports[(i + 1) % 3]}", steps, "--join-margin", "10"),
                         port=ports[i]) for i in range(3)]
        first[0].wait_for_log("training as", 60)
        late = c.start("late", ring_args(first[1].addr, steps, "--join-margin", "10"))
        assert c.wait_all(240) == [0, 0, 0, 0]
        s = late.summary()
        others = [n.summary() for n in first]
    assert s["joined"] is True and s["state_from"] in {n.addr for n in first}, s
    assert s["steps"] == steps and s["members"] == 4, s
    assert s["final_accuracy"] > 0.8 and s["neighbor_distance"] < 0.05, s
    assert all(o["members"] == 4 for o in others), others
    assert "joins the running cluster from round" in "".join(n.log() for n in first)
    # the join cost nobody a round: the joiner asked for the state in time, or was answered mid-round
    assert [x["timed_out_rounds"] for x in (s, *others)] == [0] * 4, [x["timed_out_rounds"] for x in (s, *others)]


def test_unreachable_peer_retries_with_backoff_and_carries_on(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    with Cluster(tmp_path) as c:
        n = c.start("lonely", ["--peers", dead, "--steps", "20", "--json", "--join-timeout", "4", *FAST])
        assert c.wait_all(90) == [0]
        log = n.log()
        assert f"peer {dead} does not answer; retrying in" in log
        import re

        waits = [float(w) for w in re.findall(r"retrying in ([0-9.]+) s", log)]
        assert len(waits) >= 3 and all(b == min(2 * a, 8.0) for a, b in zip(waits, waits[1:])), waits  # backoff
        assert "training alone" in log
        assert n.summary()["steps"] == 20


def test_port_in_use_is_a_clear_error_exit_2(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with Cluster(tmp_path) as c:
            n = c.start("clash", ["--steps", "5"], port=port)
            assert c.wait_all(60) == [2]
            err = n.log().strip().splitlines()[-1]
    assert err == f"gossip-node: error: cannot listen on tcp://127.0.0.1:{port}: already in use"


def test_different_models_refuse_to_mix_and_say_why(tmp_path):
    p0, p1 = free_port(), free_port()
    with Cluster(tmp_path) as c:
        a = c.start("a", ["--peers", f"127.0.0.1:{p1}", "--task", "synthetic", "--steps", "5", "--join-timeout",
                          "6", *FAST], port=p0)
        b = c.start("b", ["--peers", f"127.0.0.1:{p0}", "--task", "synthetic:hidden=32", "--steps", "5",
                          "--join-timeout", "6", *FAST], port=p1)
        codes = c.wait_all(90)
        logs = a.log() + b.log()
    assert codes == [2, 2]
    assert "fingerprint mismatch" in a.log().splitlines()[-1] and "fingerprint mismatch" in b.log().splitlines()[-1]
    assert "refusing to mix" in logs


def test_peer_speaking_another_protocol_version_is_ignored(tmp_path):
    with Cluster(tmp_path) as c:
        n = c.start("n", ["--steps", "300", "--json", *FAST])
        n.wait_for_log("listening", 60)
        ctx = zmq.Context()
        try:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, b"127.0.0.1:1")
            s.connect(f"tcp://{n.addr}")
            hdr = msgpack.packb({"kind": "hello", "from": "127.0.0.1:1", "x": {"inc": 1, "status": "waiting"}})
            for _ in range(20):
                s.send_multipart([b"GSP/4", hdr])
                time.sleep(0.05)
            s.close(0)
        finally:
            ctx.term()
        assert c.wait_all(90) == [0]
        summary = n.summary()
    assert summary["rejected"].get("version", 0) >= 1 and summary["steps"] == 300
    assert "peer speaks GSP/4, this node GSP/3" in n.log()


def test_sigterm_stops_cleanly_with_a_final_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    with Cluster(tmp_path) as c:
        n = c.start("n", ["--steps", "100000", "--json", "--checkpoint-dir", str(ck), *FAST])
        n.wait_for_log("training as", 60)
        time.sleep(1.0)
        n.proc.send_signal(signal.SIGTERM)
        assert c.wait_all(60) == [0]
        s = n.summary()
    assert s["interrupted"] is True and 0 < s["steps"] < 100000
    state = load_checkpoint(latest_checkpoint(ck))
    assert state["step"] == s["steps"]


def test_resume_continues_from_the_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    with Cluster(tmp_path) as c:
        a = c.start("a", ["--steps", "30", "--json", "--checkpoint-dir", str(ck), "--checkpoint-every", "10", *FAST])
        assert c.wait_all(60) == [0]
        first = a.summary()
    with Cluster(tmp_path) as c:
        b = c.start("b", ["--steps", "50", "--json", "--checkpoint-dir", str(ck), "--resume", *FAST])
        assert c.wait_all(60) == [0]
        second = b.summary()
    assert second["resumed_from"].endswith("ckpt-000000000030.pt") and second["steps"] == 50
    # the same 50 steps in one go give the same parameters: resuming lost nothing
    with Cluster(tmp_path) as c:
        whole = c.start("whole", ["--steps", "50", "--json", *FAST])
        assert c.wait_all(60) == [0]
    assert whole.summary()["params_sha256"] == second["params_sha256"]
    assert first["steps"] == 30


def test_config_file_and_flags(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('steps = 7\ntask = "synthetic"\njson = true\nheartbeat = 0.2\nsettle = 1\n')
    with Cluster(tmp_path) as c:
        n = c.start("cfg", ["--config", str(cfg), "--seed", "3"])
        assert c.wait_all(60) == [0]
        assert n.summary()["steps"] == 7
    bad = tmp_path / "bad.toml"
    bad.write_text('stepz = 7\n')
    with Cluster(tmp_path) as c:
        n = c.start("bad", ["--config", str(bad)])
        assert c.wait_all(60) == [2]
        assert "unknown option 'stepz'" in n.log()


@pytest.mark.parametrize("args,needle", [
    (["--peers", "nonsense"], "not HOST:PORT"),
    (["--topology", "moebius"], "unknown topology 'moebius'"),
    (["--algorithm", "magic"], "invalid choice"),
    (["--device", "tpu"], "unknown device"),
    (["--rank", "3"], "--rank and --world-size go together"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--split", "dirichlet:0"], "ALPHA"),
    (["--clip", "-1"], "clip must be a positive radius"),
    (["--clip", "wide"], "--clip must be a number or 'auto'"),
    (["--clip", "auto", "--compression", "topk:0.1"], "synchronous uncompressed"),
])
def test_bad_flags_exit_2_with_one_line(args, needle, capsys):
    from gossip.cli import node_main

    with pytest.raises(SystemExit) as e:
        raise SystemExit(node_main(["--listen", f"tcp://127.0.0.1:{free_port()}", *args]))
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_clip_reaches_the_mixing_rule():
    from gossip.cli import node_config_from_args
    from gossip.peer.driver import Peer

    cfg, _ = node_config_from_args(["--listen", f"tcp://127.0.0.1:{free_port()}", "--clip", "0.5"])
    peer = Peer(cfg)
    try:
        peer._start("fresh")
        assert peer.node.rule.clip == 0.5
    finally:
        peer.close()


def test_device_defaults_to_auto_and_auto_takes_local_rank(monkeypatch):
    """The README promises ``--device auto`` by default; the CLI said cpu. ``auto`` is
    cuda:LOCAL_RANK under torchrun when CUDA is present, the CPU otherwise."""
    from gossip.cli import node_config_from_args
    from gossip.training.node import resolve_device

    cfg, _ = node_config_from_args(["--listen", f"127.0.0.1:{free_port()}"])
    assert cfg.device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device("auto") == torch.device("cuda", 2)
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device("auto") == torch.device("cuda", 0)


def test_a_member_declared_dead_stays_behind_the_emulated_cut():
    """--emulate inter:down=... drops what crosses datacenters. A member declared dead
    leaves the member table, yet this node keeps probing it with hellos: those must
    cross the same (cut) link, or they leak through the partition as intra traffic
    and the two halves meet while the cut lasts."""
    from gossip.cli import node_config_from_args
    from gossip.peer.driver import Peer

    cfg, _ = node_config_from_args(["--listen", f"tcp://127.0.0.1:{free_port()}", "--dc", "east",
                                    "--emulate", "inter:down=0s-60s"])
    peer = Peer(cfg)
    try:
        me, west, east = peer.id, "127.0.0.1:1", "127.0.0.1:2"

        def crosses(dst: str) -> bool:  # whether a message to dst leaves now, inside the cut
            return peer.shaper.transmit(me, dst, 100, peer.clock()) is not None

        # a seed not heard yet is unlabelled (this node's own class); once its label is
        # known, the class follows: the first answer is not kept for the pair
        assert crosses(west)
        with peer.lock:
            peer.membership.heard(west, 1, 0.0, dc="west")
            peer.membership.heard(east, 1, 0.0, dc="east")
        assert not crosses(west) and crosses(east)
        peer.life.topology_for(sorted([me, west, east]))  # trained with both: labels remembered
        with peer.lock:
            peer.membership.remove(west, "silent")
            peer.membership.remove(east, "silent")
        # a topology computed after the removal (the first round's, when the death came
        # just before it) must not record a guess (this node's own label) for them
        peer.life.topology_for(sorted([me, west, east, "127.0.0.1:4"]))
        assert (peer._link_class(me, west), peer._link_class(me, east)) == ("inter", "intra")
        assert not crosses(west) and crosses(east)
        with peer.lock:  # learned again (a new life) from another member's list: no label in it
            assert peer.membership.merge([(west, 2)], 1.0) and peer.membership.members[west].dc == ""
        assert peer._link_class(me, west) == "inter" and not crosses(west)
        assert peer._link_class(me, "127.0.0.1:3") == "intra"  # never labelled: this node's own
    finally:
        peer.close()

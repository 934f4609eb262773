"""Starting a real cluster: host lists, peers files, SLURM, the local launcher,
gossip-node's progress bar and TensorBoard output.

The process tests start real nodes on free loopback ports with hard timeouts and
reap (or check the end of) every process they started, by PID.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from gossip.cli import node_config_from_args, node_main, sim_main
from gossip.core.progress import ClearBarBeforeLogging, PeerProgress, ProgressBar
from gossip.peer.launch import (
    expand_hostlist,
    from_slurm,
    parse_peer_entries,
    read_peers_file,
    tasks_per_node,
)
from gossip.peer.tensorboard_log import (
    INSTALL_HINT,
    SCALARS,
    MetricsSink,
    TensorBoardLog,
)
from gossip.transport.ports import free_ports
from tests.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")


# -- host lists --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),                      # no padding: the lower bound has one digit
    ("n[08-10]", ["n08", "n09", "n10"]),                   # padding follows the lower bound
    ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),    # several groups: a product, last fastest
    ("a[1,3]-ib", ["a1-ib", "a3-ib"]),                     # text after the brackets
    (" x1 , y[2] ", ["x1", "y2"]),
    ("c[001-002],c010", ["c001", "c002", "c010"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text,needle", [
    ("node[1-", "'[' without ']'"),
    ("node1]", "']' without '['"),
    ("node[a-b]", "bad range 'a-b'"),
    ("node[3-1]", "range '3-1' runs backwards"),
    ("node[]", "empty brackets"),
    ("a,,b", "empty entry"),
    ("n[1[2]]", "nested brackets"),
    ("n@1", "only letters"),
    ("", "is empty"),
    ("n[0-99999999]", "more than"),
])
def test_expand_hostlist_errors_name_the_bad_text(text, needle):
    with pytest.raises(ValueError) as e:
        expand_hostlist(text)
    assert needle in str(e.value) and repr(text) in str(e.value)


def test_tasks_per_node_forms():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4", nodes=3) == [4, 4, 4]  # SLURM_NTASKS_PER_NODE: the same on every node
    assert tasks_per_node("1,3") == [1, 3]
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE='2\(x'"):
        tasks_per_node("2(x")


# -- peers files -------------------------------------------------------------------------------

def test_read_peers_file_entries_comments_and_host_lists(tmp_path):
    f = tmp_path / "hosts.txt"
    f.write_text("# every node of the job\n"
                 "10.0.0.1:5555\n"
                 "\n"
                 "10.0.0.2:5555, tcp://10.0.0.3:5556   # two on a line\n"
                 "gpu[01-02]:29400 [::1]:7000\n"
                 "10.0.0.1:5555\n")  # a repeat is dropped
    assert read_peers_file(f) == ["10.0.0.1:5555", "10.0.0.2:5555", "10.0.0.3:5556", "gpu01:29400",
                                  "gpu02:29400", "[::1]:7000"]
    assert parse_peer_entries("a:1 b:2,c:3") == ["a:1", "b:2", "c:3"]


@pytest.mark.parametrize("content,line,needle", [
    ("a:1\n\n# fine\nnot-an-address\n", 4, "'not-an-address' is not HOST:PORT"),
    ("a:1\nb:99999\n", 2, "port must be in 1..65535"),
    ("node[1-x]:5\n", 1, "bad range '1-x'"),
    ("# c\nnode[1-2]\n", 2, "not HOST:PORT"),
])
def test_read_peers_file_errors_name_file_and_line(tmp_path, content, line, needle):
    f = tmp_path / "peers.txt"
    f.write_text(content)
    with pytest.raises(ValueError) as e:
        read_peers_file(f)
    assert str(e.value).startswith(f"peers file {f}, line {line}: ")
    assert needle in str(e.value)


def test_read_peers_file_missing(tmp_path):
    with pytest.raises(ValueError, match=r"peers file .*nope\.txt: No such file"):
        read_peers_file(tmp_path / "nope.txt")


# -- SLURM -------------------------------------------------------------------------------------

def slurm_env(**overrides: str) -> dict[str, str]:
    """Task 4 of 5 on node03, the job spread as 2, 2, 1 tasks over node01..03."""
    env = {"SLURM_JOB_NODELIST": "node[01-03]", "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NTASKS": "5",
           "SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURMD_NODENAME": "node03"}
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "-"}


def test_from_slurm_several_nodes():
    t = from_slurm(slurm_env(), base_port=29400)
    assert t.node_id == "node03:29400" and t.listen == "tcp://0.0.0.0:29400" and t.host == "node03"
    assert t.peers == ("node01:29400", "node01:29401", "node02:29400", "node02:29401")
    assert (t.rank, t.world_size, t.local_id) == (4, 5, 0)
    # the second task on node02: port base + SLURM_LOCALID
    t = from_slurm(slurm_env(SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="1", SLURMD_NODENAME="node02"), 7000)
    assert t.node_id == "node02:7001" and "node02:7001" not in t.peers and len(t.peers) == 4
    assert "node03:7000" in t.peers and t.rank == 3


def test_from_slurm_variable_forms():
    # SLURM_NTASKS_PER_NODE (uniform), and the host found by SLURM_NODEID when SLURMD_NODENAME is absent
    t = from_slurm(slurm_env(SLURM_TASKS_PER_NODE="-", SLURM_NTASKS_PER_NODE="2", SLURM_NTASKS="6",
                             SLURMD_NODENAME="-", SLURM_NODEID="1", SLURM_PROCID="2"))
    assert t.node_id == "node02:29400" and len(t.peers) == 5
    # a step's own node list and layout win over the job's
    t = from_slurm(slurm_env(SLURM_STEP_NODELIST="node[02-03]", SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NTASKS="2",
                             SLURM_PROCID="1"))
    assert t.peers == ("node02:29400",) and t.world_size == 2


@pytest.mark.parametrize("overrides,needle", [
    ({"SLURM_JOB_NODELIST": "-"}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_TASKS_PER_NODE": "-"}, "SLURM_TASKS_PER_NODE is not set"),
    ({"SLURM_NTASKS": "-"}, "SLURM_NTASKS is not set"),
    ({"SLURM_PROCID": "-"}, "SLURM_PROCID is not set"),
    ({"SLURM_LOCALID": "-"}, "SLURM_LOCALID is not set"),
    ({"SLURMD_NODENAME": "-", "SLURM_NODEID": "-"}, "SLURMD_NODENAME is not set"),
    ({"SLURM_PROCID": "four"}, "SLURM_PROCID='four' is not an integer"),
    ({"SLURM_TASKS_PER_NODE": "2(x"}, "SLURM_TASKS_PER_NODE='2(x' is not a tasks-per-node list"),
    ({"SLURM_JOB_NODELIST": "node[01-03"}, "SLURM_JOB_NODELIST: host list 'node[01-03'"),
    ({"SLURM_TASKS_PER_NODE": "2,2"}, "gives 2 node(s) but SLURM_JOB_NODELIST='node[01-03]' names 3"),
    ({"SLURM_NTASKS": "4"}, "SLURM_NTASKS=4 does not match"),
    ({"SLURM_PROCID": "5"}, "SLURM_PROCID=5 is not below SLURM_NTASKS=5"),
    ({"SLURM_LOCALID": "1"}, "SLURM_LOCALID=1 but SLURM_TASKS_PER_NODE='2(x2),1' puts 1 task(s) on node03"),
    ({"SLURMD_NODENAME": "elsewhere", "SLURM_NODEID": "-"}, "SLURMD_NODENAME='elsewhere' is not in"),
])
def test_from_slurm_errors_name_the_variable(overrides, needle):
    with pytest.raises(ValueError) as e:
        from_slurm(slurm_env(**overrides))
    assert needle in str(e.value)


# -- gossip-node flags -------------------------------------------------------------------------

def test_peers_file_merges_with_peers_and_leaves_this_node_out(tmp_path):
    f = tmp_path / "all.txt"
    f.write_text("127.0.0.1:7001\n127.0.0.1:7002\n127.0.0.1:7003\n")  # every node, this one included
    cfg, _ = node_config_from_args(["--listen", "tcp://127.0.0.1:7002", "--peers", "10.1.1.1:9,127.0.0.1:7001",
                                    "--peers-file", str(f)])
    assert cfg.peers == ("10.1.1.1:9", "127.0.0.1:7001", "127.0.0.1:7003")
    # listening on every interface: the advertised address is the one left out
    cfg, _ = node_config_from_args(["--listen", "tcp://0.0.0.0:7003", "--advertise", "127.0.0.1:7003",
                                    "--peers-file", str(f)])
    assert cfg.peers == ("127.0.0.1:7001", "127.0.0.1:7002") and cfg.node_id == "127.0.0.1:7003"


def test_slurm_flag_fills_the_config_and_explicit_flags_win(monkeypatch, tmp_path):
    for k, v in slurm_env(SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NODEID="0", SLURMD_NODENAME="node01").items():
        monkeypatch.setenv(k, v)
    cfg, _ = node_config_from_args(["--slurm", "--slurm-port", "6000"])
    assert cfg.listen == "tcp://0.0.0.0:6001" and cfg.node_id == "node01:6001"
    assert cfg.peers == ("node01:6000", "node02:6000", "node02:6001", "node03:6000")
    assert (cfg.rank, cfg.world_size) == (1, 5)
    cfg, _ = node_config_from_args(["--slurm"])  # the default base port
    assert cfg.node_id == "node01:29401"
    cfg, _ = node_config_from_args(["--slurm", "--rank", "0", "--world-size", "1", "--peers", "10.9.9.9:1",
                                    "--advertise", "10.0.0.1:6001", "--slurm-port", "6000"])
    assert (cfg.rank, cfg.world_size, cfg.peers, cfg.node_id) == (0, 1, ("10.9.9.9:1",), "10.0.0.1:6001")
    # the same from a config file
    toml = tmp_path / "node.toml"
    toml.write_text('slurm = true\nslurm-port = 6100\nprogress = false\ntensorboard = "tb"\n')
    monkeypatch.setattr("gossip.peer.tensorboard_log.require_tensorboard", lambda: None)
    cfg, args = node_config_from_args(["--config", str(toml)])
    assert cfg.node_id == "node01:6101" and args.progress is False and cfg.tensorboard == "tb"
    cfg, args = node_config_from_args(["--config", str(toml), "--progress"])
    assert args.progress is True  # the flag wins over the file


@pytest.mark.parametrize("args,env,needle", [
    (["--slurm"], {}, "gossip-node: error: --slurm: SLURM_JOB_NODELIST is not set"),
    (["--slurm"], {"SLURM_PROCID": "x"}, "gossip-node: error: --slurm: SLURM_PROCID='x' is not an integer"),
    (["--listen", "tcp://127.0.0.1:7000", "--slurm-port", "7000"], None, "--slurm-port goes with --slurm"),
    (["--listen", "tcp://127.0.0.1:7000", "--peers-file", "PEERS"], None, "peers file PEERS, line 2: entry 'oops'"),
])
def test_launch_flag_errors_exit_2_with_one_line(args, env, needle, monkeypatch, capsys, tmp_path):
    for k in list(os.environ):
        if k.startswith("SLURM"):
            monkeypatch.delenv(k)
    if env is not None:
        for k, v in (slurm_env(**env) if env else {}).items():
            monkeypatch.setenv(k, v)
    peers = tmp_path / "peers.txt"
    peers.write_text("127.0.0.1:1\noops\n")
    args = [str(peers) if a == "PEERS" else a for a in args]
    assert node_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle.replace("PEERS", str(peers)) in err[0], err


# -- progress bar ------------------------------------------------------------------------------

class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def fake_peer(step: int, members: int = 3, loss: float = 0.5) -> types.SimpleNamespace:
    node = types.SimpleNamespace(step=step, round=step // 2, members=[f"m{i}" for i in range(members)],
                                 last_loss=loss)
    return types.SimpleNamespace(node=node)


def test_peer_progress_line_on_a_terminal_and_silence_in_a_pipe():
    tty = TTY()
    bar = PeerProgress(ProgressBar(10, stream=tty, fps=1e9), 10)
    bar(fake_peer(1))
    time.sleep(0.01)
    bar(fake_peer(10, loss=0.25))
    bar.bar.close()
    out = tty.getvalue()
    assert "step 1/10 round 0 members 3 loss 0.5000 - steps/s" in out
    last = out.rsplit("\r", 1)[1]
    assert "100.0% step 10/10 round 5 members 3 loss 0.2500 " in last
    rate = float(re.search(r"([0-9.]+) steps/s", last).group(1))
    assert rate > 0 and out.endswith("\n")
    pipe = io.StringIO()  # not a terminal: nothing unless forced
    quiet = PeerProgress(ProgressBar(10, stream=pipe), 10)
    quiet(fake_peer(5))
    quiet.bar.close()
    assert pipe.getvalue() == ""
    forced = PeerProgress(ProgressBar(10, stream=pipe, enabled=True), 10)
    forced(fake_peer(5, loss=float("nan")))
    assert "step 5/10 round 2 members 3 loss - " in pipe.getvalue()


def test_log_lines_erase_the_bar_first():
    tty = TTY()
    bar = ProgressBar(10, stream=tty, fps=1e9)
    handler = logging.StreamHandler(tty)
    handler.addFilter(ClearBarBeforeLogging(bar))
    log = logging.getLogger("test_launch.bar")
    log.addHandler(handler)
    log.propagate = False
    try:
        bar.update(3, "step 3/10")
        log.warning("a line")
        bar.close()  # nothing drawn since the log line: no empty line
    finally:
        log.removeHandler(handler)
    assert tty.getvalue().endswith("step 3/10\x1b[K\r\x1b[Ka line\n")


# -- TensorBoard -------------------------------------------------------------------------------

class FakeWriter:
    """Stands in for torch.utils.tensorboard.SummaryWriter."""

    instances: list["FakeWriter"] = []

    def __init__(self, log_dir: str | None = None) -> None:
        self.log_dir = log_dir
        self.scalars: list[tuple[str, float, int]] = []
        self.texts: list[tuple[str, str, int]] = []
        self.closed = False
        FakeWriter.instances.append(self)

    def add_scalar(self, tag, value, step=None):
        self.scalars.append((tag, value, step))

    def add_text(self, tag, text, step=None):
        self.texts.append((tag, text, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_tensorboard_log_writes_the_numeric_fields():
    w = FakeWriter()
    tb = TensorBoardLog(writer=w)
    n = tb.record({"event": "eval", "step": 19.6, "loss": 0.5, "accuracy": 0.75, "train_loss": float("nan"),
                   "consensus_distance": 1e-3, "bytes_sent": 1000, "nodes_up": 4, "node": "a:1", "time": 3.0})
    assert n == 5
    assert sorted(w.scalars) == sorted([("loss/eval", 0.5, 20), ("accuracy/eval", 0.75, 20),
                                        ("consensus/distance", 1e-3, 20), ("bytes/sent", 1000.0, 20),
                                        ("cluster/nodes_up", 4.0, 20)])
    assert tb.record({"event": "start", "step": 1, "loss": 1.0}) == 0 and len(w.scalars) == 5
    tb.record({"event": "summary", "final_accuracy": 0.8})
    assert w.texts[0][0] == "summary" and '"final_accuracy": 0.8' in w.texts[0][1] and w.texts[0][2] == 20


def test_metrics_sink_tees_lines_written_in_pieces(tmp_path):
    w = FakeWriter()
    path = tmp_path / "sub" / "m.jsonl"
    with MetricsSink(path, TensorBoardLog(writer=w)) as sink:
        sink.write('{"event": "eval", "step": 1, "loss": 2.0}\n{"event": "eval", "st')
        assert len(w.scalars) == 1
        sink.write('ep": 2, "loss": 1.0}\n')
    assert w.scalars == [("loss/eval", 2.0, 1), ("loss/eval", 1.0, 2)] and w.closed
    assert path.read_text() == '{"event": "eval", "step": 1, "loss": 2.0}\n{"event": "eval", "step": 2, "loss": 1.0}\n'


@pytest.fixture
def fake_summary_writer(monkeypatch):
    """torch.utils.tensorboard replaced by FakeWriter, whether or not tensorboard is installed."""
    FakeWriter.instances.clear()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    monkeypatch.setattr("gossip.peer.tensorboard_log.require_tensorboard", lambda: None)
    return FakeWriter.instances


def test_gossip_sim_tensorboard_gets_the_jsonl_records(tmp_path, fake_summary_writer, capsys):
    out, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    assert sim_main(["--nodes", "3", "--steps", "20", "--eval-every", "5", "--out", str(out), "--tensorboard",
                     str(tb)]) == 0
    [w] = fake_summary_writer
    assert w.log_dir == str(tb) and w.closed
    evals = [r for r in map(json.loads, out.read_text().splitlines()) if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [5, 10, 15, 20]
    for key in ("accuracy", "loss", "consensus_distance", "bytes_sent"):
        assert [(s, v) for t, v, s in w.scalars if t == SCALARS[key]] == [(r["step"], r[key]) for r in evals], key
    assert evals[-1]["accuracy"] > evals[0]["accuracy"]  # a real run, not constants


def test_missing_tensorboard_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert sim_main(["--nodes", "2", "--steps", "2", "--tensorboard", str(tmp_path / "tb")]) == 2
    assert node_main(["--listen", f"tcp://127.0.0.1:{free_port()}", "--tensorboard", str(tmp_path / "tb")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"gossip-sim: error: --tensorboard needs the tensorboard package: {INSTALL_HINT}",
                     f"gossip-node: error: --tensorboard needs the tensorboard package: {INSTALL_HINT}"]
    assert not (tmp_path / "tb").exists()


def test_gossip_sim_real_tensorboard_event_files(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    assert sim_main(["--nodes", "3", "--steps", "10", "--eval-every", "5", "--out", str(out), "--tensorboard",
                     str(tb)]) == 0
    ea = EventAccumulator(str(tb))
    ea.Reload()
    evals = [r for r in map(json.loads, out.read_text().splitlines()) if r["event"] == "eval"]
    got = [(e.step, e.value) for e in ea.Scalars("accuracy/eval")]
    assert got == [(r["step"], pytest.approx(r["accuracy"])) for r in evals]


# -- processes ---------------------------------------------------------------------------------

def pid_gone(pid: int) -> bool:
    """No such process, or only a zombie left for init to reap."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return " Z " in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return True


def wait_until(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def launch_cluster(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "examples" / "local_cluster.py"), "--out-dir",
                             str(tmp_path / "run"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=str(ROOT), env=dict(os.environ, PYTHONUNBUFFERED="1"))


def reap(proc: subprocess.Popen, nodes_file: Path) -> None:
    """Whatever happened: the launcher and every node it started end (by PID)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    if nodes_file.exists():
        for n in json.loads(nodes_file.read_text())["nodes"]:
            if not pid_gone(n["pid"]):
                os.kill(n["pid"], signal.SIGKILL)


def test_local_cluster_short_form(tmp_path):
    proc = launch_cluster(tmp_path, "--short", "--", "-v")  # -v: every node logs, so its lines can be checked
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        reap(proc, tmp_path / "run" / "nodes.json")
    assert proc.returncode == 0, err.decode()[-3000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    from examples.local_cluster import SHORT_MIN_ACCURACY

    assert result["exit_codes"] == [0, 0, 0] and result["steps"] == [50, 50, 50] and result["members"] == [3, 3, 3]
    assert result["min_accuracy"] >= SHORT_MIN_ACCURACY > 0.5
    table = out.decode().splitlines()
    assert table[0].split()[:5] == ["node", "pid", "address", "exit", "steps"] and len(table) == 5
    nodes = json.loads((tmp_path / "run" / "nodes.json").read_text())["nodes"]
    for n in nodes:
        assert pid_gone(n["pid"])
        log = Path(n["log"]).read_text()
        assert "\r[" not in log  # a pipe: no progress bar
        lines = [ln for ln in log.splitlines() if LOG_LINE.match(ln)]
        assert lines and all(f"[{n['address']}] " in ln for ln in lines), log[-2000:]  # node id on every line
        assert json.loads(Path(n["summary"]).read_text().splitlines()[-1])["node"] == n["address"]
        metrics = [json.loads(x) for x in (tmp_path / "run" / f"node{n['index']}.jsonl").read_text().splitlines()]
        assert metrics[-1]["event"] == "summary" and metrics[-1]["steps"] == 50


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_local_cluster_stops_every_node(tmp_path, how):
    """SIGTERM: each node stops cleanly (interrupted, exit 0). SIGKILL of the launcher: the nodes
    still end (the kernel sends them SIGTERM): no orphans either way."""
    proc = launch_cluster(tmp_path, "--nodes", "2", "--", "-v", "--steps", "1000000", "--heartbeat", "0.2",
                          "--settle", "1")
    nodes_file = tmp_path / "run" / "nodes.json"
    try:
        wait_until(nodes_file.exists, 60, "nodes.json written")
        nodes = json.loads(nodes_file.read_text())["nodes"]
        assert len(nodes) == 2 and all(not pid_gone(n["pid"]) for n in nodes)
        wait_until(lambda: all("training as" in Path(n["log"]).read_text() for n in nodes), 120, "training started")
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=60)
        wait_until(lambda: all(pid_gone(n["pid"]) for n in nodes), 60, "every node ended")
    finally:
        reap(proc, nodes_file)
    if how == "SIGTERM":
        assert proc.returncode == 128 + signal.SIGTERM
        result = json.loads(proc.stdout.read().decode().strip().splitlines()[-1])
        assert result["exit_codes"] == [0, 0] and result["signal"] == signal.SIGTERM
        for n in nodes:
            s = json.loads(Path(n["summary"]).read_text().splitlines()[-1])
            assert s["interrupted"] is True and 0 < s["steps"] < 1000000
    else:
        assert proc.returncode == -signal.SIGKILL


FAKE_SRUN = """#!/bin/bash
# srun stand-in: run the command as $FAKE_NTASKS tasks on this host, with the variables srun sets
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < FAKE_NTASKS; i++)); do
  SLURM_JOB_NODELIST=localhost SLURM_STEP_NODELIST=localhost SLURM_STEP_TASKS_PER_NODE=$FAKE_NTASKS \\
  SLURM_NTASKS=$FAKE_NTASKS SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 SLURMD_NODENAME=localhost \\
    "$@" > "$FAKE_OUT/task$i.out" 2> "$FAKE_OUT/task$i.err" &
  pids+=($!)
  echo $! >> "$FAKE_OUT/pids"
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def test_slurm_job_script_under_a_fake_srun(tmp_path):
    """examples/slurm_job.sh end to end: two tasks find each other from the SLURM variables alone."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(FAKE_SRUN)
    (bindir / "srun").chmod(0o755)
    base = free_ports(2, consecutive=True, host="0.0.0.0")[0]  # task i listens on base + i
    tb = importlib.util.find_spec("tensorboard") is not None
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               FAKE_NTASKS="2", FAKE_OUT=str(tmp_path), GOSSIP_PORT=str(base), GOSSIP_OUT=str(tmp_path / "out"),
               SLURM_CPUS_PER_TASK="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("SLURM_JOB_ID", None)
    extra = ["--task", "synthetic", "--topology", "ring", "--steps", "30", "--heartbeat", "0.2", "--settle", "1",
             "--grace", "5", "--progress", "-v", "--checkpoint-every", "0"]
    if tb:
        extra += ["--tensorboard", str(tmp_path / "tb")]
    proc = subprocess.Popen(["bash", str(ROOT / "examples" / "slurm_job.sh"), *extra], env=env, cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = proc.communicate(timeout=240)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        pids_file = tmp_path / "pids"
        for pid in (pids_file.read_text().split() if pids_file.exists() else []):
            if not pid_gone(int(pid)):
                os.kill(int(pid), signal.SIGKILL)
    errs = [(tmp_path / f"task{i}.err").read_text() for i in range(2)]
    assert proc.returncode == 0, out + "\n".join(e[-2000:] for e in errs)
    ids = [f"localhost:{base}", f"localhost:{base + 1}"]
    for i in range(2):
        s = json.loads((tmp_path / f"task{i}.out").read_text().splitlines()[-1])
        assert s["node"] == ids[i] and s["steps"] == 30 and s["members"] == 2 and s["final_accuracy"] > 0.5, s
        assert f"training as {i} of 2" in errs[i]  # rank = SLURM_PROCID, world size = SLURM_NTASKS
        # --progress draws the line even into a file; every log line carries the node id
        assert re.search(r"100\.0% step 30/30 round \d+ members 2 loss \d\.\d{4} [0-9.]+ steps/s", errs[i])
        lines = [ln.rsplit("\r", 1)[-1].replace("\x1b[K", "") for ln in errs[i].splitlines()]
        logged = [ln for ln in lines if LOG_LINE.match(ln)]
        assert logged and all(f"[{ids[i]}] " in ln for ln in logged), errs[i][-2000:]
        metrics = [json.loads(x) for x in (tmp_path / "out" / f"node-{i}.jsonl").read_text().splitlines()]
        assert metrics[-1]["event"] == "summary" and metrics[-1]["node"] == ids[i]
        if tb:
            from tensorboard.backend.event_processing.event_accumulator import (
                EventAccumulator,
            )

            ea = EventAccumulator(str(tmp_path / "tb" / ids[i].replace(":", "_")))
            ea.Reload()
            evals = [m for m in metrics if m["event"] == "eval"]
            assert [e.step for e in ea.Scalars("accuracy/eval")] == [m["step"] for m in evals]
            assert {"loss/eval", "consensus/neighbor_distance", "bytes/sent"} <= set(ea.Tags()["scalars"])

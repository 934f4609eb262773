"""What the Python API tells its user: errors that name the API's own parameters, every
gossip-node option taken as a keyword or refused with the allowed set, a peer with
another model named to the first differing tensor from each side, and log levels that
keep the normal life of a cluster (a goodbye, a seed not up yet, a suspicion SWIM
clears) below WARNING."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch

import gossip
from gossip.core.state import first_difference, model_spec
from gossip.protocol.errors import PeerError
from gossip.peer.user_loop import OPTIONS
from gossip.protocol.control import ControlPlane
from gossip.protocol.effects import Verdicts
from gossip.protocol.membership import Membership
from gossip.protocol.timing import Timing
from gossip.transport.ports import free_port

FAST = dict(settle=0.2, heartbeat=0.2, handle_signals=False)


def _model(out: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, out)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _addr() -> str:
    return f"127.0.0.1:{free_port()}"


# -- errors that name the API's parameters ------------------------------------------------------
def test_a_wildcard_listen_asks_for_advertise_by_its_api_name():
    model, opt = _model()
    with pytest.raises(ValueError) as e:
        gossip.GossipNode(model, opt, listen=f"0.0.0.0:{free_port()}", **FAST)
    assert "advertise='HOST:PORT'" in str(e.value) and "--" not in str(e.value), str(e.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"steps": 10}, "steps is not an option of GossipNode"),
    ({"task": "digits"}, "task is not an option of GossipNode"),
    ({"split": "iid"}, "split is not an option of GossipNode"),
    ({"threadz": 1}, "unknown option 'threadz' for GossipNode; valid: "),
    ({"checkpoint_every": 5}, "checkpoint_every needs checkpoint_dir"),
    ({"resume": True}, "resume needs checkpoint_dir"),
    ({"device": "cuda:7" if torch.cuda.is_available() else "cuda"}, "device 'cuda"),
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"threads": 0}, "threads must be a positive integer"),
    ({"rank": 0}, "rank and world_size go together"),
    ({"emulate_origin": 1.7e9}, "emulate_origin needs emulate"),
    ({"emulate": ("inter:down=1s-2s",), "emulate_origin": -1.0}, "emulate_origin must be a time in UNIX seconds"),
])
def test_ignored_options_and_options_that_need_another_are_errors(kwargs, words):
    model, opt = _model()
    with pytest.raises(ValueError) as e:
        gossip.GossipNode(model, opt, listen=_addr(), **FAST, **kwargs)
    assert words in str(e.value) and "--" not in str(e.value), str(e.value)
    if "valid: " in words:  # the allowed set, by name
        for name in ("topology", "timeout", "device", "threads", "period", "peers_file", "detector"):
            assert name in str(e.value).split("valid: ", 1)[1]


def test_every_gossip_node_option_is_a_keyword_or_refused_naming_why():
    from gossip.cli import build_node_parser
    from gossip.peer.user_loop import REFUSED

    own = {"listen", "peers", "checkpoint_dir", "checkpoint_every", "resume", "mixing"}
    cli_only = {"help", "verbose"}  # how the program talks, not how a node trains
    for action in build_node_parser()._actions:
        name = action.dest
        if name in cli_only:
            continue
        assert name in OPTIONS or name in REFUSED or name in own, name


def test_gossip_node_options_work_as_keywords(tmp_path):
    metrics = tmp_path / "m.jsonl"
    model, opt = _model()
    before = torch.get_num_threads()
    node = gossip.GossipNode(model, opt, listen=_addr(), threads=1, device="cpu", log=str(metrics), eval_every=2,
                             timeout=3.0, detector="heartbeat", topology="ring", period=2, **FAST)
    try:
        assert torch.get_num_threads() == 1 and node.peer.cfg.period == 2 and node.peer.cfg.timeout == 3.0
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    finally:
        node.close()
        torch.set_num_threads(before)
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "eval"] == [2, 4, 6], records
    assert records[-1]["event"] == "summary" and records[-1]["steps"] == 6


# -- a peer with another model --------------------------------------------------------------------
def test_the_first_differing_tensor_is_named():
    a = model_spec(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    b = model_spec(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)))
    assert first_difference(a, b) == "parameter '1.weight': shape (2, 8) float32 here, (3, 8) float32 there"
    c = model_spec(torch.nn.Sequential(torch.nn.Linear(4, 8)).to(torch.float64))
    assert first_difference(a[:2], c) == "parameter '0.weight': shape (8, 4) float32 here, (8, 4) float64 there"


def test_a_peer_with_another_model_is_refused_at_once_naming_the_difference_from_each_side(caplog):
    caplog.set_level(logging.INFO, logger="gossip")
    first, _ = _model(2)
    node = gossip.GossipNode(first, listen=_addr(), **FAST)
    try:
        other, _ = _model(3)
        t0 = time.monotonic()
        with pytest.raises(PeerError) as e:
            gossip.GossipNode(other, listen=_addr(), peers=[node.id], join_timeout=30.0, **FAST)
        took = time.monotonic() - t0
        # the joiner: the seed runs another model, named from the joiner's side; at once, not at join_timeout
        assert f"fingerprint mismatch: {node.id} runs another model (first difference: parameter 'weight': shape " \
               f"(3, 4) float32 here, (2, 4) float32 there)" in str(e.value), str(e.value)
        assert took < 15, took
        # the seed: the same difference, from its side, naming the other
        seed_says = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{node.id}: fingerprint")]
        assert any("(first difference: parameter 'weight': shape (2, 4) float32 here, (3, 4) float32 there)" in s
                   and node.id + " runs" not in s for s in seed_says), seed_says
        assert "no peer has answered yet" not in caplog.text
    finally:
        node.close()


# -- log levels -------------------------------------------------------------------------------------
def test_a_goodbye_is_info_and_silence_a_warning(caplog):
    caplog.set_level(logging.DEBUG, logger="gossip")
    m = Membership("a:1", 1, "f")
    m.heard("b:1", 1, 0.0)
    m.heard("c:1", 1, 0.0)
    m.remove("b:1", "said goodbye (done)", departed=True, now=1.0)
    m.remove("c:1", "silent for more than 3 s")
    levels = {r.getMessage().split(" removed")[0]: r.levelname for r in caplog.records if "removed" in r.getMessage()}
    assert levels == {"member b:1": "INFO", "member c:1": "WARNING"}, levels


def test_a_seed_not_up_yet_and_a_cleared_suspicion_stay_below_warning(caplog):
    caplog.set_level(logging.DEBUG, logger="gossip")
    m = Membership("a:1", 1, "f")
    cp = ControlPlane("a:1", 1, "f", "", m, threading.RLock(), lambda d, msg: None, lambda msg: None,
                      lambda: ("waiting", 0, 0), timing=Timing(heartbeat=0.5), seeds=("b:1",), detector="heartbeat")
    for k in range(11):  # ticks 0.5 s apart; retried with backoff: the seed is not up yet
        cp.tick(k * 0.5)
    verdicts = iter([Verdicts(suspected=["c:1"]), Verdicts(alive=["c:1"])])
    cp.detector.tick = lambda now: next(verdicts)  # (what SWIM says of a member under load)
    cp.tick(5.5)
    cp.tick(6.0)
    said = {r.getMessage(): r.levelname for r in caplog.records}
    assert any("peer b:1 does not answer; retrying" in k and v == "INFO" for k, v in said.items()), said
    assert said.get("a:1: member c:1 is suspected") == "DEBUG" and said.get("a:1: member c:1 is alive again") == "DEBUG"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text

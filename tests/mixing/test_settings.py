"""One settings object: every entry point parses the mixing options into the same
:class:`MixingSettings`, and :func:`build_rules` is the one place rules come from.

The first tests are the bugs of issue 16, each of which the old code had: options
lost under link policies, the CHOCO topology check skipped on real nodes, and
three different staleness defaults.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

import gossip
from gossip.api import Simulation
from gossip.cli import (
    build_sim_parser,
    mixing_settings,
    node_config_from_args,
    sim_main,
)
from gossip.mixing import (
    AsyncGossipRule,
    ChocoRule,
    GossipRule,
    Staleness,
    make_rule,
    parse_staleness,
)
from gossip.mixing.adversary import ScaledSender
from gossip.mixing.policy import LinkPolicy
from gossip.mixing.settings import MixingSettings, OptionError, build_rules
from gossip.protocol.config import PeerConfig
from tests.cluster import free_port

ATTACK = dict(nodes=8, topology="hierarchical:4,4", task="synthetic", steps=30, byzantine="3=1000", seed=0)


def _listen() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


# -- the bugs ---------------------------------------------------------------------------------

def test_link_policies_keep_the_attacker_and_the_clip():
    """Before: with --link-policy, node 3 mixed honestly (no attacker) and nothing was clipped."""
    attacked = Simulation(link_policy="inter:period=1", **ATTACK)
    assert [type(ch.rule) for ch in attacked.nodes[3].channels] == [ScaledSender, ScaledSender]
    undefended = attacked.run().result().summary
    defended = gossip.simulate(link_policy="inter:period=1", clip="auto", **ATTACK).summary
    clean = gossip.simulate(link_policy="inter:period=1", clip="auto", **{**ATTACK, "byzantine": None}).summary
    # the x1000 sender is really there: unprotected, the honest nodes' average is ruined
    assert not math.isfinite(undefended["final_loss"]) or undefended["final_loss"] > 1e6
    # clipping runs on both link classes and keeps the honest nodes on course
    assert defended["clipped"] > 0
    assert defended["final_loss"] < clean["final_loss"] + 0.1
    node = Simulation(link_policy="inter:period=1", clip="auto", **ATTACK).nodes[0]
    assert [(ch.name, ch.rule.clip) for ch in node.channels] == [("intra", "auto"), ("inter", "auto")]


def test_gossip_sim_link_policy_reports_clipping(capsys):
    argv = ["--nodes", "8", "--topology", "hierarchical:4,4", "--task", "synthetic", "--steps", "20",
            "--byzantine", "3=1000", "--clip", "auto", "--json"]
    import json

    assert sim_main(argv) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sim_main([*argv, "--link-policy", "inter:period=1"]) == 0
    policed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["clipped"] > 0 and policed["clipped"] > 0


def test_a_policy_can_turn_the_clip_off_and_an_incompatible_one_is_refused():
    s = MixingSettings(clip=0.5, link_policy="inter:clip=none")
    rule, per_class = build_rules(s)
    assert per_class["intra"][0].clip == 0.5 and per_class["inter"][0].clip is None
    with pytest.raises(ValueError, match="link_policy inter: clip .*synchronous uncompressed"):
        MixingSettings(clip="auto", link_policy="inter:codec=topk:0.01")


def test_real_node_checks_choco_topology_per_link_class():
    """Before: the real node built its policies with topology=None, so CHOCO on a
    time-varying graph was never refused up front."""
    with pytest.raises(ValueError, match="static topology"):
        PeerConfig(listen=_listen(), topology="one-peer-exponential", link_policy=("intra:codec=topk:0.01",))
    with pytest.raises(ValueError, match="static topology"):
        PeerConfig(listen=_listen(), topology="one-peer-exponential", compression="topk:0.01")
    from topologies import build

    s = MixingSettings(link_policy="inter:codec=topk:0.01")
    build_rules(s, build("ring", 8))  # static: fine
    with pytest.raises(ValueError, match="link_policy inter: CHOCO needs a static topology"):
        build_rules(s, build("one-peer-exponential", 8))


def test_gossip_node_refuses_choco_on_a_time_varying_graph_with_exit_2(capsys):
    from gossip.cli import node_main

    code = node_main(["--listen", _listen(), "--topology", "one-peer-exponential",
                      "--link-policy", "intra:codec=topk:0.01"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "static topology" in err and len(err.splitlines()) == 1


def test_one_staleness_default_everywhere():
    """Before: Staleness() was poly:0.5, None hinge:1,2 and a bare 'hinge' hinge:1,4."""
    default = Staleness("hinge", 1.0, 2.0)
    assert Staleness() == default
    assert parse_staleness(None) == default
    assert parse_staleness("hinge") == default
    assert MixingSettings(asynchronous=True).decay == default
    assert make_rule("gossip", asynchronous=True).decay == default
    assert AsyncGossipRule().decay == default
    assert ChocoRule("topk:0.1", asynchronous=True).decay == default
    # a link class that turns asynchronous without a decay of its own
    _, per_class = build_rules(MixingSettings(link_policy="inter:async"))
    assert per_class["inter"][0].decay == default
    assert str(default) == "hinge:1,2"


# -- one object from every entry point ----------------------------------------------------------

MIXING_FLAGS = ["--compression", "int8:128", "--period", "3", "--async", "--staleness", "poly:1", "--overlap",
                "--link-policy", "inter:period=6,codec=topk:0.1"]
EXPECTED = MixingSettings(compression="int8:128", period=3, asynchronous=True, staleness="poly:1", overlap=True,
                          link_policy=["inter:period=6,codec=topk:0.1"])


def test_cli_toml_and_api_give_the_same_settings(tmp_path):
    sim_args = build_sim_parser().parse_args(MIXING_FLAGS)
    assert mixing_settings(sim_args) == EXPECTED
    node_cfg, _ = node_config_from_args(["--listen", _listen(), *MIXING_FLAGS])
    assert node_cfg.mixing == EXPECTED
    toml = tmp_path / "node.toml"
    toml.write_text('compression = "int8:128"\nperiod = 3\nasync = true\nstaleness = "poly:1"\noverlap = true\n'
                    'link-policy = ["inter:period=6,codec=topk:0.1"]\n')
    from_toml, _ = node_config_from_args(["--listen", _listen(), "--config", str(toml)])
    assert from_toml.mixing == EXPECTED
    flat = dict(compression="int8:128", period=3, asynchronous=True, staleness="poly:1", overlap=True,
                link_policy="inter:period=6,codec=topk:0.1")
    assert gossip.SimConfig(**flat).mixing == EXPECTED
    assert gossip.SimConfig(mixing=EXPECTED).mixing == EXPECTED
    assert PeerConfig(listen=_listen(), **flat).mixing == EXPECTED
    # the parsed forms: a decay object, policies as (class, LinkPolicy) pairs
    assert EXPECTED.staleness == Staleness("poly", 1.0)
    assert EXPECTED.link_policy == (("inter", LinkPolicy(period=6, codec="topk:0.1")),)


def test_toml_numbers_and_auto_for_gamma_and_clip(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text('clip = 0.5\ngamma = "auto"\n')
    cfg, _ = node_config_from_args(["--listen", _listen(), "--config", str(toml)])
    assert cfg.mixing.clip == 0.5 and cfg.mixing.gamma == "auto"


def test_flat_options_read_back_and_replace_merges_into_the_one_object():
    cfg = gossip.SimConfig(period=4, compression="int8")
    assert (cfg.period, cfg.compression, cfg.mixing.period) == (4, "int8", 4)
    longer = dataclasses.replace(cfg, period=8)
    assert longer.mixing == MixingSettings(period=8, compression="int8")
    other = dataclasses.replace(cfg, mixing=MixingSettings(asynchronous=True))
    assert other.mixing == MixingSettings(asynchronous=True) and other.period == 1
    assert cfg.to_dict()["period"] == 4 and cfg.to_dict()["link_policy"] == []
    # the older PeerConfig form
    assert PeerConfig(listen=_listen(), options={"gamma": 0.5}, compression="topk:0.1").mixing.gamma == 0.5
    with pytest.raises(ValueError, match="unknown mixing option"):
        PeerConfig(listen=_listen(), options={"gama": 0.5})


def test_build_rules_is_where_rules_come_from():
    rule, per_class = build_rules(MixingSettings())
    assert type(rule) is GossipRule and per_class is None
    rule, per_class = build_rules(MixingSettings(period=2, link_policy="inter:period=10,codec=topk:0.01,async"))
    assert type(per_class["intra"][0]) is GossipRule and per_class["intra"][1] == 2
    inter, period = per_class["inter"]
    assert type(inter) is ChocoRule and not inter.synchronous and period == 10
    assert rule is per_class["intra"][0]


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flat,api_text", [
    (dict(staleness="poly:1"), "staleness (a decay"),
    (dict(gamma=2.0, compression="topk:0.1"), "gamma must be"),
    (dict(clip="wide"), "clip must be a number or 'auto'"),
    (dict(period=0), "period must be a positive integer"),
    (dict(compression="zip"), "compression 'zip'"),
    (dict(asynchronous="yes"), "asynchronous must be true or false"),
])
def test_api_errors_name_the_parameter(flat, api_text):
    with pytest.raises(OptionError) as e:
        gossip.SimConfig(**flat)
    assert str(e.value).startswith(api_text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv,flag_text", [
    (["--staleness", "poly:1"], "--staleness (a decay"),
    (["--clip", "wide"], "--clip must be a number or 'auto'"),
    (["--compression", "zip"], "--compression 'zip'"),
    (["--link-policy", "inter:codec=topk:0.1", "--clip", "auto"], "--link-policy inter: clip"),
])
def test_cli_errors_name_the_flag_and_exit_2(argv, flag_text, capsys):
    assert sim_main(["--steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"gossip-sim: error: {flag_text}" in err

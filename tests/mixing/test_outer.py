"""Outer optimizers over gossip (gossip.mixing.outer): references, pairings, state, errors."""

from __future__ import annotations

import json

import pytest
import torch

import gossip
from gossip.api import Simulation
from gossip.mixing import GossipRule
from gossip.mixing.outer import OuterRule, OuterSpec, parse_outer
from gossip.mixing.settings import MixingSettings, build_rules
from gossip.training.node import init_model
from gossip.training.tasks import get_task

H, ROUNDS = 5, 6


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def diloco_reference(n: int, outer: torch.optim.Optimizer | None, *, lr: float, momentum: float, nesterov: bool,
                     seed: int, task_spec: str = "synthetic") -> list[torch.Tensor]:
    """DiLoCo written out by hand, as torchft does it: n replicas from one start, H inner
    steps each, the mean pseudo-gradient handed to torch's own SGD as the outer optimizer."""
    task = get_task(task_spec)
    models = [init_model(task, seed) for _ in range(n)]
    opts = [task.optimizer(m.parameters()) for m in models]
    streams = [task.stream(i, n, "iid", seed, torch.device("cpu")) for i in range(n)]
    glob = [p.detach().clone().requires_grad_(True) for p in models[0].parameters()]
    outer = torch.optim.SGD(glob, lr=lr, momentum=momentum, nesterov=nesterov)
    for _ in range(ROUNDS):
        for m, opt, stream in zip(models, opts, streams):
            for _ in range(H):
                batch = stream.next()
                opt.zero_grad(set_to_none=True)
                task.loss(m, batch).backward()
                opt.step()
        for k, g in enumerate(glob):
            g.grad = torch.stack([g.detach() - list(m.parameters())[k].detach() for m in models]).mean(0)
        outer.step()
        with torch.no_grad():
            for m in models:
                for p, g in zip(m.parameters(), glob):
                    p.copy_(g)
    return [_flat(m) for m in models]


@pytest.mark.numeric
def test_one_node_nesterov_equals_torch_nesterov_on_the_pseudo_gradient():
    sim = gossip.simulate(nodes=1, topology="complete", task="synthetic", steps=H * ROUNDS, period=H, seed=3,
                          outer="nesterov:lr=0.7,momentum=0.9")
    ref = diloco_reference(1, None, lr=0.7, momentum=0.9, nesterov=True, seed=3)[0]
    assert torch.allclose(sim.params[0], ref, atol=1e-6, rtol=0)
    plain = gossip.simulate(nodes=1, topology="complete", task="synthetic", steps=H * ROUNDS, period=H, seed=3)
    assert (plain.params[0] - ref).abs().max() > 1e-2  # the outer step made a difference


@pytest.mark.numeric
@pytest.mark.parametrize("spec,nesterov", [("nesterov:lr=0.7,momentum=0.9", True), ("noloco", False)])
def test_complete_graph_is_diloco(spec, nesterov):
    """Exact averaging on a complete graph: every node follows hand-written DiLoCo."""
    outer = parse_outer(spec)
    r = gossip.simulate(nodes=4, topology="complete", task="synthetic", steps=H * ROUNDS, period=H, seed=1,
                        outer=spec)
    ref = diloco_reference(4, None, lr=outer.lr, momentum=outer.momentum, nesterov=nesterov, seed=1)
    for got, want in zip(r.params, ref):
        assert torch.allclose(got, want, atol=1e-5, rtol=0)


def _with_forced_outer(spec: OuterSpec, **cfg) -> Simulation:
    sim = Simulation(**cfg)
    for node in sim.nodes:
        for ch in node.channels:
            ch.rule = OuterRule(ch.rule, spec)
            ch.rule.overlap = node.config.overlap and ch.rule.synchronous
            ch.rule.on_adopt(node.state.flat)
        node.rule = node.channels[0].rule
    return sim


def _int8_steps(sent: list, numel: int) -> torch.Tensor:
    """Per parameter: the largest quantization step (its block's absmax / 127) that any int8
    message in ``sent`` (see :func:`_capture`) carried for it."""
    from gossip.core.buffers import from_buffer

    msgs = [m.data for _, m in sent if m.data.codec == "int8"]
    assert msgs and {d.numel for d in msgs} == {numel}
    block = msgs[0].meta["block"]
    scales = torch.stack([from_buffer(d.buffers[1], torch.float32) for d in msgs]).amax(0)
    return scales.repeat_interleave(block)[:numel]


@pytest.mark.numeric
@pytest.mark.parametrize("extra", [{}, {"overlap": True}, {"asynchronous": True}, {"compression": "int8"},
                                   {"algorithm": "push-sum"}])
def test_sgd_lr_1_through_the_outer_path_is_todays_gossip(extra):
    """H = 1, sgd:lr=1 through the outer wrapper on a complete graph gives today's numbers
    (the default builds no wrapper at all: the rule itself).

    The wrapper leaves ``anchor - (anchor - mixed)`` where the rule leaves ``mixed``: equal up
    to the last bit, and which bit depends on the CPU's kernels. Mixing is continuous, so
    without a codec the runs agree to float rounding. int8 rounds ``x - x_hat`` to whole
    steps of its block: a last-bit difference on a rounding boundary becomes one code more
    or less, which moves a public copy by one step ``s`` and each node by ``gamma * s`` or
    less. So with int8 the runs agree to one step of the largest scale each block carried
    (a wrong wrapper, lr 0.9 for 1, is ~12 steps off).
    """
    # the event loop: in lockstep the engine mixes whole rounds itself and never calls the forced rule
    cfg = dict(nodes=4, topology="complete", task="synthetic", steps=12, period=1, seed=2, engine="batched", **extra)
    sim = Simulation(**cfg)
    sent = _capture(sim)
    today = sim.run().result()
    new = _with_forced_outer(OuterSpec("sgd", 1.0, 0.0), **cfg).run().result()
    tol = _int8_steps(sent, sim.nodes[0].numel) if "compression" in extra else torch.tensor(1e-6)
    for a, b in zip(today.params, new.params):
        assert bool(((a - b).abs() <= tol).all()), float(((a - b).abs() / tol).max())
    assert new.summary["final_loss"] == pytest.approx(today.summary["final_loss"], abs=1e-5)
    rule, _ = build_rules(MixingSettings(outer="sgd:lr=1", **extra))
    assert not isinstance(rule, OuterRule)


@pytest.mark.parametrize("extra", [{}, {"overlap": True}, {"asynchronous": True}, {"compression": "topk:0.1"},
                                   {"algorithm": "push-sum"}, {"link_policy": "inter:period=10,async"}])
def test_outer_runs_with_every_rule_and_the_average_still_trains(extra):
    cfg = dict(nodes=8, topology="hierarchical:4,4" if "link_policy" in extra else "ring", task="synthetic",
               steps=60, period=5, seed=0, **extra)
    base = gossip.simulate(**cfg).summary
    # (DiLoCo's own 0.7 / 0.9 is tuned for AdamW inner steps; on the synthetic task's SGD it
    # overshoots, on a complete graph as much as here)
    r = gossip.simulate(outer="nesterov:lr=0.4,momentum=0.8", **cfg)
    s = r.summary
    assert s["outer"] == "nesterov:lr=0.4,momentum=0.8"
    assert all(torch.isfinite(p).all() for p in r.params)
    assert s["final_loss"] < base["final_loss"] + 0.05  # trains about as well as plain averaging
    assert s["bytes_sent"] == base["bytes_sent"] or extra  # the same messages: one vector per exchange


def test_overlap_outer_keeps_the_inner_steps_made_while_the_round_travelled():
    """With overlap, a node's parameters after the delayed outer step are the new anchor
    plus the inner steps it made since it sent the round."""
    rule = OuterRule(GossipRule(), OuterSpec("nesterov", 0.7, 0.9))
    rule.overlap = True

    class Alone:  # a one-node topology: mixing is the identity
        time_varying = False

        def in_weights(self, me, rnd):
            return {0: 1.0}

        def out_weights(self, me, rnd):
            return {0: 1.0}

    from gossip.mixing import Inbox

    x = torch.zeros(3)
    rule.on_adopt(x)
    x += torch.tensor([1.0, 2.0, 3.0])          # H inner steps: theta = phi - Delta, Delta = -(1,2,3)
    rule.outgoing(x, Alone(), 0, 0)
    x += torch.tensor([10.0, 10.0, 10.0])       # the next inner steps, while round 0 travels
    rule.mix(x, Inbox(), Alone(), 0, 0, 10)
    g = -torch.tensor([1.0, 2.0, 3.0])          # phi - theta~ = 0 - (1, 2, 3)
    b = g.clone()
    phi = -0.7 * (g + 0.9 * b)
    assert torch.allclose(rule.anchor, phi)
    assert torch.allclose(x, phi + 10.0)


def test_checkpoint_restores_the_outer_state(tmp_path):
    from gossip.core.checkpoint import load_checkpoint, save_checkpoint

    sim = Simulation(nodes=2, topology="ring", task="synthetic", steps=20, period=5, outer="nesterov", seed=0)
    sim.run()
    node = sim.nodes[0]
    rule = node.rule
    assert isinstance(rule, OuterRule) and rule.momentum is not None and rule.outer_steps == 4
    path = save_checkpoint(node.state_dict(), tmp_path, node.step)
    fresh = Simulation(nodes=2, topology="ring", task="synthetic", steps=20, period=5, outer="nesterov", seed=5)
    other = fresh.nodes[0]
    other.load_state_dict(load_checkpoint(path))
    assert torch.equal(other.rule.anchor, rule.anchor)
    assert torch.equal(other.rule.momentum, rule.momentum)
    assert other.rule.outer_steps == 4


def test_a_joiner_takes_the_outer_momentum_with_the_parameters(monkeypatch):
    """The real protocol's join (gossip.sim.fault_runs): the restarted node pulls a member's
    state, which carries the outer momentum with the parameters."""
    from gossip.training.node import Node

    handed, taken = [], []
    handover, adopt = Node.handover, Node.adopt_handover

    def spy_handover(self):
        flat, extra = handover(self)
        handed.append((self.id, flat.clone(), extra))
        return flat, extra

    def spy_adopt(self, values, extra):
        adopt(self, values, extra)
        taken.append((self.id, values.clone(), self.rule.momentum.clone()))

    monkeypatch.setattr(Node, "handover", spy_handover)
    monkeypatch.setattr(Node, "adopt_handover", spy_adopt)
    sim = Simulation(nodes=4, topology="ring", task="synthetic", steps=60, period=5, outer="nesterov", seed=0,
                     faults=["crash:3@0.15", "join:3@0.3"], detect=0.05)
    r = sim.run().result()
    joiner = sim.cluster.procs[3]
    assert [who for who, _, _ in taken] == [joiner.id]
    _, values, momentum = taken[0]
    # what it took is exactly one member's handover: parameters, then the momentum
    sent = [(who, flat, extra) for who, flat, extra in handed if torch.equal(flat, values)]
    # (the extras: the outer momentum's offset, and the inner optimizer's state: see core/train_state.py)
    assert len(sent) == 1 and sent[0][0] != joiner.id and sent[0][2]["outer"] == [0] and set(sent[0][2]) == {"outer", "train"}
    n = joiner.life.node.numel  # parameters, then the momentum, then the optimizer's state
    assert torch.equal(momentum, values[n:2 * n]) and float(momentum.abs().sum()) > 0
    assert r.summary["exits"] == ["done"] * 4 and sim.cluster.results()[3]["joined"]


# -- bad input ----------------------------------------------------------------------------------

BAD = [("adam", "unknown optimizer 'adam'"), ("nesterov:lr=-1", "lr=-1 is out of range"),
       ("nesterov:lr=0.7,momentum=1.5", "momentum=1.5 is out of range"), ("sgd:beta=2", "bad option 'beta=2'")]


@pytest.mark.parametrize("spec,needle", BAD)
def test_bad_outer_api(spec, needle):
    with pytest.raises(ValueError) as e:
        gossip.SimConfig(outer=spec)
    text = str(e.value)
    assert text.startswith("outer") and needle in text and "valid: sgd:lr=L" in text and "\n" not in text


@pytest.mark.parametrize("spec,needle", BAD)
def test_bad_outer_cli_exits_2(spec, needle, capsys):
    from gossip.cli import sim_main

    assert sim_main(["--steps", "1", "--outer", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gossip-sim: error: --outer") and needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("spec,needle", BAD)
def test_bad_outer_toml_exits_2(spec, needle, tmp_path, capsys):
    from gossip.cli import node_main
    from tests.cluster import free_port

    toml = tmp_path / "node.toml"
    toml.write_text(f'topology = "complete"\nouter = "{spec}"\n')
    assert node_main(["--listen", f"tcp://127.0.0.1:{free_port()}", "--config", str(toml)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gossip-node: error: --outer") and needle in err and len(err.splitlines()) == 1


def test_outer_with_push_sum_on_an_irregular_graph_is_refused(capsys):
    from gossip.cli import sim_main

    with pytest.raises(ValueError, match="push-sum needs a graph whose push-sum masses stay 1"):
        Simulation(nodes=6, topology="star", algorithm="push-sum", outer="nesterov", task="synthetic", steps=2)
    Simulation(nodes=6, topology="ring", algorithm="push-sum", outer="nesterov", task="synthetic", steps=2)
    assert sim_main(["--nodes", "6", "--topology", "star", "--algorithm", "push-sum", "--outer", "nesterov",
                     "--steps", "2"]) == 2
    assert "--outer" in capsys.readouterr().err


def test_outer_per_link_class():
    s = MixingSettings(period=2, link_policy="inter:period=10,outer=nesterov:lr=0.5,momentum=0.8,async")
    rule, per_class = build_rules(s)
    assert not isinstance(per_class["intra"][0], OuterRule)
    inter = per_class["inter"][0]
    assert isinstance(inter, OuterRule) and inter.spec == OuterSpec("nesterov", 0.5, 0.8) and not inter.synchronous
    assert str(s.policies["inter"]).endswith("outer=nesterov:lr=0.5,momentum=0.8,async")
    # the CLI form round-trips through the settings' own text
    again = MixingSettings(period=2, link_policy=f"inter:{s.policies['inter']}")
    assert again == s
    json.dumps(s.to_dict())


# -- compressed pseudo-gradients ----------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 2])
def test_what_a_low_bit_round_drops_is_sent_later(bits):
    """Error feedback: with x held still, the public copy CHOCO sends towards closes in on
    x round after round (int2 drops 65% of the energy of each difference)."""
    from gossip.mixing import ChocoRule
    from topologies import build

    topo = build("ring", 3)
    rule = ChocoRule(f"int{bits}")
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    gaps = []
    for r in range(6):
        rule.outgoing(x, topo, 0, r)
        gaps.append(float((x - rule.own).norm() / x.norm()))
    assert gaps[0] > 0.1 if bits == 2 else gaps[0] > 0.01
    assert all(b < 0.6 * a for a, b in zip(gaps, gaps[1:]))  # geometric: nothing is lost for good


@pytest.mark.parametrize("codec,ratio", [("int4", 7.0), ("int2", 12.0)])
def test_outer_with_low_bit_pseudo_gradients_trains_at_a_fraction_of_the_bytes(codec, ratio):
    cfg = dict(nodes=8, topology="ring", task="synthetic", steps=100, period=5, seed=0,
               outer="nesterov:lr=0.4,momentum=0.8")
    full = gossip.simulate(**cfg).summary
    packed = gossip.simulate(compression=codec, **cfg).summary
    assert packed["rule"] == "choco"
    assert full["bytes_sent"] / packed["bytes_sent"] > ratio
    assert packed["final_loss"] < full["final_loss"] + 0.08


def test_the_node_sets_the_inner_rules_attributes_through_the_wrapper():
    from gossip.mixing import PushSumRule

    rule = OuterRule(PushSumRule(), OuterSpec("nesterov", 0.7, 0.9))
    rule.weight = 0.25  # a joiner resets its push-sum mass (gossip.peer.driver)
    rule.overlap = True
    rule.sends_live = True
    assert (rule.inner.weight, rule.inner.overlap, rule.inner.sends_live) == (0.25, True, True)
    assert rule.weight == 0.25 and rule.synchronous and rule.name == "push-sum"
    assert "weight" not in vars(rule)


def test_gossip_node_flags_and_toml_refuse_bad_outer_pairings(tmp_path, capsys):
    from gossip.cli import node_main
    from tests.cluster import free_port

    listen = ["--listen", f"tcp://127.0.0.1:{free_port()}"]
    assert node_main([*listen, "--outer", "nesterov:lr=-1"]) == 2
    assert "--outer: nesterov lr=-1 is out of range" in capsys.readouterr().err
    toml = tmp_path / "node.toml"
    toml.write_text('topology = "star"\nalgorithm = "push-sum"\nouter = "nesterov"\n')
    assert node_main([*listen, "--config", str(toml)]) == 2
    err = capsys.readouterr().err.strip()
    assert "push-sum needs a graph whose push-sum masses stay 1" in err and len(err.splitlines()) == 1
    cfg_ok = tmp_path / "ok.toml"
    cfg_ok.write_text('outer = "noloco:lr=0.5,momentum=0.3"\nlink-policy = ["inter:outer=nesterov:lr=0.7,momentum=0.9"]\n')
    from gossip.cli import node_config_from_args

    cfg, _ = node_config_from_args([*listen, "--config", str(cfg_ok)])
    assert str(cfg.mixing.outer) == "noloco:lr=0.5,momentum=0.3"
    assert str(cfg.mixing.for_link("inter").outer) == "nesterov:lr=0.7,momentum=0.9"


# -- exchange=pseudograd: compressed pseudo-gradients with error feedback (SparseLoCo) ----------

PG = "nesterov:lr=0.7,momentum=0.9,exchange=pseudograd"


def _capture(sim: Simulation) -> list:
    """Every (receiver, message) the nodes of ``sim`` hand to the transport."""
    sent: list = []
    for node in sim.nodes:
        def outgoing(ch, rnd, _orig=node.outgoing):
            out = _orig(ch, rnd)
            sent.extend(out)
            return out
        node.outgoing = outgoing
    return sent


@pytest.mark.numeric
def test_pseudograd_with_the_identity_codec_is_diloco():
    """No compression: mixing the pseudo-gradients is DiLoCo, as the parameter path is."""
    from gossip.mixing.pseudograd import PseudoGradientRule

    cfg = dict(nodes=4, topology="complete", task="synthetic", steps=H * ROUNDS, period=H, seed=1)
    sim = Simulation(outer=PG, **cfg)
    assert isinstance(sim.nodes[0].rule, PseudoGradientRule)
    r = sim.run().result()
    ref = diloco_reference(4, None, lr=0.7, momentum=0.9, nesterov=True, seed=1)
    params = gossip.simulate(outer="nesterov:lr=0.7,momentum=0.9", **cfg)
    for got, want, other in zip(r.params, ref, params.params):
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
        assert torch.allclose(got, other, atol=1e-5, rtol=0)
    assert r.summary["bytes_sent"] == params.summary["bytes_sent"]  # one full vector per neighbour either way


def test_pseudograd_error_feedback_sends_later_what_was_dropped():
    """sum of what was sent + the residual = sum of the pseudo-gradients, round after round."""
    from gossip.mixing import Inbox
    from gossip.mixing.pseudograd import PseudoGradientRule
    from topologies import build

    topo = build("complete", 1)
    rule = PseudoGradientRule("topk:0.1", OuterSpec("nesterov", 0.7, 0.9, "pseudograd"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen)
    rule.on_adopt(x)
    sent_sum, delta_sum = torch.zeros(1000), torch.zeros(1000)
    for r in range(8):
        delta = torch.randn(1000, generator=gen)
        x.copy_(rule.anchor - delta)               # H inner steps moved theta by -Delta
        rule.outgoing(x, topo, 0, r)
        sent = rule._own[r].clone()
        assert int((sent != 0).sum()) == 100       # top-10%: what travelled
        sent_sum += sent
        delta_sum += delta
        assert torch.allclose(sent_sum + rule.residual, delta_sum, atol=1e-4, rtol=0)
        assert float(rule.residual.norm()) > 0.5 * float(delta.norm())  # most was held back, not lost
        rule.mix(x, Inbox(), topo, 0, r, (r + 1) * 5)
        assert torch.equal(x, rule.anchor)


def test_pseudograd_bytes_are_counted_exactly():
    from gossip.compression import get_codec
    from gossip.transport.wire import encode

    n, rounds = 4, 6
    sim = Simulation(nodes=n, topology="complete", task="synthetic", steps=H * rounds, period=H, seed=0,
                     outer=PG, compression="topk:0.05")
    sent = _capture(sim)
    s = sim.run().result().summary
    numel = sim.nodes[0].numel
    payload = get_codec("topk:0.05").encode(torch.randn(numel)).nbytes
    assert len(sent) == n * (n - 1) * rounds
    assert all(m.data.nbytes == payload and m.data.numel == numel for _, m in sent)
    assert s["bytes_sent"] == sum(sum(memoryview(f).nbytes for f in encode(m)) for _, m in sent)
    full = gossip.simulate(nodes=n, topology="complete", task="synthetic", steps=H * rounds, period=H, seed=0,
                           outer=PG).summary
    assert full["bytes_sent"] > 8 * s["bytes_sent"]


def test_topk_pseudo_gradients_under_nesterov_keep_the_replicas_identical_and_train():
    """What diverged through CHOCO (top-k under Nesterov 0.7 / 0.9) trains through exchange=pseudograd."""
    cfg = dict(nodes=8, topology="complete", task="synthetic", steps=100, period=5, seed=0,
               outer="nesterov:lr=0.7,momentum=0.9")
    start = gossip.simulate(**{**cfg, "steps": 0}).summary["final_loss"]
    full = gossip.simulate(**cfg)
    choco = gossip.simulate(**cfg, compression="topk:0.3")
    sparse = gossip.simulate(**{**cfg, "outer": cfg["outer"] + ",exchange=pseudograd"}, compression="topk:0.3")
    assert sparse.summary["rule"] == "pseudograd" and choco.summary["rule"] == "choco"
    spread = lambda r: max(float((p - r.params[0]).abs().max()) for p in r.params)  # noqa: E731
    assert spread(sparse) < 1e-5 < 1.0 < spread(choco)  # CHOCO's copies fall behind; here nothing drifts
    assert sparse.summary["final_loss"] < min(0.5 * start, full.summary["final_loss"] + 0.12)
    assert full.summary["bytes_sent"] / sparse.summary["bytes_sent"] > 1.4


def test_pseudograd_checkpoint_restores_the_residual(tmp_path):
    from gossip.core.checkpoint import load_checkpoint, save_checkpoint

    cfg = dict(nodes=2, topology="complete", task="synthetic", steps=20, period=5, outer=PG, compression="topk:0.1")
    sim = Simulation(seed=0, **cfg)
    sim.run()
    rule = sim.nodes[0].rule
    assert rule.residual is not None and rule.outer_steps == 4
    path = save_checkpoint(sim.nodes[0].state_dict(), tmp_path, sim.nodes[0].step)
    other = Simulation(seed=5, **cfg).nodes[0]
    other.load_state_dict(load_checkpoint(path))
    for name in ("anchor", "momentum", "residual"):
        assert torch.equal(getattr(other.rule, name), getattr(rule, name))


@pytest.mark.parametrize("extra,needle", [
    ({"topology": "ring"}, "needs exact averaging"),
    ({"topology": "one-peer-exponential"}, "needs exact averaging"),
    ({"asynchronous": True}, "asynchronous mixing does not"),
    ({"algorithm": "push-sum"}, "algorithm must be gossip"),
    ({"gamma": 0.5}, "takes no gamma"),
])
def test_pseudograd_is_refused_where_it_is_not_exact(extra, needle):
    with pytest.raises(ValueError) as e:
        Simulation(**{"nodes": 4, "topology": "complete", "task": "synthetic", "steps": 2, "outer": PG, **extra})
    text = str(e.value)
    assert text.startswith("outer") and needle in text and "else exchange=params" in text and "\n" not in text


def test_pseudograd_and_fragments_parse_the_same_everywhere(tmp_path, capsys):
    from gossip.cli import node_config_from_args, sim_main
    from tests.cluster import free_port

    spec = "nesterov:lr=0.7,momentum=0.9,exchange=pseudograd,fragments=2"
    want = OuterSpec("nesterov", 0.7, 0.9, "pseudograd", 2)
    assert parse_outer(spec) == want and parse_outer(str(want)) == want
    assert gossip.SimConfig(outer=spec).outer == want
    s = MixingSettings(link_policy=f"inter:period=10,outer={spec}")
    assert s.for_link("inter").outer == want and s.for_link("intra").outer == OuterSpec()
    assert MixingSettings(link_policy=f"inter:{s.policies['inter']}") == s
    toml = tmp_path / "node.toml"
    toml.write_text(f'topology = "complete"\nouter = "{spec}"\n')
    listen = ["--listen", f"tcp://127.0.0.1:{free_port()}"]
    cfg, _ = node_config_from_args([*listen, "--config", str(toml)])
    assert cfg.mixing.outer == want
    for bad, needle in [("nesterov:exchange=grads", "exchange must be one of params, pseudograd"),
                        ("nesterov:fragments=0", "fragments must be an integer >= 1"),
                        ("nesterov:fragments=1.5", "fragments must be an integer")]:
        assert sim_main(["--steps", "1", "--outer", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("gossip-sim: error: --outer") and needle in err and len(err.splitlines()) == 1
    assert sim_main(["--steps", "1", "--topology", "ring", "--outer", "nesterov:exchange=pseudograd"]) == 2
    assert "exchange=pseudograd needs exact averaging" in capsys.readouterr().err


# -- fragments (Streaming DiLoCo) -----------------------------------------------------------------

def streaming_reference(n: int, fragments: int, rounds: int, *, lr: float, momentum: float, seed: int,
                        period: int = H) -> list[torch.Tensor]:
    """Streaming DiLoCo by hand on a complete graph: round r averages the pseudo-gradient of
    fragment r mod F only and steps that fragment's own torch SGD (Nesterov); the other
    fragments go on training locally."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from gossip.mixing.fragments import fragment_bounds

    task = get_task("synthetic")
    models = [init_model(task, seed) for _ in range(n)]
    opts = [task.optimizer(m.parameters()) for m in models]
    streams = [task.stream(i, n, "iid", seed, torch.device("cpu")) for i in range(n)]
    start = parameters_to_vector(models[0].parameters()).detach()
    bounds = fragment_bounds(start.numel(), fragments)
    glob = [start[lo:hi].clone().requires_grad_(True) for lo, hi in bounds]
    outer = [torch.optim.SGD([g], lr=lr, momentum=momentum, nesterov=True) for g in glob]
    for r in range(rounds):
        for m, opt, stream in zip(models, opts, streams):
            for _ in range(period):
                opt.zero_grad(set_to_none=True)
                task.loss(m, stream.next()).backward()
                opt.step()
        f = r % fragments
        lo, hi = bounds[f]
        flats = [parameters_to_vector(m.parameters()).detach() for m in models]
        glob[f].grad = torch.stack([glob[f].detach() - x[lo:hi] for x in flats]).mean(0)
        outer[f].step()
        with torch.no_grad():
            for m, x in zip(models, flats):
                x = x.clone()
                x[lo:hi] = glob[f].detach()
                vector_to_parameters(x, m.parameters())
    return [parameters_to_vector(m.parameters()).detach() for m in models]


@pytest.mark.numeric
@pytest.mark.parametrize("exchange", ["params", "pseudograd"])
def test_each_fragment_follows_its_own_outer_optimizer_on_a_complete_graph(exchange):
    rounds, F = 7, 3
    r = gossip.simulate(nodes=4, topology="complete", task="synthetic", steps=H * rounds, period=H, seed=1,
                        outer=f"nesterov:lr=0.7,momentum=0.9,exchange={exchange},fragments={F}")
    ref = streaming_reference(4, F, rounds, lr=0.7, momentum=0.9, seed=1)
    for got, want in zip(r.params, ref):
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
    whole = gossip.simulate(nodes=4, topology="complete", task="synthetic", steps=H * rounds, period=H, seed=1,
                            outer="nesterov:lr=0.7,momentum=0.9")
    assert (whole.params[0] - r.params[0]).abs().max() > 1e-2  # fragments made a difference


@pytest.mark.numeric
@pytest.mark.parametrize("extra", [{}, {"overlap": True}, {"compression": "int8"}])
def test_one_fragment_is_todays_outer_step_number_for_number(extra):
    from gossip.mixing.fragments import FragmentRule

    cfg = dict(nodes=4, topology="ring", task="synthetic", steps=30, period=5, seed=2, **extra)
    spec = OuterSpec("nesterov", 0.4, 0.8)
    today = gossip.simulate(outer=str(spec), **cfg)
    sim = Simulation(outer=str(spec), **cfg)
    for node in sim.nodes:
        for ch in node.channels:
            rule = ch.rule
            ch.rule = FragmentRule(lambda rule=rule: rule, 1)
            ch.rule.overlap = rule.overlap
        node.rule = node.channels[0].rule
    new = sim.run().result()
    for a, b in zip(today.params, new.params):
        assert torch.equal(a, b)
    assert new.summary["bytes_sent"] == today.summary["bytes_sent"]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_rounds_bytes_are_its_fragments(overlap):
    from gossip.mixing.fragments import fragment_bounds
    from gossip.transport.wire import encode

    n, rounds, F = 4, 7, 3
    sim = Simulation(nodes=n, topology="ring", task="synthetic", steps=H * rounds, period=H, seed=0,
                     outer=f"nesterov:lr=0.4,momentum=0.8,fragments={F}", overlap=overlap)
    sent = _capture(sim)
    s = sim.run().result().summary
    bounds = fragment_bounds(sim.nodes[0].numel, F)
    assert len(sent) == n * 2 * rounds and len({hi - lo for lo, hi in bounds}) > 1  # sizes differ: checked per round
    for _, m in sent:
        lo, hi = bounds[m.round % F]
        assert m.data.numel == hi - lo and m.data.nbytes == 4 * (hi - lo)
    assert s["bytes_sent"] == sum(sum(memoryview(f).nbytes for f in encode(m)) for _, m in sent)
    assert s["rejected"] == 0 and s["missing_neighbors"] == 0
    whole = gossip.simulate(nodes=n, topology="ring", task="synthetic", steps=H * rounds, period=H, seed=0,
                            outer="nesterov:lr=0.4,momentum=0.8", overlap=overlap).summary
    assert s["bytes_sent"] < whole["bytes_sent"] / 2.5
    start = gossip.simulate(nodes=n, topology="ring", task="synthetic", steps=0, seed=0).summary["final_loss"]
    assert s["final_loss"] < 0.6 * start  # it trains, with or without overlap (each fragment: 2-3 outer steps)


def test_fragments_are_refused_with_asynchronous_and_push_sum_rules():
    for extra, needle in [({"asynchronous": True}, "fragments need synchronous rounds"),
                          ({"algorithm": "push-sum"}, "cannot be used with push-sum")]:
        with pytest.raises(ValueError, match=needle):
            MixingSettings(outer="nesterov:fragments=2", **extra)


def test_overlapped_pseudograd_keeps_the_inner_steps_made_while_the_round_travelled():
    from gossip.mixing import Inbox
    from gossip.mixing.pseudograd import PseudoGradientRule
    from topologies import build

    topo = build("complete", 1)
    rule = PseudoGradientRule("none", OuterSpec("nesterov", 0.7, 0.9, "pseudograd"))
    rule.overlap = True
    x = torch.zeros(3)
    rule.on_adopt(x)
    x += torch.tensor([1.0, 2.0, 3.0])          # Delta = phi - theta = -(1, 2, 3)
    rule.outgoing(x, topo, 0, 0)
    x += 10.0                                   # the next inner steps, while round 0 travels
    rule.mix(x, Inbox(), topo, 0, 0, 10)
    g = -torch.tensor([1.0, 2.0, 3.0])
    phi = -0.7 * (g + 0.9 * g)
    assert torch.allclose(rule.anchor, phi)
    assert torch.allclose(x, phi + 10.0)
    rule.outgoing(x, topo, 0, 1)                # the next pseudo-gradient: only the 10 made since
    assert torch.allclose(rule._own[1], torch.full((3,), -10.0))


@pytest.mark.parametrize("kind", ["sgd", "nesterov", "noloco"])
def test_an_outer_optimizers_defaults_are_one_and_the_same_however_it_is_made(kind):
    """OuterSpec(kind) used to be lr 1 / momentum 0 for every kind while the parser gave
    nesterov 0.7 / 0.9: the kind's defaults are now written once (OUTER_KINDS)."""
    from gossip.mixing.outer import OUTER_KINDS

    lr, momentum = OUTER_KINDS[kind]
    assert OuterSpec(kind) == parse_outer(kind) == OuterSpec(kind, lr, momentum)
    assert OuterSpec(kind, lr=0.5).momentum == momentum and parse_outer(f"{kind}:lr=0.5") == OuterSpec(kind, 0.5)

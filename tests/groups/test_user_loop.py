"""GossipNode's group form (gossip.groups.user_loop.GroupNode) without processes: what it
refuses, and that nothing of the single-process node runs in it by inheritance. The real
groups are in test_user_loop_real.py."""

from __future__ import annotations

import inspect

import pytest
import torch

import gossip
from gossip.groups.user_loop import GROUP_REFUSED, NOT_FOR_GROUPS, GroupNode
from gossip.peer.user_loop import GossipNode

TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


@pytest.fixture
def torchrun(monkeypatch):
    """This process as rank 0 of 2 under torchrun (its process group not initialised)."""
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)


def _model():
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_plain_module_under_torchrun_is_an_error_saying_how_to_wrap_it(torchrun):
    model, opt = _model()
    with pytest.raises(ValueError) as e:
        gossip.GossipNode(model, opt, listen="127.0.0.1:1")
    text = str(e.value)
    assert "DistributedDataParallel(model)" in text and "fully_shard(model)" in text and "Linear" in text, text
    assert "without torchrun" in text


@pytest.mark.parametrize("kwargs,name", [
    ({"scheduler": "a scheduler"}, "scheduler"),
    ({"same_start": True}, "same_start"),
    ({"resume_step": 5}, "resume_step"),
    ({"device": "cpu"}, "device"),
])
def test_options_a_group_cannot_honour_are_refused_naming_them(torchrun, kwargs, name):
    model, opt = _model()
    with pytest.raises(ValueError) as e:
        gossip.GossipNode(model, opt, listen="127.0.0.1:1", **kwargs)
    assert str(e.value).startswith(f"{name} is not supported for a group under torchrun: "), str(e.value)
    assert GROUP_REFUSED[name] in str(e.value)


def test_gossip_node_options_are_checked_as_for_a_single_node(torchrun):
    model, opt = _model()
    with pytest.raises(ValueError, match="steps is not an option of GossipNode"):
        gossip.GossipNode(model, opt, listen="127.0.0.1:1", steps=10)
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        gossip.GossipNode(model, opt, listen="127.0.0.1:1", bogus=1)


def test_same_start_false_is_no_refusal(torchrun):
    model, opt = _model()
    with pytest.raises(ValueError, match="DistributedDataParallel"):  # (past the refusals: the plain module)
        gossip.GossipNode(model, opt, listen="127.0.0.1:1", same_start=False)


def test_without_the_group_form_registered_the_peer_class_says_which_to_use(torchrun, monkeypatch):
    monkeypatch.setattr(GossipNode, "group_form", None)
    model, opt = _model()
    with pytest.raises(ValueError, match="use gossip.GossipNode"):
        GossipNode(model, opt, listen="127.0.0.1:1")


def test_outside_torchrun_gossip_node_is_the_single_process_node(monkeypatch):
    for k in TORCHRUN:
        monkeypatch.delenv(k, raising=False)
    node = GossipNode.__new__(GossipNode)
    assert type(node) is GossipNode
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc-per-node 1: a single process too
    assert type(GossipNode.__new__(GossipNode)) is GossipNode


def test_the_group_form_defines_every_public_name_of_the_single_node_itself():
    """No method of the single-process node runs on a group by inheritance (each would act
    on a Peer the group's ranks do not have): GroupNode defines them all itself."""
    public = {n for n in vars(GossipNode) if not n.startswith("_")} - {"group_form"}
    missing = sorted(n for n in public if n not in vars(GroupNode))
    assert not missing, missing
    for name, value in vars(GossipNode).items():  # (and with the same parameters, where it takes any)
        if name in public and inspect.isfunction(value):
            single = list(inspect.signature(value).parameters)
            group = list(inspect.signature(vars(GroupNode)[name]).parameters)
            assert group == single, (name, single, group)


@pytest.mark.parametrize("name", ["consensus_model", "neighbor_distance"])
def test_what_a_group_cannot_run_raises_naming_it(name):
    assert sorted(NOT_FOR_GROUPS) == ["consensus_model", "neighbor_distance"]  # (the others have group forms)
    node = object.__new__(GroupNode)
    with pytest.raises(NotImplementedError) as e:
        getattr(node, name)()
    assert f"GossipNode.{name} is not supported for a group under torchrun: {NOT_FOR_GROUPS[name]}" == str(e.value)


@pytest.mark.parametrize("name,args", [("average", (1.0,)), ("all_gather", (torch.zeros(2),)), ("barrier", ())])
def test_the_collectives_across_members_after_close_say_the_node_has_left(name, args):
    node = object.__new__(GroupNode)
    node._closed = True
    with pytest.raises(RuntimeError, match=f"GossipNode.{name} after close"):
        getattr(node, name)(*args)

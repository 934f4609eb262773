"""The tree's layers: every import points down, and no module imports itself in a circle.

The layers (gossip/__init__.py says the same): core -> compression -> {mixing,
transport} -> training -> protocol -> {peer, sim} -> groups -> integrations -> the
entry points (api, cli, plot, explore). Modules of one folder may import each
other (without circles); mixing and transport never import each other, nor do
peer and sim. ``topologies`` stands alone (networkx and numpy only).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANK = {"core": 0, "compression": 1, "mixing": 2, "transport": 2, "training": 3, "protocol": 4,
        "peer": 5, "sim": 5, "groups": 6, "integrations": 7}
TOP = 8  # gossip's own modules: api, cli, plot, explore, __init__


def modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Every module of ``known`` that ``path`` imports, at the top or inside a function."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    known = {**modules("gossip"), **modules("topologies")}
    return {name: imports(path, name, known) for name, path in known.items()}


def layer(name: str) -> tuple[str, int]:
    parts = name.split(".")
    if parts[0] == "topologies":
        return "topologies", -1
    if len(parts) > 1 and parts[1] in RANK:
        return parts[1], RANK[parts[1]]
    return "entry", TOP


def against_layers(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, targets in sorted(g.items()):
        folder, rank = layer(name)
        for t in sorted(targets):
            tfolder, trank = layer(t)
            if folder == "topologies" and tfolder != "topologies":
                bad.append(f"{name} -> {t} (topologies stands alone)")
            elif tfolder != folder and trank >= rank:
                bad.append(f"{name} ({folder}) -> {t} ({tfolder})")
    return bad


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_import_points_down_the_layers():
    bad = against_layers(graph())
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_there_are_no_import_circles():
    assert circles(graph()) == []


def test_topologies_knows_nothing_of_torch_or_sockets():
    for name, path in modules("topologies").items():
        text = path.read_text()
        for lib in ("torch", "zmq", "gossip"):
            assert f"import {lib}" not in text and f"from {lib}" not in text, (name, lib)


@pytest.mark.parametrize("src,dst", [
    ("gossip.core.state", "gossip.protocol.membership"),     # up the layers
    ("gossip.sim.cluster", "gossip.peer.driver"),            # between drivers
    ("gossip.mixing.base", "gossip.transport.wire"),         # between mixing and transport
    ("topologies.builders", "gossip.core.state"),            # out of the standalone package
])
def test_an_import_against_the_layers_is_caught(src, dst):
    g = graph()
    assert src in g and dst in g
    g[src] = g[src] | {dst}
    assert against_layers(g) == [next(x for x in against_layers(g) if x.startswith(src))]


def test_an_import_circle_is_caught():
    g = graph()
    g["gossip.core.message"] = g["gossip.core.message"] | {"gossip.core.state"}
    g["gossip.core.state"] = g["gossip.core.state"] | {"gossip.core.message"}
    assert ["gossip.core.message", "gossip.core.state"] in circles(g)

"""Tests of from_networkx, from_file and to_file."""

import json

import networkx as nx
import numpy as np
import pytest

from topologies import (
    build,
    check_graph,
    from_file,
    from_networkx,
    hierarchical,
    is_doubly_stochastic,
    is_row_stochastic,
    mixing_matrix,
    ring,
    star,
    to_file,
    uniform_weights,
)


def edges(G):
    return {(u, v): w for u, v, w in G.edges(data="weight")}


def write(path, text):
    path.write_text(text)
    return path


# ---- from_networkx --------------------------------------------------------------------


def test_from_networkx_relabels_sorted_and_keeps_label():
    G = nx.Graph([("c", "a"), ("a", "b"), ("b", "c")])
    H = from_networkx(G)
    assert sorted(H) == [0, 1, 2]
    assert [H.nodes[i]["label"] for i in range(3)] == ["a", "b", "c"]
    assert H.has_edge(0, 2) and H.has_edge(2, 0)
    assert is_doubly_stochastic(mixing_matrix(H))
    check_graph(H)


def test_from_networkx_auto_weights():
    sym = from_networkx(nx.path_graph(4))
    assert sym[0][1]["weight"] == 1 / 3  # Metropolis: 1/(1+max(1,2))
    directed = from_networkx(nx.DiGraph([(0, 1), (1, 2), (2, 0), (0, 2)]))
    assert directed[0][2]["weight"] == 1 / 3  # uniform: node 2 hears 0 and 1
    assert directed[2][0]["weight"] == 1 / 2
    assert is_row_stochastic(mixing_matrix(directed))


def test_from_networkx_ignores_distance_weights_unless_given():
    G = nx.Graph()
    G.add_edge(0, 1, weight=7.0)
    assert from_networkx(G)[0][1]["weight"] == 0.5
    G = nx.DiGraph()
    G.add_edge(0, 1, weight=0.25)
    G.add_edge(1, 0, weight=0.75)
    H = from_networkx(G, weights="given")
    assert H[0][1]["weight"] == 0.25 and H[1][1]["weight"] == 0.75  # self takes the rest of the row
    assert H[1][0]["weight"] == 0.75 and H[0][0]["weight"] == 0.25


def test_from_networkx_given_weights_validated():
    G = nx.DiGraph()
    G.add_edge(0, 1, weight=0.5)
    G.add_edge(1, 0, weight=0.5)
    G.add_edge(1, 1, weight=0.7)
    with pytest.raises(ValueError, match="weights into node 1 sum to 1.2"):
        from_networkx(G, weights="given")
    G = nx.DiGraph([(0, 1), (1, 0)])
    with pytest.raises(ValueError, match=r"edge \(0, 1\) has no weight"):
        from_networkx(G, weights="given")


def test_from_networkx_dc_and_link():
    G = nx.Graph([(0, 1), (1, 2), (2, 3)])
    nx.set_node_attributes(G, {0: 0, 1: 0, 2: 1, 3: 1}, "dc")
    H = from_networkx(G)
    assert H[1][2]["link"] == "inter" and H[2][1]["link"] == "inter"
    assert H[0][1]["link"] == "intra" and H[3][3]["link"] == "intra"
    assert build(G, 4).dc(3) == 1


def test_from_networkx_errors():
    with pytest.raises(ValueError, match="multigraph"):
        from_networkx(nx.MultiGraph([(0, 1)]))
    with pytest.raises(ValueError, match="no nodes"):
        from_networkx(nx.Graph())
    with pytest.raises(ValueError, match="weights: unknown choice 'x'; valid: auto, given, metropolis"):
        from_networkx(nx.path_graph(2), weights="x")
    with pytest.raises(ValueError, match="must be a networkx graph"):
        from_networkx([(0, 1)])


def test_from_networkx_does_not_mutate_input():
    G = nx.path_graph(3)
    from_networkx(G)
    assert G.number_of_edges() == 2 and "label" not in G.nodes[0]


# ---- edge lists ------------------------------------------------------------------------


def test_edge_list_undirected_with_comments(tmp_path):
    path = write(tmp_path / "g.txt", "# our cluster\n\n0 1  # first link\n1 2\n2 3\n3 0\n")
    assert edges(from_file(path)) == edges(ring(4))


def test_edge_list_directed(tmp_path):
    path = write(tmp_path / "g.txt", "# directed\n0 1\n1 2\n2 0\n")
    G = from_file(path)
    assert G.has_edge(0, 1) and not G.has_edge(1, 0)
    assert G[0][1]["weight"] == 0.5


def test_edge_list_weights_and_relabel(tmp_path):
    path = write(tmp_path / "g.edges", "# directed\n10 20 0.25\n20 10 0.5\n")
    G = from_file(path)
    assert [G.nodes[i]["label"] for i in G] == [10, 20]
    assert G[0][1]["weight"] == 0.25 and G[1][1]["weight"] == 0.75
    assert G[1][0]["weight"] == 0.5 and G[0][0]["weight"] == 0.5
    G = from_file(path, weights="uniform")  # override ignores the file's weights
    assert G[0][1]["weight"] == 0.5


@pytest.mark.parametrize(
    "text,match",
    [
        ("0 1\n1 2\n0 1 2 3\n", r"g.txt:3: expected 'u v' or 'u v w'"),
        ("0 1\nzero one\n", r"g.txt:2: nodes must be integers"),
        ("0 1 0.5\n1 2\n", r"g.txt:2: edge 1 2 has no weight but line 1 has one"),
        ("0 1\n1 2\n1 0\n", r"g.txt:3: duplicate edge 1 0 \(first on line 1\)"),
        ("0 1 half\n", r"g.txt:1: weight 'half' is not a number"),
        ("0 1 nan\n", r"g.txt:1: weight 'nan' is not finite"),
        ("# only comments\n", r"g.txt: no edges or nodes"),
        ("# directed\n0 1 0.5\n1 0 0.5\n0 0 0.9\n", r"g.txt: .*weights into node 0 sum to 1.4"),
        ("# directed\n0 2 0.7\n1 2 0.7\n2 0 1\n2 1 1\n", r"g.txt: .*node 2 sum to 1 \(self -0.4"),
    ],
)
def test_edge_list_errors_name_file_and_line(tmp_path, text, match):
    path = write(tmp_path / "g.txt", text)
    with pytest.raises(ValueError, match=match):
        from_file(path)


def test_file_spec_disconnected(tmp_path):
    path = write(tmp_path / "split.txt", "0 1\n2 3\n")
    message = r"split.txt.*not strongly connected: 2 components, e.g. nodes \[0, 1\] and \[2, 3\]"
    with pytest.raises(ValueError, match=message):
        build(f"file:{path}", 4)


def test_file_spec_single_node(tmp_path):
    path = write(tmp_path / "one.txt", "0\n")
    t = build(f"file:{path}", 1)
    assert t.in_weights(0) == {0: 1.0}


def test_file_spec_path_with_commas(tmp_path):
    path = write(tmp_path / "a,b.txt", "0 1\n1 2\n2 0\n")
    assert build(f"file:{path}", 3).n == 3
    assert build(f"file:{path},weights=max-degree", 3).in_weights(0)[1] == 1 / 3


# ---- JSON ------------------------------------------------------------------------------


def test_json_short_form(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"directed": False, "edges": [[0, 1], [1, 2], [2, 3], [3, 0]]}))
    assert edges(from_file(path)) == edges(ring(4))
    path.write_text(json.dumps({"directed": True, "edges": [[0, 1, 0.5], [1, 0, 0.5]]}))
    G = from_file(path)
    assert edges(G) == {(0, 1): 0.5, (1, 0): 0.5, (0, 0): 0.5, (1, 1): 0.5}


def test_json_networkx_node_link(tmp_path):
    G = nx.cycle_graph(["a", "b", "c", "d", "e"])
    for key in ("edges", "links"):
        try:
            data = nx.node_link_data(G, edges=key)
        except TypeError:  # networkx < 3.4 names the keyword "link"
            data = nx.node_link_data(G, link=key)
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps(data))
        H = from_file(path)
        assert [H.nodes[i]["label"] for i in range(5)] == ["a", "b", "c", "d", "e"]
        assert edges(H) == edges(ring(5))


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", r"g.json:1: invalid JSON"),
        ("[1, 2]", r"g.json: expected a JSON object"),
        ('{"nodes": []}', r"g.json: JSON object has no 'edges'"),
        ('{"edges": [[0]]}', r"g.json: edges\[0\] must be \[u, v\]"),
        ('{"edges": [[0, 1, "x"]]}', r"g.json: edges\[0\]: weight must be a finite number"),
        ('{"directed": "yes", "edges": [[0, 1]]}', r"g.json: 'directed' must be true or false"),
        ('{"edges": [[0, 1], [2, 3]]}', None),
    ],
)
def test_json_errors(tmp_path, content, match):
    path = tmp_path / "g.json"
    path.write_text(content)
    if match is None:  # parses, but the spec check rejects the disconnected graph
        with pytest.raises(ValueError, match="g.json: graph is not strongly connected"):
            build(f"file:{path}", 4)
    else:
        with pytest.raises(ValueError, match=match):
            from_file(path)


# ---- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".json", ".txt"])
@pytest.mark.parametrize(
    "make",
    [lambda: ring(7), lambda: uniform_weights(star(5)), lambda: hierarchical([3, 4], intra="ring", inter="matched")],
)
def test_round_trip(tmp_path, suffix, make):
    G = make()
    path = tmp_path / f"g{suffix}"
    to_file(G, path)
    H = from_file(path)
    assert edges(H) == edges(G)  # exact: weights are written with full precision
    assert np.array_equal(mixing_matrix(H), mixing_matrix(G))
    if suffix == ".json":
        assert [H.nodes[i]["dc"] for i in H] == [G.nodes[i]["dc"] for i in G]
        assert {(u, v): k for u, v, k in H.edges(data="link")} == {(u, v): k for u, v, k in G.edges(data="link")}


def test_round_trip_through_spec(tmp_path):
    path = tmp_path / "h.json"
    to_file(build("hierarchical:4,4,inter=matched", 8).graph(), path)
    t = build(f"file:{path}", 8)
    assert [t.dc(i) for i in range(8)] == [0] * 4 + [1] * 4
    assert t.link(1, 5) == "inter"

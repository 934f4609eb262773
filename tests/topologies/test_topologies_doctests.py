"""Run the examples in the topologies docstrings, so the documentation stays true."""

import doctest

import pytest

import topologies
from topologies import analysis, builders, convert, spec, topology, weights


@pytest.mark.parametrize("module", [topologies, analysis, builders, convert, spec, topology, weights], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0

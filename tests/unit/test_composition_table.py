"""The composition tables in README.md and docs/architecture.md are what
tools/composition_matrix.py generates from the code now (the flag parser and build_configs
decide each pair), so they cannot drift; each feature alone is accepted (a refused diagonal
would mean the feature's own flags are wrong, not that a pair does not compose)."""
import os

import pytest

from tests.e2e.runner import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tool():
    return load_tool("composition_matrix")


@pytest.fixture(scope="module")
def matrix(tool):
    return tool.cases()


def test_each_feature_alone_is_accepted(tool, matrix):
    refused = {f.name: matrix[f.name, f.name] for f in tool.FEATURES
               if not isinstance(matrix[f.name, f.name], tool.Case)}
    assert not refused, refused


@pytest.mark.parametrize("path", ["README.md", os.path.join("docs", "architecture.md")])
def test_the_table_in_the_file_is_what_the_code_decides(tool, matrix, path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    want = tool.updated(text, tool.render(tool.TARGETS[path], matrix), path)
    assert text == want, f"{path}: run python tools/composition_matrix.py --write"


def test_updating_replaces_the_block_between_the_markers_only(tool, matrix):
    block = tool.render(False, matrix)
    stale = f"intro\n{tool.BEGIN}\nold\n{tool.END}\nrest\n"
    fresh = tool.updated(stale, block, "x.md")
    assert fresh == f"intro\n{tool.BEGIN}\n{block}{tool.END}\nrest\n"
    assert tool.updated(fresh, block, "x.md") == fresh
    with pytest.raises(SystemExit, match="markers"):
        tool.updated("no markers here", block, "x.md")

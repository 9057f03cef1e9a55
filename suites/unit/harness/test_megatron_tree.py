"""`harness.upstream.megatron_tree`: a tree under test is validated, imported once, and every bad one is named."""

from __future__ import annotations

import sys

import pytest

from harness.upstream.megatron_tree import TreeError, tree_env, tree_under_test


def _tree(root, *, config: str = "enable_hyper_connections: bool = False\n", core_init: str = "") -> str:
    (root / "megatron/core/transformer").mkdir(parents=True)
    (root / "megatron/__init__.py").write_text("")
    (root / "megatron/core/__init__.py").write_text(core_init)
    (root / "megatron/core/transformer/__init__.py").write_text("")
    (root / "megatron/core/transformer/hyper_connection.py").write_text("")
    (root / "megatron/core/transformer/transformer_config.py").write_text(config)
    return str(root)


def test_no_tree_named_is_none(monkeypatch):
    """Without a path and without $MHC_MEGATRON_LM there is no tree under test."""
    monkeypatch.delenv("MHC_MEGATRON_LM", raising=False)
    assert tree_under_test() is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: str(p / "missing"), "not a directory"),
        (lambda p: str(p), "not a Megatron-LM tree (no megatron/core/__init__.py under it)"),
        (
            lambda p: _tree(p, config="x = 1\n"),
            "has neither enable_mhc_connections (main) nor enable_hyper_connections",
        ),
    ],
)
def test_bad_path_is_named(tmp_path, make, message):
    """A path that is not a tree, or a tree whose config has neither mHC field, is a TreeError naming it."""
    path = make(tmp_path)
    with pytest.raises(TreeError) as err:
        tree_under_test(path)
    assert path in str(err.value) and message in str(err.value)


def test_tree_that_does_not_import_names_the_error_and_python(tmp_path):
    """A tree whose megatron.core raises on import: the error, the Python used and the extra to install."""
    path = _tree(tmp_path, core_init="import triton_missing_here  # upstream imports triton\n")
    with pytest.raises(TreeError) as err:
        tree_under_test(path)
    text = str(err.value)
    assert path in text and sys.executable in text and "No module named 'triton_missing_here'" in text
    assert "install the tree extra" in text


def test_dev_tree_that_imports_is_taken_with_its_commit(tmp_path, monkeypatch):
    """A tree that imports is a dev or main Tree, its commit from $MHC_MEGATRON_LM_COMMIT when not a checkout."""
    path = _tree(tmp_path)
    monkeypatch.setenv("MHC_MEGATRON_LM", path)
    monkeypatch.setenv("MHC_MEGATRON_LM_COMMIT", "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1")
    tree = tree_under_test()
    assert tree.flavor == "dev" and tree.label == "dev@d48bd6be0a85"
    env = tree_env(tree.path)
    assert env["PYTHONPATH"].split(":")[0] == str(tree.path) and env["TORCHDYNAMO_DISABLE"] == "1"

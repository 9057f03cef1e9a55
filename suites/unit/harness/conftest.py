"""Shared fixtures of the harness self-tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# pytester's in-process runs must find numpy already imported (it cannot be loaded twice).
import harness.golden.case_check  # noqa: F401

DATA = Path(__file__).parent / "data"


def _tree(root: Path) -> dict[str, bytes]:
    root = Path(root)
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def tree():
    """`tree(root)`: every file under root (relative path -> bytes), to prove nothing was written."""
    return _tree


@pytest.fixture
def data_dir() -> Path:
    """The directory of the test data files."""
    return DATA


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for child Python processes: this interpreter's path, no hardware override."""
    env = dict(os.environ)
    env.pop("MHC_HW", None)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3]), env.get("PYTHONPATH", "")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.fixture
def python() -> str:
    """The interpreter running the tests."""
    return sys.executable


DEMO_SUITE = """
import os

import pytest

from harness import ExactCheck, TimingCheck


def _loss():
    if os.environ.get("DEMO_FAIL"):
        raise RuntimeError("training crashed")
    loss = [10.0 - 0.05 * i for i in range(50)]
    loss[7] *= float(os.environ.get("DEMO_SCALE", "1.0"))
    return loss


@pytest.mark.golden_case("tiny_mhc")
def test_tiny_mhc(golden_metrics):
    golden_metrics.check("tiny_mhc", {"lm loss": _loss(), "iteration-time": [0.5] * 50},
                         {"lm loss": ExactCheck(), "iteration-time": TimingCheck(rel_band_slow=0.5)})


@pytest.mark.golden_case("tiny")
def test_tiny(golden_metrics):
    golden_metrics.check("tiny", {"lm loss": [10.0 - 0.04 * i for i in range(50)]}, {"lm loss": ExactCheck()})


def test_plain():
    assert True
"""
"""A tiny suite: cases tiny_mhc (perturbed by $DEMO_SCALE, crashing with $DEMO_FAIL) and tiny."""

QUIET_PLUGINS = (
    "-p",
    "no:hypothesispytest",
    "-p",
    "no:benchmark",
    "-p",
    "no:xdist",
    "-p",
    "no:cacheprovider",
)
"""Plugins the demo runs do not need (hypothesis alone costs seconds per in-process run)."""


@pytest.fixture
def demo(pytester):
    """A pytester tree: an ini file at its root and suites/demo/test_demo.py (DEMO_SUITE)."""
    pytester.makeini("[pytest]\n")
    d = pytester.mkdir("suites") / "demo"
    d.mkdir()
    (d / "test_demo.py").write_text(DEMO_SUITE, encoding="utf-8")
    return pytester


@pytest.fixture
def run_inline():
    """`run_inline(pytester, *args)`: pytester.runpytest in process without unneeded plugins."""
    return lambda pytester, *args: pytester.runpytest(*QUIET_PLUGINS, *args)

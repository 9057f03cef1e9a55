"""The math library installs alone: mhc-core's wheel holds mhc_core and nothing else, depends on torch only,
and gives a working HyperConnectionModule in a fresh venv without pytest, the harness or megatron-core."""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.slow


_SKIP = shutil.ignore_patterns("__pycache__", "build", "*.egg-info", ".*", "*.so")
"""What a build must not take from the checkout: caches, build folders, extensions an editable install built."""


def _wheel(files: dict[str, Path], out: Path) -> Path:
    """The wheel of a project made of `files` (name in the project -> file or folder of this checkout), built
    in a copy under `out` (the checkout gets no build/ folder) with this env's setuptools (no download: no
    build isolation)."""
    project = out / "project"
    project.mkdir()
    for name, src in files.items():
        if src.is_dir():
            shutil.copytree(src, project / name, ignore=_SKIP)
        else:
            shutil.copy2(src, project / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            str(project),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


CORE = {
    "pyproject.toml": ROOT / "pyproject.toml",
    "setup.py": ROOT / "setup.py",
    "README.md": ROOT / "README.md",
    "mhc_core": ROOT / "mhc_core",
}
"""mhc-core's project: the root pyproject.toml, setup.py (its C extension) and the mhc_core package."""


@pytest.fixture(scope="module")
def core_wheel(tmp_path_factory) -> Path:
    return _wheel(CORE, tmp_path_factory.mktemp("core-wheel"))


def _metadata(wheel: Path) -> tuple[list[str], str]:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    return names, meta


def test_the_core_wheel_holds_mhc_core_and_depends_on_torch_only(core_wheel):
    """mhc-core's wheel: only the mhc_core package (its shipped tunings, and on Linux with a C compiler the native
    pre-op forward), no harness, no entry points (no pytest plugin, no CLI); its only unconditional
    requirement is torch, megatron-core and cuTile are extras."""
    names, meta = _metadata(core_wheel)
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"mhc_core"}, tops
    assert "mhc_core/kernels/cutile/tuned/nvidia_h200.json" in names
    if sys.platform.startswith("linux") and shutil.which(
        "cc"
    ):  # the optional extension builds where a compiler is
        assert any(n.startswith("mhc_core/kernels/native/_pre.") and n.endswith(".so") for n in names), names
    assert not any(n.endswith("entry_points.txt") for n in names)
    required = [
        line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")
    ]
    plain = [r for r in required if "extra ==" not in r]
    assert plain == ["torch>=2.6"], required
    assert any(r.startswith("megatron-core") and 'extra == "megatron"' in r for r in required), required


def test_the_harness_wheel_carries_the_cli_the_plugin_and_the_recordings(tmp_path):
    """mhc-harness's wheel: the harness package with its recordings, the functional recipes and corpus, the CLI
    and the pytest plugin; it depends on mhc-core."""
    harness = {
        p.name: p
        for p in (ROOT / "harness").iterdir()
        if p.name not in ("__pycache__", "build") and not p.name.endswith(".egg-info")
    }
    names, meta = _metadata(_wheel(harness, tmp_path))
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"harness"}, tops
    assert "harness/conformance/recorded/te_triton.json" in names and "harness/peers/base.py" in names
    assert (
        "harness/training/recipes/gpt_tp1_pp1_mhc.yaml" in names
        and "harness/training/corpus/declaration.txt" in names
    )
    assert "Requires-Dist: mhc-core==0.1.0" in meta
    with zipfile.ZipFile(next(tmp_path.glob("*.whl"))) as z:
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "mhc-harness = harness.cli:main" in entry_points and "harness.pytest_plugin" in entry_points


def _top_levels(dist: md.Distribution) -> set[str]:
    tops = set()
    for f in dist.files or ():
        first = f.parts[0]
        if (
            first.endswith((".dist-info", ".data"))
            or first in ("..", "__pycache__")
            or first.endswith(".pth")
        ):
            continue
        tops.add(first)
    return tops


def _torch_closure() -> set[str]:
    """torch and the distributions it requires unconditionally, transitively (what `pip install torch`
    installs)."""
    seen, todo = set(), ["torch"]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        for req in md.requires(name) or ():
            if ";" in req:
                continue  # extras and platform markers (the CUDA libraries are not in the CPU wheel's list)
            todo.append(re.split(r"[\s<>=!~\[(]", req, maxsplit=1)[0])
    return seen


def test_mhc_core_alone_runs_in_a_fresh_venv(core_wheel, tmp_path):
    """Installed alone (its wheel, --no-deps) into a fresh venv that sees only torch and torch's own
    requirements, mhc_core's HyperConnectionModule runs forward and backward, and pytest, the harness and
    megatron-core are not importable there."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(core_wheel)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    site = Path(md.distribution("torch").locate_file(""))
    shared = tmp_path / "torch-only"
    shared.mkdir()
    for name in _torch_closure():
        for top in _top_levels(md.distribution(name)):
            if (site / top).exists() and not (shared / top).exists():
                (shared / top).symlink_to(site / top)
    (venv_site,) = (venv / "lib").glob("python3*/site-packages")
    (venv_site / "torch_only.pth").write_text(f"{shared}\n")
    code = """
import importlib.util, torch
from mhc_core import HyperConnectionConfig, HyperConnectionModule, contract, expand
for absent in ("pytest", "harness", "megatron"):
    assert importlib.util.find_spec(absent) is None, absent
hc = HyperConnectionModule(HyperConnectionConfig(hidden_size=8, num_residual_streams=4, variant="megatron_dev"))
x = expand(torch.randn(5, 2, 8), 4).requires_grad_(True)
aggregated, h_res, h_post, residual = hc(x)
out = hc.post_residual_bda(h_res, residual, h_post, (torch.tanh(aggregated), None), dropout_p=0.0)
contract(out, 4).sum().backward()
assert aggregated.shape == (5, 2, 8) and out.shape == (5, 2, 32) and torch.isfinite(x.grad).all()
from mhc_core.kernels import native
print("ok", torch.__version__, native.available())
"""
    run = subprocess.run(
        [str(python), "-I", "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-3000:]

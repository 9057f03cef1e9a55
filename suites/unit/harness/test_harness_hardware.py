"""Hardware keys: GPU-name mapping, CPU keys, overrides, validation and `mhc-harness hw`."""

from __future__ import annotations

import platform

import pytest

from harness.cli import main
from harness.golden.errors import UnknownHardwareError
from harness.golden.hardware import detect_hardware, key_for_gpus, require_known, validate_hw_key

H100 = "NVIDIA H100 80GB HBM3"


def _gpus(*names: str):
    return lambda: (list(names), "test probe")


class TestKeyForGpus:
    @pytest.mark.parametrize(
        ("name", "count", "key"),
        [
            pytest.param(H100, 8, "dgx_h100", id="H100x8-dgx_h100"),
            pytest.param(H100, 1, "h100", id="H100x1-h100"),
            pytest.param("NVIDIA H200", 1, "h200", id="H200x1-h200"),
            pytest.param("NVIDIA H200", 8, "h200", id="H200x8-h200"),
            pytest.param("NVIDIA A100-SXM4-80GB", 8, "dgx_a100", id="A100x8-dgx_a100"),
            pytest.param("NVIDIA A100-SXM4-80GB", 2, "a100", id="A100x2-a100"),
            pytest.param("NVIDIA GB200", 4, "dgx_gb200", id="GB200x4-dgx_gb200"),
        ],
    )
    def test_known_platforms(self, name, count, key):
        """Megatron platform names come from the GPU name and count."""
        assert key == key_for_gpus(name, count)[0]

    def test_gh200_is_not_h200(self):
        """A GH200 does not match the H200 rule."""
        assert "gpu_gh200_480gb_x1" == key_for_gpus("NVIDIA GH200 480GB", 1)[0]

    def test_unknown_gpu_sanitized(self):
        """An unknown GPU gets gpu_<name>_x<count>, lowercase and path-safe."""
        key, rule = key_for_gpus("NVIDIA GeForce RTX 4090", 2)
        assert "gpu_geforce_rtx_4090_x2" == key
        assert "unknown key" in rule


class TestDetect:
    def test_cpu_here(self):
        """Without GPUs the key is cpu_<arch> of this machine."""
        hw = detect_hardware(env={}, probe=_gpus())
        assert f"cpu_{platform.machine().lower()}" == hw.key
        assert "cpu" == hw.source

    def test_gpu_probe(self):
        """Eight H100 names from the probe give dgx_h100 and the rule names the match."""
        hw = detect_hardware(env={}, probe=_gpus(*[H100] * 8))
        assert "dgx_h100" == hw.key
        assert "x8" in hw.rule and "test probe" in hw.rule

    def test_env_overrides_detection(self):
        """MHC_HW wins over detection."""
        hw = detect_hardware(env={"MHC_HW": "h200"}, probe=_gpus(H100))
        assert ("h200", "env") == (hw.key, hw.source)

    def test_option_overrides_env(self):
        """--hw wins over MHC_HW."""
        assert "dgx_a100" == detect_hardware(override="dgx_a100", env={"MHC_HW": "h200"}).key

    def test_bad_override_names_field(self):
        """A key with a path separator is refused, naming the option."""
        with pytest.raises(ValueError, match=r"--hw='\.\./x'"):
            detect_hardware(override="../x")

    def test_validate_rejects_uppercase(self):
        """Keys are lowercase."""
        with pytest.raises(ValueError, match="not a valid hardware key"):
            validate_hw_key("DGX_H100")

    def test_require_known(self):
        """An unknown key is refused unless allowed."""
        with pytest.raises(UnknownHardwareError, match="--allow-unknown-hw"):
            require_known("gpu_foo_x1")
        assert "gpu_foo_x1" == require_known("gpu_foo_x1", allow_unknown=True)


class TestHwCommand:
    def test_prints_key_and_rule(self, capsys, monkeypatch):
        """`mhc-harness hw` prints the detected key, the rule and whether it is known."""
        monkeypatch.delenv("MHC_HW", raising=False)
        assert 0 == main(["hw"])
        out = capsys.readouterr().out.splitlines()
        hw = detect_hardware()
        assert hw.key == out[0]
        assert out[1].startswith("rule: ")
        assert out[2] == ("known: yes" if hw.known else "known: no (recalibration needs --allow-unknown-hw)")

    def test_env_override(self, capsys, monkeypatch):
        """With MHC_HW set, `hw` prints that key and says the environment chose it."""
        monkeypatch.setenv("MHC_HW", "dgx_h100")
        assert 0 == main(["hw"])
        out = capsys.readouterr().out
        assert out.startswith("dgx_h100\n")
        assert "environment variable MHC_HW" in out and "known: yes" in out


def test_an_empty_hw_option_is_refused_not_detected(capsys):
    """`--hw ""` (an unset shell variable, say) is an invalid key, not a silent fallback to detection."""
    assert 2 == main(["hw", "--hw", ""])
    assert "--hw='' is not a valid hardware key" in capsys.readouterr().err

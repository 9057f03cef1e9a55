"""The numerics fingerprint: what it records, what moves its id, and its JSON."""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.golden.errors import GoldenFormatError
from harness.golden.fingerprint import NumericsFingerprint, current_fingerprint, fingerprint_from_json

AMD = NumericsFingerprint(
    device="cpu",
    cpu_vendor="AuthenticAMD",
    cpu_model="AMD EPYC 7B13 25/1/0",
    cpu_isa=("avx2", "fma"),
    cpu_capability="AVX2",
    blas="MKL 2024.2",
    onednn="3.12.0",
    pins={"ATEN_CPU_CAPABILITY": "avx2"},
    threads=1,
    torch="2.13.0+cpu",
    megatron_core="0.16.1",
)


class TestFingerprint:
    def test_this_process(self):
        """This process's fingerprint names its CPU, torch's ISA path, BLAS, oneDNN, threads and versions."""
        torch = pytest.importorskip("torch")
        fp = current_fingerprint()
        assert fp.device == ("cuda" if torch.cuda.is_available() else "cpu")
        assert fp.cpu_capability == torch.backends.cpu.get_cpu_capability()
        assert fp.threads == torch.get_num_threads()
        assert fp.torch == torch.__version__
        assert fp.cpu_vendor and fp.cpu_model
        assert fp.label.startswith(f"{fp.id} (") and f"ATen {fp.cpu_capability}" in fp.label

    def test_pins_in_force_move_the_id(self):
        """An ISA pin or a thread count in the environment is recorded and gives another id."""
        a = current_fingerprint(env={})
        b = current_fingerprint(env={"MKL_CBWR": "AVX2", "PATH": "/bin"})
        assert a.pins == {} and b.pins == {"MKL_CBWR": "AVX2"}
        assert a.id != b.id and b.differences(a) == ["pins: {'MKL_CBWR': 'AVX2'} -> {}"]

    def test_id_is_stable_and_order_free(self):
        """The id digests every field; the order of ISA flags or pins does not matter."""
        same = NumericsFingerprint(**{**AMD.to_json(), "cpu_isa": ("fma", "avx2")})
        assert same.id == AMD.id and len(AMD.id) == 12
        other = NumericsFingerprint(**{**AMD.to_json(), "cpu_isa": tuple(AMD.cpu_isa), "onednn": "3.13.0"})
        assert other.id != AMD.id and AMD.differences(other) == ["onednn: '3.12.0' -> '3.13.0'"]

    def test_json_round_trip(self):
        """to_json / fingerprint_from_json round-trip to the same id."""
        assert fingerprint_from_json(AMD.to_json(), source="x").id == AMD.id

    def test_bad_json_is_named(self):
        """Unknown keys, a non-object or a bad device are errors naming the source."""
        with pytest.raises(
            GoldenFormatError, match=r"meta\.json: unknown numerics fingerprint key\(s\) \['cpu'\]"
        ):
            fingerprint_from_json({**AMD.to_json(), "cpu": 1}, source="meta.json")
        with pytest.raises(
            GoldenFormatError, match="meta.json: a numerics fingerprint is a JSON object, got list"
        ):
            fingerprint_from_json([], source="meta.json")
        with pytest.raises(GoldenFormatError, match="device='tpu' must be 'cpu' or 'cuda'"):
            fingerprint_from_json({**AMD.to_json(), "device": "tpu"}, source="meta.json")

    def test_hw_prints_the_fingerprint_beside_the_key(self, capsys, monkeypatch):
        """mhc-harness hw prints the key, then this machine's numerics fingerprint field by field."""
        monkeypatch.setenv("MHC_HW", "cpu_x86_64")
        assert 0 == main(["hw"])
        out = capsys.readouterr().out
        assert out.startswith("cpu_x86_64\n")
        assert f"numerics fingerprint: {current_fingerprint().label}" in out
        assert "  cpu_vendor: " in out and "  torch: " in out

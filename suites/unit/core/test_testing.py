"""`mhc_core.testing`: the comparisons every parity test relies on fail when they should, with numbers."""

from __future__ import annotations

import pytest
import torch

from mhc_core.testing import Tolerance, assert_close, assert_cosine, cosine_similarity, tolerance

FP32 = tolerance(torch.float32, "fwd")


def test_within_tolerance_passes():
    """Values within atol + rtol * |expected| pass, elementwise."""
    e = torch.tensor([1.0, -2.0, 0.0])
    assert_close("x", e + torch.tensor([0.9e-5, -1.9e-5, 0.9e-5]), e, Tolerance(atol=1e-5, rtol=1e-5))


def test_out_of_tolerance_prints_errors_and_the_first_element():
    """One element over the bound fails, naming the count, the max errors and the first bad index."""
    e = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a = e.clone()
    a[1, 0] = 3.1
    with pytest.raises(
        AssertionError,
        match=r"x: 1/4 elements out of tolerance .* max abs err 1\.000e-01.*"
        r"first at \(1, 0\): actual 3\.0999999, expected 3; shape \[2, 2\]",
    ):
        assert_close("x", a, e, FP32)


@pytest.mark.parametrize("where", ["actual", "expected"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_on_either_side_fails(where, bad):
    """A NaN or infinity in the actual or in the expected (reference) tensor fails, naming the side."""
    good, broken = torch.tensor([1.0, 2.0]), torch.tensor([bad, 2.0])
    a, e = (broken, good) if where == "actual" else (good, broken)
    with pytest.raises(AssertionError, match=rf"1 non-finite value\(s\) in {where}, first at \(0,\)"):
        assert_close("x", a, e, FP32)


def test_shape_mismatch_fails():
    """Different shapes fail before any value is compared."""
    with pytest.raises(AssertionError, match=r"shape \[2\] != expected \[3\]"):
        assert_close("x", torch.zeros(2), torch.zeros(3), FP32)


def test_cosine_similarity_and_its_bound():
    """Parallel vectors have similarity 1, orthogonal 0; below the minimum fails printing the value."""
    v = torch.tensor([1.0, 2.0, 3.0])
    assert cosine_similarity(2 * v, v) == pytest.approx(1.0)
    assert cosine_similarity(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == 0.0
    with pytest.raises(AssertionError, match=r"cosine similarity 0\.000000 < 0\.999"):
        assert_cosine("g", torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    with pytest.raises(AssertionError, match="cosine similarity nan"):
        assert_cosine("g", torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0]))


def test_tolerance_table_and_bad_values():
    """bf16 uses upstream's 2e-2 / 5e-2; an unknown dtype and a negative tolerance are ValueErrors."""
    assert (tolerance(torch.bfloat16, "fwd").rtol, tolerance(torch.bfloat16, "bwd").rtol) == (2e-2, 5e-2)
    assert tolerance(torch.bfloat16, "proj") == tolerance(torch.bfloat16, "fwd")
    with pytest.raises(ValueError, match="dtype=torch.int32"):
        tolerance(torch.int32)
    with pytest.raises(ValueError, match=r"Tolerance.atol=-1"):
        Tolerance(atol=-1, rtol=0)

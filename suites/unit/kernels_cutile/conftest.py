"""Fixtures shared by the cuTile test modules."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.fixture
def poisoned_empty():
    """`torch.empty` outputs start as NaN (CPU), so a tile a kernel never writes fails the comparison
    instead of passing on a stale, correct block the allocator handed back."""
    det: Any = (
        torch.utils.deterministic
    )  # the flag is a property of the module's class, unseen by torch's stubs
    was_on, was_fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on)
        det.fill_uninitialized_memory = was_fill

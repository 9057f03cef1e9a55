"""The retention check: what a training step leaves alive is owned, known from the first step, or named."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from harness.training.retention import (
    BY_DESIGN,
    UNATTRIBUTED_INTEGERS,
    RetentionCheck,
    RetentionError,
    RetentionReport,
    owned_storages,
    plant_retention,
    where_held,
)


class _Net(nn.Module):
    """`[T, 8] -> [T, 8]`: two linear layers and a registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))) * self.scale


def _train(net: nn.Module, check: RetentionCheck, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    torch.manual_seed(0)
    for step in range(1, steps + 1):
        opt.zero_grad()
        net(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        check.after_step(step)


def _setup() -> tuple[_Net, torch.optim.Optimizer, RetentionCheck]:
    net = _Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    return net, opt, RetentionCheck([net], opt)


def test_a_plain_training_loop_retains_nothing():
    """Parameters, gradients, Adam's state and buffers are owned: no finding over three steps."""
    net, opt, check = _setup()
    _train(net, check, opt)
    assert check.findings == [], [f.line() for f in check.findings]
    check.raise_if_retained()


def test_the_optimizer_state_and_gradients_are_owned():
    """Every gradient and every Adam moment's storage is in `owned_storages`, and so is every buffer."""
    net, opt, check = _setup()
    _train(net, check, opt, steps=1)
    owned = owned_storages([net], opt)
    tensors = [p.grad for p in net.parameters()] + [net.scale]
    tensors += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    assert all(t.untyped_storage().data_ptr() in owned for t in tensors)


def test_a_module_attribute_that_keeps_an_activation_is_named_with_its_bytes():
    """A forward hook that keeps the output on the module: the error names `first._planted_activation`,
    its shape and its bytes (4 x 16 fp32 = 256)."""
    net, opt, check = _setup()
    plant_retention(net, "first")
    _train(net, check, opt)
    with pytest.raises(RetentionError) as err:
        check.raise_if_retained()
    message = str(err.value)
    assert "first._planted_activation [4x16] float32, 256 bytes" in message, message
    assert {f.where for f in check.errors()} == {"first._planted_activation"}


class _Cache:
    kept: list[torch.Tensor] = []


def test_a_tensor_kept_in_a_class_attribute_is_named_by_the_class():
    """A step's tensor appended to a class-level list: named `<module>._Cache.kept[i]`, one per checked step."""
    net, opt, check = _setup()
    _Cache.kept.clear()
    hook = net.second.register_forward_hook(lambda m, a, out: _Cache.kept.append(out.detach()))
    try:
        _train(net, check, opt)
    finally:
        hook.remove()
    wheres = [f.where for f in check.errors()]
    _Cache.kept.clear()
    assert wheres and all(w.startswith(f"{__name__}._Cache.kept[") for w in wheres), wheres
    assert [f.step for f in check.errors()] == [2, 3]


def test_checks_limit_the_scans_and_the_first_step_is_the_inventory():
    """With `checks={3}` the planted activation of step 2 is not looked at; the first step's is inventory."""
    net = _Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    check = RetentionCheck([net], opt, checks={3})
    plant_retention(net, "second")
    _train(net, check, opt)
    assert [f.step for f in check.errors()] == [3]
    assert any(r.where == "second._planted_activation" for r in check.inventory)


def test_megatron_core_holders_are_reported_not_errors():
    """`decoder.input_tensor` (and its gradient) and a token dispatcher's attributes match `BY_DESIGN`; a
    holder of ours does not."""
    import re

    def why(where: str) -> str | None:
        return next((w for p, w in BY_DESIGN.items() if re.search(p, where)), None)

    assert why("module.decoder.input_tensor") and why("module.decoder.input_tensor.grad")
    assert why("module.decoder.layers.1.mlp.token_dispatcher.probs")
    assert why("module.decoder.layers.0.mlp_hyper_connection._planted_activation") is None
    assert why("module.decoder.input_tensor_copy") is None


def test_a_tensor_held_only_from_cpp_says_so():
    """No Python referrer but the caller's own containers: 'held outside Python'."""
    t = torch.zeros(3)
    live = [t]
    assert where_held(t, {}, ignore=(live,)).startswith("held outside Python")


def test_the_report_is_written_atomically_and_reads_back(tmp_path):
    """`write` leaves one JSON file (no temporary) with the inventory and the findings."""
    net, opt, check = _setup()
    plant_retention(net, "first")
    _train(net, check, opt)
    out = tmp_path / "retention-rank0.json"
    check.write(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["retention-rank0.json"]
    doc = json.loads(out.read_text())
    report = RetentionReport.from_json(doc, source=str(out))
    assert [f.where for f in report.errors()] == ["first._planted_activation"] * 2
    assert report.inventory_bytes == sum(r["bytes"] for r in doc["inventory"])


def test_a_malformed_report_is_an_error_naming_the_file():
    """A report without its fields: `ValueError` naming the source and the missing field."""
    with pytest.raises(ValueError, match=r"run/retention-rank1.json: .*findings"):
        RetentionReport.from_json({"inventory": []}, source="run/retention-rank1.json")


def test_an_integer_tensor_only_cpp_holds_is_reported_a_float_one_is_an_error():
    """Held outside Python: an integer tensor (counts, indices) is reported as unattributed, a float one is an
    error (an activation is never integer)."""
    net, opt, check = _setup()
    live = [torch.zeros(2, dtype=torch.int64), torch.zeros(2)]
    counts = check._describe(live[0], 2, {}, search=(live,))
    floats = check._describe(live[1], 2, {}, search=(live,))
    assert counts.where.startswith("held outside Python") and counts.by_design == UNATTRIBUTED_INTEGERS
    assert floats.where.startswith("held outside Python") and floats.by_design is None


def test_an_optimizer_that_holds_the_model_does_not_own_its_activations():
    """megatron-core's chained optimizer keeps `model_chunks`: a module attribute's activation is still a finding."""
    from types import SimpleNamespace

    net = _Net()
    adam = torch.optim.Adam(net.parameters(), lr=1e-3)
    check = RetentionCheck([net], SimpleNamespace(optimizer=adam, model_chunks=[net]))
    plant_retention(net, "first")
    _train(net, check, adam)
    assert {f.where for f in check.errors()} == {"first._planted_activation"}

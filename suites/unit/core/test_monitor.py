"""The stability monitor on a stack of HyperConnectionModules: gains, sums, orientation, alarms, cost."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mhc_core import HyperConnectionConfig, HyperConnectionModule
from mhc_core.monitor import MonitorConfig, StabilityAlarm, StabilityMonitor, log_report
from mhc_core.ops import expand

C, N, LAYERS = 16, 4, 3


class Stack(nn.Module):
    """LAYERS x (attention-like, MLP-like) sublayers, each `x -> mix(x, tanh(aggregate(x)))`."""

    def __init__(self, **cfg):
        super().__init__()
        config = HyperConnectionConfig(hidden_size=C, num_residual_streams=N, **cfg)
        self.hcs = nn.ModuleList(HyperConnectionModule(config) for _ in range(2 * LAYERS))

    def forward(self, x):
        for hc in self.hcs:
            agg, h_res, h_post, residual = hc(x)
            x = hc.post_residual_bda(h_res, residual, h_post, (torch.tanh(agg), None))
        return x


def _stack(seed=0, alpha=0.3, bias=0.3, **cfg):
    torch.manual_seed(seed)
    model = Stack(**cfg)
    with torch.no_grad():
        for hc in model.hcs:
            for a in (hc.alpha_pre, hc.alpha_post, hc.alpha_res):
                a.fill_(alpha)
            hc.bias.normal_(0, bias)
    return model


def _run(model, monitor, step=10):
    x = expand(torch.randn(8, 2, C), N)
    with monitor.sampling(step):
        model(x).sum().backward()
    return monitor.report(step)


@pytest.mark.parametrize("variant", ["paper", "megatron_main", "megatron_dev"])
def test_mhc_stays_bounded(variant):
    """Through 6 sublayers of doubly stochastic H_res the composite gain stays 1 (to the Sinkhorn's
    convergence after 20 iterations), the sums stay at 1, and every sublayer applies the matrix its
    variant says."""
    model = _stack(variant=variant)
    rep = _run(model, StabilityMonitor(model, MonitorConfig(every=5)))
    assert rep.sublayers == 2 * LAYERS and rep.tokens == 16
    assert abs(rep.forward_gain - 1) < 1e-4 and abs(rep.backward_gain - 1) < 1e-4, rep
    assert rep.sum_deviation < 1e-4 and rep.orientation_error < 1e-6, rep
    assert rep.seconds > 0 and set(rep.metrics()) >= {
        "mhc-amax-gain-fwd",
        "mhc-amax-gain-bwd",
        "mhc-sum-dev-max",
    }


def test_unconstrained_hyper_connections_grow():
    """Without Sinkhorn (H_res = I + logits) the same stack's composite gain grows far past mHC's 1."""
    model = _stack(h_res_constraint="none", alpha=0.5, bias=1.0)
    with pytest.warns(RuntimeWarning, match="forward composite Amax gain"):
        rep = _run(model, StabilityMonitor(model, MonitorConfig(every=1)))
    assert rep.forward_gain > 3 and rep.worst_layer_gain > 1.5, rep
    assert rep.sum_deviation == 0.0  # no constraint to check the sums of


def test_no_hooks_and_no_report_off_the_sampled_steps():
    """On a step it does not sample the monitor registers nothing and reports None."""
    model = _stack()
    monitor = StabilityMonitor(model, MonitorConfig(every=10))
    with monitor.sampling(7):
        assert all(not hc._forward_hooks for hc in model.hcs)
        model(expand(torch.randn(4, 1, C), N))
    assert monitor.report(7) is None
    with pytest.raises(RuntimeError, match=r"no forward of hcs.0, hcs.1, hcs.2 \.\.\. was sampled"):
        monitor.report(10)


def test_one_sinkhorn_iteration_at_large_logits_trips_the_alarm():
    """A Sinkhorn that stops converging (1 iteration, logits x 30): its row sums leave 1, the alarm warns
    once naming step and value, and raises when asked to."""
    model = _stack(alpha=30.0, sinkhorn_iterations=1, variant="megatron_main")
    with pytest.warns(RuntimeWarning, match=r"mHC stability alarm at step 10: row / column sum deviation"):
        rep = _run(model, StabilityMonitor(model, MonitorConfig(every=10)))
    assert rep.sum_deviation > 1e-2
    monitor = StabilityMonitor(model, MonitorConfig(every=10, on_alarm="raise"))
    with pytest.raises(StabilityAlarm, match="row / column sum deviation from 1"):
        _run(model, monitor)


def test_a_transposed_mix_trips_the_alarm(monkeypatch):
    """A kernel that applies H_res transposed (the bug upstream fixed twice) shows as an orientation error
    in the probe of what the module really applies, though the gain stays 1."""
    model = _stack(variant="megatron_main")
    from dataclasses import replace

    from mhc_core.ops.contract import ReferenceBackend
    from mhc_core.ops.post_bda import h_post_bda_reference
    from mhc_core.variants import get_variant

    class Transposing(ReferenceBackend):  # a faulty backend: the reference with a transposing h_post_bda
        def h_post_bda(self, call):
            return h_post_bda_reference(replace(call, spec=get_variant("megatron_dev")))

    for hc in model.hcs:
        monkeypatch.setattr(hc, "_backend", Transposing())
    monitor = StabilityMonitor(model, MonitorConfig(every=10, on_alarm="raise"))
    with pytest.raises(StabilityAlarm, match="orientation error .* a transposed mix"):
        _run(model, monitor)


def test_alarm_warns_once_per_kind():
    """Repeated violations warn once per kind, not every step."""
    model = _stack(h_res_constraint="none", alpha=0.5, bias=1.0)
    monitor = StabilityMonitor(model, MonitorConfig(every=1, max_backward_gain=None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            _run(model, monitor, step)
    assert sum("forward composite Amax gain" in str(w.message) for w in caught) == 1


def test_log_report_uses_the_writers_interfaces():
    """`log_report` writes mhc/<metric> scalars at the report's step through add_scalar and wandb.log."""
    model = _stack()
    rep = _run(model, StabilityMonitor(model, MonitorConfig(every=10)))

    class Board:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    class Run:
        def log(self, values, step):
            self.logged = (values, step)

    board, run = Board(), Run()
    log_report(rep, tensorboard=board, wandb=run)
    assert ("mhc/mhc-amax-gain-fwd", rep.forward_gain, 10) in board.scalars
    assert run.logged[1] == 10 and run.logged[0]["mhc/mhc-sum-dev-max"] == rep.sum_deviation


def test_bad_config_is_named():
    with pytest.raises(ValueError, match=r"MonitorConfig.every=0 must be an integer >= 1"):
        MonitorConfig(every=0)
    with pytest.raises(ValueError, match=r"MonitorConfig.on_alarm='log'"):
        MonitorConfig(on_alarm="log")
    with pytest.raises(ValueError, match=r"HyperConnectionConfig.h_res_constraint='soft'"):
        HyperConnectionConfig(hidden_size=4, h_res_constraint="soft")


def test_model_chunks_compose_in_order():
    """A stack given as two chunks (virtual pipeline stages on one rank) composes chunk 0 then chunk 1:
    the same gains as the whole stack; swapping the chunks gives another product."""
    model = _stack(h_res_constraint="none", alpha=0.5, bias=1.0)
    first, second = nn.ModuleList(model.hcs[:3]), nn.ModuleList(model.hcs[3:])
    cfg = MonitorConfig(every=1, max_forward_gain=None, max_backward_gain=None)
    x = expand(torch.randn(8, 2, C), N)
    reports = []
    for target in (model, [first, second], [second, first]):
        monitor = StabilityMonitor(target, cfg)
        with monitor.sampling(1):
            model(x)
        reports.append(monitor.report(1))
    whole, chunks, swapped = reports
    assert chunks.forward_gain == pytest.approx(whole.forward_gain, rel=1e-12) and chunks.sublayers == 6
    assert swapped.forward_gain != pytest.approx(whole.forward_gain, rel=1e-6)


class HyperConnectionModule_(nn.Module):  # noqa: N801 - renamed below: a tree's class is called HyperConnectionModule
    """A Megatron-LM tree's hyper connection as the monitor sees one: `n`, `hidden_size`, a forward returning
    `(aggregated, h_res, h_post, residual)` and dev's `fused_h_res_h_post_bda` (H_res^T applied), here over one
    of ours in dev's numerics."""

    def __init__(self, inner: HyperConnectionModule):
        super().__init__()
        object.__setattr__(
            self, "inner", inner
        )  # not a submodule: the monitor must see the tree's class only
        self.mapping_weight = inner.mapping_proj.weight  # the device and dtype the probe reads
        self.n, self.hidden_size = inner.n, inner.hidden_size

    def forward(self, x):
        return self.inner(x)

    def fused_h_res_h_post_bda(self, h_res, residual, h_post, out_with_bias, dropout_prob, training, fused):
        return self.inner.post_residual_bda(
            h_res, residual, h_post, out_with_bias, dropout_p=dropout_prob, training=training
        )


HyperConnectionModule_.__name__ = "HyperConnectionModule"


class TreeStack(nn.Module):
    """`Stack` through a tree's API: each update is the module's `fused_h_res_h_post_bda`."""

    def __init__(self, hcs):
        super().__init__()
        self.hcs = nn.ModuleList(HyperConnectionModule_(hc) for hc in hcs)

    def forward(self, x):
        for hc in self.hcs:
            agg, h_res, h_post, residual = hc(x)
            x = hc.fused_h_res_h_post_bda(h_res, residual, h_post, (torch.tanh(agg), None), 0.0, True, False)
        return x


def test_a_trees_hyper_connections_are_read_too():
    """A tree's modules (found by what they have) are sampled and probed through their own update: the same gains
    as our modules they wrap, and no orientation error claimed for them."""
    ours = _stack(variant="megatron_dev")
    tree = TreeStack(ours.hcs)
    mon_tree = StabilityMonitor(tree, MonitorConfig(every=5))
    assert len(mon_tree.modules) == 2 * LAYERS and all(
        isinstance(m, HyperConnectionModule_) for _, m in mon_tree.modules
    )
    torch.manual_seed(3)
    rep_tree = _run(tree, mon_tree)
    torch.manual_seed(3)
    rep_ours = _run(ours, StabilityMonitor(ours, MonitorConfig(every=5)))
    assert rep_tree.sublayers == rep_ours.sublayers == 2 * LAYERS
    assert rep_tree.forward_gain == pytest.approx(rep_ours.forward_gain, rel=1e-12), (rep_tree, rep_ours)
    assert rep_tree.backward_gain == pytest.approx(rep_ours.backward_gain, rel=1e-12)
    assert rep_tree.orientation_error == 0.0 and rep_tree.sum_deviation == pytest.approx(
        rep_ours.sum_deviation
    )

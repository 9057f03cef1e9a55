"""`HyperConnectionModule`: one mHC sublayer connection, a plain `torch.nn.Module`.

Legend: s = sequence, b = micro-batch, C = hidden size, n = residual streams, N = n*n + 2n.
The residual is carried as `[s, b, n*C]`, stream-major (`view(s, b, n, C)`).

Per sublayer F (attention or MLP):

    aggregated, h_res, h_post, residual = hc(x)                  # x [s, b, n*C]
    y, bias = F(norm(aggregated))                                # [s, b, C]
    x_next = hc.post_residual_bda(h_res, residual, h_post, (y, bias), dropout_p, training)

In the single-pass form (`config.form="single_pass"`, DeepSeek-V4.1: `mhc_core.forms`) the caller carries the
mix: each call takes the `H_pre` the previous sublayer returned (None at the model's entry: stream 0) and returns
the next one; the module keeps nothing of a call:

    branch_input, h_res, h_post, h_pre = hc(x, previous_h_pre=h_pre)   # h_pre [s, b, n], None at the entry
    x_next = hc.post_residual_bda(h_res, x, h_post, (F(norm(branch_input)), None), dropout_p, training)
    out = exit_aggregate(x_last, h_pre, n)                              # the exit: [s, b, C]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from mhc_core import ops
from mhc_core.checks import NonFiniteError, check_dim, check_finite, check_rank, shape_str
from mhc_core.config import PARAM_DTYPE, HyperConnectionConfig
from mhc_core.forms import ConnectionForm
from mhc_core.kernels import select_backend
from mhc_core.ops.mapping import permutation_mapping
from mhc_core.ops.single_pass import check_previous_h_pre
from mhc_core.precision import KeepInFp32Mixin, mark_keep_in_fp32
from mhc_core.variants import ResidualConstraint, VariantSpec

__all__ = ["HyperConnectionModule", "SinglePassMix"]


class SinglePassMix(NamedTuple):
    """What a single-pass sublayer's connection returns (h_res second, as in the per-sublayer tuple)."""

    branch_input: torch.Tensor
    """`[s, b, C]`: the streams aggregated with the previous sublayer's `H_pre`."""
    h_res: torch.Tensor
    """`[s, b, n, n]`: this sublayer's residual mix (after Sinkhorn)."""
    h_post: torch.Tensor
    """`[s, b, n]`: this sublayer's output gates."""
    next_h_pre: torch.Tensor
    """`[s, b, n]`: the next sublayer's aggregate weights (the exit's after the last sublayer)."""


_PER_SUBLAYER = object()
"""`forward`'s default `previous_h_pre`: the call of the per-sublayer form."""


class HyperConnectionModule(KeepInFp32Mixin, nn.Module):
    """Coefficients, aggregation and post/residual mixing of one mHC sublayer.

    Parameters (names and shapes as upstream Megatron-LM, all fp32):
        mapping_proj.weight `[N, n*C]` xavier-uniform, no bias;
        alpha_pre, alpha_post, alpha_res `[1]` = `init_gating_factor`;
        bias `[N]` zeros, laid out `[pre(n) | post(n) | res(n*n row-major)]`.
    With `h_res_constraint="none"` H_res is `I + logits` (unconstrained Hyper-Connections) instead of
    the Sinkhorn projection; with `"permutations"` (mHC-lite) a softmax mixture of the n! permutation matrices
    from `2n + n!` projection outputs, on the reference ops whatever the backend. Under `paper` and `megatron_dev` (and any variant with `mapping_precision="fp32"`)
    they stay fp32 when the module is cast to bf16 / fp16 (megatron's `Float16Module`), as upstream dev's
    `mark_keep_in_fp32`; under `megatron_main` they are cast with the model, as upstream main
    (`mhc_core.precision`). The ops get `config.numerics`: the variant with the config's options.

    Args:
        config: a `HyperConnectionConfig`, or a megatron-core `TransformerConfig` carrying the
            `mhc_*` fields (read with `HyperConnectionConfig.from_transformer_config`).
        layer_number: accepted for megatron-core's `build_module`; only stored.
    """

    def __init__(self, config: HyperConnectionConfig | Any, layer_number: int | None = None):
        super().__init__()
        if not isinstance(config, HyperConnectionConfig):
            config = HyperConnectionConfig.from_transformer_config(config)
        self.hc_config = config
        self.layer_number = layer_number
        n, c = config.num_residual_streams, config.hidden_size
        self.n, self.hidden_size = n, c
        big_n = config.num_mapping_outputs
        self.mapping_proj = nn.Linear(n * c, big_n, bias=False, dtype=PARAM_DTYPE)
        self.alpha_pre = nn.Parameter(torch.full((1,), config.init_gating_factor, dtype=PARAM_DTYPE))
        self.alpha_post = nn.Parameter(torch.full((1,), config.init_gating_factor, dtype=PARAM_DTYPE))
        self.alpha_res = nn.Parameter(torch.full((1,), config.init_gating_factor, dtype=PARAM_DTYPE))
        self.bias = nn.Parameter(torch.zeros(big_n, dtype=PARAM_DTYPE))
        self.reset_parameters()
        if config.numerics.params_fp32:
            for p in self.parameters():
                mark_keep_in_fp32(p)
        if config.sequence_parallel:
            for p in self.parameters():
                p.sequence_parallel = True  # type: ignore[attr-defined]  # megatron-core's marker on a Parameter
        self._backend = select_backend(config.use_fused)
        self._spec = config.numerics

    @property
    def numerics(self) -> VariantSpec:
        """The configured spec the ops get (`config.numerics`, resolved once)."""
        return self._spec

    def reset_parameters(self) -> None:
        """xavier-uniform projection (zero when `perform_initialization` is off), alphas, zero bias."""
        with torch.no_grad():
            if self.hc_config.perform_initialization:
                nn.init.xavier_uniform_(self.mapping_proj.weight)
            else:
                self.mapping_proj.weight.zero_()
            for a in (self.alpha_pre, self.alpha_post, self.alpha_res):
                a.fill_(self.hc_config.init_gating_factor)
            self.bias.zero_()

    def _check_streams(self, x: torch.Tensor, name: str, op: str) -> tuple[int, int]:
        check_rank(x, 3, name=name, op=op, layout="[s, b, n*C]")
        if x.shape[-1] != self.n * self.hidden_size:
            raise ValueError(
                f"{op}: {name} must have shape [s, b, n*C] with n*C = {self.n}*{self.hidden_size} = "
                f"{self.n * self.hidden_size}, got {shape_str(x)}"
            )
        return x.shape[0], x.shape[1]

    def forward(
        self, hidden_states: torch.Tensor, previous_h_pre: Any = _PER_SUBLAYER
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Coefficients and the aggregated sublayer input.

        Args:
            hidden_states: `[s, b, n*C]`.
            previous_h_pre: single-pass form only (and required there): `[s, b, n]`, the `H_pre` the previous
                sublayer returned, or None at the model's entry (stream 0).

        Returns:
            per-sublayer form: aggregated `[s, b, C]`, h_res `[s, b, n, n]`, h_post `[s, b, n]`, residual
            `[s, b, n*C]` (the input itself, for `post_residual_bda`); single-pass form: a `SinglePassMix`
            (branch input `[s, b, C]`, h_res, h_post, next h_pre `[s, b, n]`).
        """
        op = "HyperConnectionModule.forward"
        single = self.hc_config.form == ConnectionForm.SINGLE_PASS
        if single and previous_h_pre is _PER_SUBLAYER:
            raise ValueError(
                f"{op}: this module is single_pass: call hc(x, previous_h_pre=h) with the H_pre the "
                "previous sublayer returned [s, b, n], or None at the model's entry"
            )
        if not single and previous_h_pre is not _PER_SUBLAYER:
            raise ValueError(
                f"{op}: previous_h_pre is for the single_pass form; this module is "
                f"{self.hc_config.form.value} (HyperConnectionConfig.form)"
            )
        if single:
            return self._single_pass(hidden_states, previous_h_pre)
        s, b = self._check_streams(hidden_states, "hidden_states", op)
        n, c, cfg = self.n, self.hidden_size, self.hc_config
        x = hidden_states.reshape(s * b, n * c)
        params = (self.mapping_proj.weight, self.alpha_pre, self.alpha_post, self.alpha_res, self.bias)
        try:
            if cfg.h_res_constraint == ResidualConstraint.NONE:  # unconstrained Hyper-Connections
                h_pre, h_post, logits = ops.mapping(
                    x, *params, n, self._spec, cfg.norm_eps, backend=self._backend
                )
                h_res = torch.eye(n, dtype=logits.dtype, device=logits.device) + logits
                aggregated = ops.h_aggregate(x.view(s * b, n, c), h_pre, backend=self._backend)
            elif (
                cfg.h_res_constraint == ResidualConstraint.PERMUTATIONS
            ):  # mHC-lite, on the reference mapping
                h_pre, h_post, h_res = permutation_mapping(x, *params, n, self._spec, cfg.norm_eps)
                aggregated = ops.h_aggregate(x.view(s * b, n, c), h_pre, backend=self._backend)
            else:  # mapping, Sinkhorn and aggregate in one op (one pass over x where the backend fuses them)
                aggregated, h_pre, h_post, h_res = ops.pre(
                    x, *params, n, cfg.sinkhorn_iterations, self._spec, cfg.norm_eps, backend=self._backend
                )
        except NonFiniteError:  # the reference scans the logits; name where the NaN / inf came from
            check_finite(hidden_states, name="hidden_states", op="HyperConnectionModule.forward")
            for name, p in self.named_parameters():
                check_finite(p, name=f"parameter {name}", op="HyperConnectionModule.forward")
            raise
        return (
            aggregated.view(s, b, c),
            h_res.view(s, b, n, n),
            h_post.view(s, b, n),
            hidden_states,
        )

    def _single_pass(self, hidden_states: torch.Tensor, previous_h_pre: torch.Tensor | None) -> SinglePassMix:
        """The single-pass form's call (see `forward`): the projection of `hidden_states` gives this sublayer's
        `h_post`, `h_res` and the next `H_pre`; the branch input aggregates `hidden_states` with `previous_h_pre`."""
        op = "HyperConnectionModule.forward"
        s, b = self._check_streams(hidden_states, "hidden_states", op)
        n, c, cfg = self.n, self.hidden_size, self.hc_config
        check_previous_h_pre(previous_h_pre, (s, b), n, op=op, layout="[s, b, n]")
        if cfg.h_res_constraint != ResidualConstraint.SINKHORN:
            raise ValueError(
                f"{op}: the single_pass form runs with h_res_constraint='sinkhorn', got "
                f"{cfg.h_res_constraint.value!r}"
            )
        x = hidden_states.reshape(s * b, n * c)
        params = (self.mapping_proj.weight, self.alpha_pre, self.alpha_post, self.alpha_res, self.bias)
        previous = None if previous_h_pre is None else previous_h_pre.reshape(s * b, n)
        try:  # the projection, Sinkhorn and the aggregate with the previous H_pre in one op (one read of x, fused)
            branch, next_h_pre, h_post, h_res = ops.single_pass_pre(
                x,
                previous,
                *params,
                n,
                cfg.sinkhorn_iterations,
                self._spec,
                cfg.norm_eps,
                backend=self._backend,
            )
        except NonFiniteError:
            check_finite(hidden_states, name="hidden_states", op=op)
            for name, p in self.named_parameters():
                check_finite(p, name=f"parameter {name}", op=op)
            raise
        return SinglePassMix(
            branch.view(s, b, c), h_res.view(s, b, n, n), h_post.view(s, b, n), next_h_pre.view(s, b, n)
        )

    def post_residual_bda(
        self,
        h_res: torch.Tensor,
        residual: torch.Tensor,
        h_post: torch.Tensor,
        output_with_bias: tuple[torch.Tensor, torch.Tensor | None],
        dropout_p: float = 0.0,
        training: bool | None = None,
    ) -> torch.Tensor:
        """Mix the residual streams and add the gated sublayer output (bias-dropout-add).

        Args:
            h_res: `[s, b, n, n]`; residual: `[s, b, n*C]`; h_post: `[s, b, n]`;
            output_with_bias: `(y [s, b, C], bias [C] | None)` as Megatron sublayers return them.
            dropout_p: hidden dropout on the expanded branch; `training` defaults to `self.training`.

        Returns:
            `[s, b, n*C]`.
        """
        op = "HyperConnectionModule.post_residual_bda"
        s, b = self._check_streams(residual, "residual", op)
        n, c = self.n, self.hidden_size
        if not isinstance(output_with_bias, tuple | list) or len(output_with_bias) != 2:
            if isinstance(output_with_bias, torch.Tensor):
                got = f"a tensor {shape_str(output_with_bias)}"
            elif isinstance(output_with_bias, tuple | list):
                got = f"{type(output_with_bias).__name__} of length {len(output_with_bias)}"
            else:
                got = type(output_with_bias).__name__
            raise ValueError(
                f"{op}: output_with_bias must be the pair (y [s, b, C], bias [C] or None) a Megatron "
                f"sublayer returns, got {got}"
            )
        y, bias = output_with_bias
        check_dim(y, (s, b, c), name="y", op=op, layout="[s, b, C]")
        check_dim(h_res, (s, b, n, n), name="h_res", op=op, layout="[s, b, n, n]")
        check_dim(h_post, (s, b, n), name="h_post", op=op, layout="[s, b, n]")
        out = ops.h_post_bda(
            h_res.reshape(s * b, n, n),
            residual.reshape(s * b, n, c),
            h_post.reshape(s * b, n),
            y.reshape(s * b, c),
            bias,
            dropout_p,
            self.training if training is None else training,
            self._spec,
            backend=self._backend,
        )
        return out.view(s, b, n * c)

    def extra_repr(self) -> str:
        cfg = self.hc_config
        return (
            f"n={self.n}, hidden_size={self.hidden_size}, variant={self._spec.name}, "
            f"sinkhorn_iterations={cfg.sinkhorn_iterations}, fused={cfg.use_fused}, form={cfg.form.value}"
        )

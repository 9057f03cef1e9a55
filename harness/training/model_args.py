"""`MODEL_ARGS` of a recipe: megatron-style flags (`--num-layers`, `--enable-mhc-connections`, ...)
validated into one frozen, keyword-only `TrainArgs`.

Only the flags in `FLAGS` are accepted; each maps to one `TrainArgs` field (the flag name with
dashes as underscores); upstream dev's names of two mHC flags are aliases (`upstream_flags.ALIASES`), and the
flags of upstream's GPU recipes this runner does not implement are typed in `upstream_flags.UPSTREAM_FLAGS` and
kept in `TrainArgs.upstream`. Without `--num-layers`, a hybrid pattern's decoder layers count them (as upstream). Values are YAML scalars: `true` for a bare switch, ints, floats, strings;
a list for `--recompute-modules` (upstream writes `"[mhc]"`; the brackets are accepted and stripped).
Every error names the flag, the value and the file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FLAGS", "TrainArgs", "flag_of", "parse_model_args", "render_cli"]


@dataclass(frozen=True, kw_only=True)
class TrainArgs:
    """A training run as megatron's `pretrain_gpt.py` flags describe it (only what this runner uses)."""

    # model
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None
    """None: 4 * hidden_size (megatron's default)."""
    seq_length: int
    max_position_embeddings: int | None = None
    """None: seq_length."""
    position_embedding_type: str = "learned_absolute"
    normalization: str = "LayerNorm"
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    transformer_impl: str = "local"
    """`local` (megatron-core modules; the only choice on CPU) or `transformer_engine`."""
    attention_backend: str = "auto"
    attention_softmax_in_fp32: bool = False
    bf16: bool = False
    use_distributed_optimizer: bool = False
    """megatron-core's distributed optimizer: fp32 main parameters and optimizer state sharded over data
    parallel, gradients reduce-scattered (upstream's recipes train with it)."""
    recompute_granularity: str | None = None
    recompute_modules: tuple[str, ...] | None = None
    recompute_method: str | None = None
    """With `--recompute-granularity full`: `uniform` or `block` (megatron-core's)."""
    recompute_num_layers: int | None = None
    """With `--recompute-granularity full`: layers per recomputed chunk (uniform) or recomputed layers (block)."""
    deterministic_mode: bool = False
    # mHC (upstream main's TransformerConfig fields)
    enable_mhc_connections: bool = False
    mhc_num_residual_streams: int = 4
    mhc_sinkhorn_iterations: int = 20
    mhc_init_gating_factor: float = 0.01
    mhc_variant: str = "megatron_main"
    mhc_h_res_constraint: str = "sinkhorn"
    use_fused_mhc: bool = False
    """The fused mHC ops (`mhc_core.kernels` dispatch: cuTile on an NVIDIA GPU, else compiled)."""
    mhc_learned_contraction: bool = False
    """The learned block exit (`megatron_dev` only), as upstream dev's block contracts."""
    mhc_single_pass: bool = False
    """DeepSeek-V4.1's single-pass form (upstream main's `mhc_single_pass`)."""
    mhc_norm_eps_inside_sqrt: bool = False
    """The mapping's RMS factor `rsqrt(mean(x^2) + eps)` (the option `eps_inside_sqrt`)."""
    mhc_fp32_coefficients: bool | None = None
    """Coefficients kept fp32 into Sinkhorn and the mixes (the option `fp32_coefficients`); None: the variant's."""
    mhc_norm_eps: float = 1e-6
    """eps of the mapping's RMS factor (DeepSeek-V4.1: the model's RMS epsilon)."""
    mhc_recompute_layer_num: int | None = None
    """With `mhc` in --recompute-modules: layers per mHC recompute group (None: the whole chunk)."""
    # GPU-only features of upstream's recipes: recorded so their recipes load; the trainer refuses them
    cuda_graph_impl: str = "none"
    cuda_graph_modules: tuple[str, ...] | None = None
    cuda_graph_warmup_steps: int | None = None
    te_rng_tracker: bool = False
    num_layers_per_virtual_pipeline_stage: int | None = None
    overlap_moe_expert_parallel_comm: bool = False
    disable_bias_linear: bool = False
    """No biases in the linear layers (upstream's MoE recipes)."""
    # MoE (megatron-core's MoELayer, local experts) and multi-token prediction
    num_experts: int | None = None
    """None: dense MLPs; else every MLP an MoE of this many experts."""
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    """None: --ffn-hidden-size."""
    moe_token_dispatcher_type: str = "allgather"
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"
    moe_grouped_gemm: bool = False
    moe_router_dtype: str | None = None
    mtp_num_layers: int | None = None
    """Multi-token prediction depths on the last stage (None: no MTP)."""
    mtp_loss_scaling_factor: float = 0.1
    hybrid_layer_pattern: str | None = None
    """The hybrid stack of this layer pattern (`mhc_core.megatron.hybrid`: `*` attention, `-` MLP, `E` MoE, `|` a
    stage boundary, `/` MTP depths after the decoder's layers) instead of the GPT's layers; --num-layers must count
    the decoder's layers, --mtp-num-layers the depths."""
    # parallelism
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False
    # batch, schedule, optimizer
    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    lr: float
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    lr_decay_iters: int | None = None
    """None: train_iters."""
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None
    """Overrides lr_warmup_iters: fraction of lr_decay_iters (upstream's recipe uses 0.01)."""
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 1234
    log_num_zeros_in_grad: bool = False
    # data
    mock_data: bool = False
    data_path: str | None = None
    """Prefix of a megatron indexed dataset (`<prefix>.bin` / `.idx`)."""
    split: str = "969,30,1"
    tokenizer_type: str = "ByteTokenizer"
    vocab_size: int | None = None
    """NullTokenizer only: the vocabulary size."""
    # checkpointing
    save_interval: int | None = None
    ckpt_format: str = "torch_dist"
    ckpt_fully_parallel_save: bool = False
    upstream: tuple[tuple[str, Any], ...] = ()
    """Upstream-only flags of the recipe, as given (`harness.training.upstream_flags`): validated by type, refused
    by the trainer where they change the model or the data, ignored where they only log."""

    @property
    def ffn_size(self) -> int:
        """The MLP width: --ffn-hidden-size, else 4 * hidden_size."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def model_parallel_size(self) -> int:
        """TP * PP: the ranks one model replica spans."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def warmup_iters(self) -> int:
        """Warm-up iterations: --lr-warmup-fraction of the decay iterations, else --lr-warmup-iters."""
        decay = self.lr_decay_iters or self.train_iters
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * decay)
        return self.lr_warmup_iters


@dataclass(frozen=True, kw_only=True)
class _Flag:
    kind: type
    choices: tuple[Any, ...] | Callable[[], tuple[Any, ...]] | None = None
    """The valid values, or a function giving them (read when a value is checked)."""
    minimum: float | None = None
    """Inclusive lower bound for numbers."""


def _f(
    kind: type,
    *,
    choices: tuple[Any, ...] | Callable[[], tuple[Any, ...]] | None = None,
    minimum: float | None = None,
) -> _Flag:
    return _Flag(kind=kind, choices=choices, minimum=minimum)


def _variant_names() -> tuple[str, ...]:
    """The variants of `mhc_core.variants` (imported when a recipe names one: `mhc_core` imports torch, which a
    CLI that only lists or plans keeps out)."""
    from mhc_core.variants import Variant

    return tuple(v.value for v in Variant)


FLAGS: dict[str, _Flag] = {
    "--num-layers": _f(int, minimum=1),
    "--hidden-size": _f(int, minimum=1),
    "--num-attention-heads": _f(int, minimum=1),
    "--ffn-hidden-size": _f(int, minimum=1),
    "--seq-length": _f(int, minimum=1),
    "--max-position-embeddings": _f(int, minimum=1),
    "--position-embedding-type": _f(str, choices=("learned_absolute", "rope")),
    "--normalization": _f(str, choices=("LayerNorm", "RMSNorm")),
    "--untie-embeddings-and-output-weights": _f(bool),
    "--hidden-dropout": _f(float, minimum=0.0),
    "--attention-dropout": _f(float, minimum=0.0),
    "--init-method-std": _f(float, minimum=0.0),
    "--make-vocab-size-divisible-by": _f(int, minimum=1),
    "--transformer-impl": _f(str, choices=("local", "transformer_engine")),
    "--attention-backend": _f(str, choices=("auto", "unfused", "local", "flash", "fused")),
    "--attention-softmax-in-fp32": _f(bool),
    "--bf16": _f(bool),
    "--use-distributed-optimizer": _f(bool),
    "--recompute-granularity": _f(str, choices=("selective", "full")),
    "--recompute-modules": _f(tuple),
    "--recompute-method": _f(str, choices=("uniform", "block")),
    "--recompute-num-layers": _f(int, minimum=1),
    "--deterministic-mode": _f(bool),
    "--enable-mhc-connections": _f(bool),
    "--mhc-num-residual-streams": _f(int, minimum=1),
    "--mhc-sinkhorn-iterations": _f(int, minimum=1),
    "--mhc-init-gating-factor": _f(float, minimum=0.0),
    "--mhc-variant": _f(str, choices=_variant_names),
    "--mhc-h-res-constraint": _f(str, choices=("sinkhorn", "none", "permutations")),
    "--use-fused-mhc": _f(bool),
    "--mhc-learned-contraction": _f(bool),
    "--mhc-single-pass": _f(bool),
    "--mhc-norm-eps-inside-sqrt": _f(bool),
    "--mhc-fp32-coefficients": _f(bool),
    "--mhc-norm-eps": _f(float, minimum=0.0),
    "--disable-bias-linear": _f(bool),
    "--num-experts": _f(int, minimum=1),
    "--moe-router-topk": _f(int, minimum=1),
    "--moe-ffn-hidden-size": _f(int, minimum=1),
    "--moe-token-dispatcher-type": _f(str, choices=("allgather", "alltoall")),
    "--moe-aux-loss-coeff": _f(float, minimum=0.0),
    "--moe-router-load-balancing-type": _f(str, choices=("aux_loss", "seq_aux_loss", "none")),
    "--moe-grouped-gemm": _f(bool),
    "--moe-router-dtype": _f(str, choices=("fp32", "fp64")),
    "--mhc-recompute-layer-num": _f(int, minimum=1),
    "--cuda-graph-impl": _f(str, choices=("none", "local", "transformer_engine")),
    "--cuda-graph-modules": _f(tuple),
    "--cuda-graph-warmup-steps": _f(int, minimum=0),
    "--te-rng-tracker": _f(bool),
    "--num-layers-per-virtual-pipeline-stage": _f(int, minimum=1),
    "--overlap-moe-expert-parallel-comm": _f(bool),
    "--expert-tensor-parallel-size": _f(int, minimum=1),
    "--mtp-num-layers": _f(int, minimum=1),
    "--hybrid-layer-pattern": _f(str),
    "--mtp-loss-scaling-factor": _f(float, minimum=0.0),
    "--tensor-model-parallel-size": _f(int, minimum=1),
    "--pipeline-model-parallel-size": _f(int, minimum=1),
    "--expert-model-parallel-size": _f(int, minimum=1),
    "--sequence-parallel": _f(bool),
    "--micro-batch-size": _f(int, minimum=1),
    "--global-batch-size": _f(int, minimum=1),
    "--train-iters": _f(int, minimum=1),
    "--lr": _f(float, minimum=0.0),
    "--min-lr": _f(float, minimum=0.0),
    "--lr-decay-style": _f(str, choices=("constant", "linear", "cosine", "inverse-square-root")),
    "--lr-decay-iters": _f(int, minimum=1),
    "--lr-warmup-iters": _f(int, minimum=0),
    "--lr-warmup-fraction": _f(float, minimum=0.0),
    "--weight-decay": _f(float, minimum=0.0),
    "--clip-grad": _f(float, minimum=0.0),
    "--adam-beta1": _f(float, minimum=0.0),
    "--adam-beta2": _f(float, minimum=0.0),
    "--adam-eps": _f(float, minimum=0.0),
    "--seed": _f(int, minimum=0),
    "--log-num-zeros-in-grad": _f(bool),
    "--mock-data": _f(bool),
    "--data-path": _f(str),
    "--split": _f(str),
    "--tokenizer-type": _f(str, choices=("ByteTokenizer", "NullTokenizer")),
    "--vocab-size": _f(int, minimum=2),
    "--save-interval": _f(int, minimum=1),
    "--ckpt-format": _f(str, choices=("torch_dist",)),
    "--ckpt-fully-parallel-save": _f(bool),
}
"""Every accepted flag, its type and its allowed values."""


def flag_of(field: str) -> str:
    """`num_layers` -> `--num-layers`."""
    return "--" + field.replace("_", "-")


def _field(flag: str) -> str:
    return flag[2:].replace("-", "_")


_FIELDS = {f.name for f in dataclasses.fields(TrainArgs)} - {"upstream"}
assert {_field(f) for f in FLAGS} == _FIELDS, sorted(_FIELDS ^ {_field(f) for f in FLAGS})
_REQUIRED = sorted(
    flag_of(f.name)
    for f in dataclasses.fields(TrainArgs)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)


def _bad(source: str, flag: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{source}: MODEL_ARGS {flag}={value!r}: {rule}")


def _convert(flag: str, value: Any, spec: _Flag, source: str) -> Any:
    kind = spec.kind
    if kind is bool:
        if not isinstance(value, bool):
            raise _bad(source, flag, value, "must be true or false")
        return value
    if kind is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.strip().strip("[]").split(",") if v.strip()]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
            raise _bad(source, flag, value, "must be a list of names")
        return tuple(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(source, flag, value, "must be an integer")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _bad(source, flag, value, "must be a finite number")
        value = float(value)
    elif kind is str and not isinstance(value, str):
        raise _bad(source, flag, value, "must be a string")
    choices = spec.choices() if callable(spec.choices) else spec.choices
    if choices is not None and value not in choices:
        raise _bad(source, flag, value, f"valid: {', '.join(map(str, choices))}")
    if spec.minimum is not None and value < spec.minimum:
        raise _bad(source, flag, value, f"must be >= {spec.minimum:g}")
    return value


def parse_model_args(raw: Mapping[str, Any], *, source: str) -> TrainArgs:
    """Validate a `MODEL_ARGS` mapping into `TrainArgs`; `ValueError` naming flag, value and `source`."""
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"{source}: MODEL_ARGS must be a mapping of --flags to values, got {type(raw).__name__}"
        )
    from harness.training.upstream_flags import ALIASES, UPSTREAM_FLAGS

    kwargs: dict[str, Any] = {}
    upstream: dict[str, Any] = {}
    for flag, value in raw.items():
        if flag in UPSTREAM_FLAGS:
            upstream[flag] = _convert(flag, value, _f(UPSTREAM_FLAGS[flag].kind), source)
            continue
        name = ALIASES.get(flag, flag)
        if name not in FLAGS:
            hint = "" if str(flag).startswith("--") else " (flags start with --)"
            raise ValueError(
                f"{source}: MODEL_ARGS: unknown flag {flag!r}{hint}; valid: {', '.join(sorted(FLAGS))} "
                f"(and upstream's, recorded but not implemented: {', '.join(sorted(UPSTREAM_FLAGS))})"
            )
        if _field(name) in kwargs:
            raise _bad(source, flag, value, f"sets {name} a second time (upstream dev's name of it)")
        kwargs[_field(name)] = _convert(flag, value, FLAGS[name], source)
    if "num_layers" not in kwargs and isinstance(kwargs.get("hybrid_layer_pattern"), str):
        # upstream's hybrid recipes give no --num-layers: the pattern's decoder layers count them
        kwargs["num_layers"] = sum(c not in "|" for c in kwargs["hybrid_layer_pattern"].split("/")[0])
    kwargs["upstream"] = tuple(upstream.items())
    missing = [f for f in _REQUIRED if _field(f) not in kwargs]
    if missing:
        raise ValueError(f"{source}: MODEL_ARGS is missing required flag(s) {', '.join(missing)}")
    args = TrainArgs(**kwargs)
    _cross_check(args, source)
    return args


def _cross_check(a: TrainArgs, source: str) -> None:
    def bad(flag: str, value: Any, rule: str) -> ValueError:
        return _bad(source, flag, value, rule)

    if a.hidden_size % a.num_attention_heads:
        raise bad(
            "--hidden-size",
            a.hidden_size,
            f"must be divisible by --num-attention-heads={a.num_attention_heads}",
        )
    if a.num_attention_heads % a.tensor_model_parallel_size:
        raise bad(
            "--num-attention-heads",
            a.num_attention_heads,
            f"must be divisible by --tensor-model-parallel-size={a.tensor_model_parallel_size}",
        )
    if a.num_layers % a.pipeline_model_parallel_size:
        raise bad(
            "--num-layers",
            a.num_layers,
            f"must be divisible by --pipeline-model-parallel-size={a.pipeline_model_parallel_size}",
        )
    if a.max_position_embeddings is not None and a.max_position_embeddings < a.seq_length:
        raise bad(
            "--max-position-embeddings", a.max_position_embeddings, f"must be >= --seq-length={a.seq_length}"
        )
    if a.global_batch_size % a.micro_batch_size:
        raise bad(
            "--global-batch-size",
            a.global_batch_size,
            f"must be a multiple of --micro-batch-size={a.micro_batch_size}",
        )
    if a.min_lr > a.lr:
        raise bad("--min-lr", a.min_lr, f"must be <= --lr={a.lr}")
    if a.mock_data == (a.data_path is not None):
        raise bad("--mock-data", a.mock_data, "give exactly one of --mock-data: true and --data-path")
    if a.tokenizer_type == "NullTokenizer" and a.vocab_size is None:
        raise bad("--tokenizer-type", a.tokenizer_type, "NullTokenizer needs --vocab-size")
    if a.tokenizer_type == "ByteTokenizer" and a.vocab_size not in (None, 256):
        raise bad("--vocab-size", a.vocab_size, "ByteTokenizer has a fixed vocabulary of 256")
    if a.sequence_parallel and a.tensor_model_parallel_size == 1:
        raise bad("--sequence-parallel", True, "needs --tensor-model-parallel-size > 1")
    if a.save_interval is not None and a.save_interval > a.train_iters:
        raise bad("--save-interval", a.save_interval, f"must be <= --train-iters={a.train_iters}")
    if a.num_experts is None and a.expert_model_parallel_size > 1:
        raise bad("--expert-model-parallel-size", a.expert_model_parallel_size, "needs --num-experts")
    if a.num_experts is not None and a.num_experts % a.expert_model_parallel_size:
        raise bad(
            "--num-experts",
            a.num_experts,
            f"must be divisible by --expert-model-parallel-size={a.expert_model_parallel_size}",
        )
    if a.num_experts is not None and a.moe_router_topk > a.num_experts:
        raise bad("--moe-router-topk", a.moe_router_topk, f"must be <= --num-experts={a.num_experts}")
    if a.hybrid_layer_pattern is not None:
        main, *depths = a.hybrid_layer_pattern.split("/")  # dev's unified form: <main>/<mtp>/<mtp>...
        if len(depths) != (a.mtp_num_layers or 0):
            raise bad(
                "--hybrid-layer-pattern",
                a.hybrid_layer_pattern,
                f"has {len(depths)} MTP depth(s) after '/'; --mtp-num-layers={a.mtp_num_layers}",
            )
        stages = main.split("|")
        if sum(map(len, stages)) != a.num_layers:
            raise bad(
                "--hybrid-layer-pattern",
                a.hybrid_layer_pattern,
                f"holds {sum(map(len, stages))} layers; --num-layers={a.num_layers}",
            )
        if len(stages) != a.pipeline_model_parallel_size:
            raise bad(
                "--hybrid-layer-pattern",
                a.hybrid_layer_pattern,
                f"has {len(stages)} stages; --pipeline-model-parallel-size={a.pipeline_model_parallel_size}",
            )
    if a.recompute_modules is not None and a.recompute_granularity != "selective":
        raise bad("--recompute-modules", list(a.recompute_modules), "needs --recompute-granularity selective")
    full = a.recompute_granularity == "full"
    for flag, value in (
        ("--recompute-method", a.recompute_method),
        ("--recompute-num-layers", a.recompute_num_layers),
    ):
        if full and value is None:
            raise bad(flag, value, "is needed with --recompute-granularity full")
        if not full and value is not None:
            raise bad(flag, value, "needs --recompute-granularity full")


def render_cli(raw: Mapping[str, Any]) -> list[str]:
    """`MODEL_ARGS` as upstream's runner renders them: `true` -> bare flag, `false` -> dropped,
    lists -> comma-joined without brackets, everything else `str(value)`."""
    out: list[str] = []
    for flag, value in raw.items():
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            out += [flag, ",".join(map(str, value))]
        else:
            out += [flag, str(value)]
    return out

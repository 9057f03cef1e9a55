"""Functional recipes (`recipes/<case>.yaml`): load, validate, resolve for one hardware key.

The format follows Megatron-LM's `model_config.yaml` (ENV_VARS, MODEL_ARGS, TEST_TYPE, METRICS)
plus `HARDWARE`, the per-hardware launch settings:

```yaml
DESCRIPTION: one line
ENV_VARS: {NCCL_ALGO: Ring}
MODEL_ARGS: {--num-layers: 2, --enable-mhc-connections: true, ...}   # see model_args.FLAGS
TEST_TYPE: regular            # or ckpt-resume
METRICS:                      # every checked metric and its tolerances
  lm loss: {exact: true, band: default}       # harness.golden.bands.DEFAULT_BANDS (measured)
  mem-max-rss-bytes: {rtol: 0.10}
  iteration-time: {timing: {slow: 0.10, fast: 0.30}}
HARDWARE:
  cpu_x86_64: {nproc: 1, backend: gloo, dtype: fp32, iterations: 24, check: [lm loss]}
  dgx_h100:   {nproc: 8, backend: nccl, dtype: bf16, nnodes: 2}   # nproc per node
```

Every error is a `ValueError` naming the file and the key (and the bad value).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.golden.bands import DEFAULT_BANDS
from harness.golden.compare import ApproximateCheck, Check, ExactCheck, TimingCheck
from harness.training.model_args import TrainArgs, parse_model_args
from harness.training.numerics import CpuNumerics, cpu_isa_pins

__all__ = [
    "RECIPE_DIR",
    "HardwareSpec",
    "MetricSpec",
    "Recipe",
    "RunPlan",
    "CPU_ISA_PINS",
    "as_nodes",
    "cpu_isa_pins",
    "dump_plan",
    "load_plan",
    "load_recipe",
    "recipe_names",
    "resolve",
]

RECIPE_DIR = Path(__file__).resolve().with_name("recipes")
"""The functional suite's recipes (the default of every `recipe_dir` here; a checkout's)."""
TOP_KEYS = ("DESCRIPTION", "ENV_VARS", "MODEL_ARGS", "TEST_TYPE", "METRICS", "HARDWARE")
TEST_TYPES = ("regular", "ckpt-resume")
_METRIC_KEYS = ("exact", "band", "rtol", "atol", "max_misses", "timing")
_TIMING_KEYS = ("slow", "fast", "window")
_HW_KEYS = ("nproc", "nnodes", "backend", "dtype", "iterations", "deterministic", "check", "timeout")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    """Tolerances of one metric: exact lane, approximate lane (rtol/atol), or a timing band."""

    name: str
    exact: bool = False
    band: ApproximateCheck | None = None
    """The measured default band (`band: default`, `harness.golden.bands.DEFAULT_BANDS`)."""
    rtol: float | None = None
    atol: float = 0.0
    max_misses: int | None = None
    timing_slow: float | None = None
    timing_fast: float | None = None
    timing_window: tuple[int, int] | None = None

    def checks(self, *, deterministic: bool) -> tuple[Check, ...]:
        """The harness checks of this metric; the exact lane only in a deterministic run."""
        out: list[Check] = []
        if self.exact and deterministic:
            out.append(ExactCheck())
        if self.band is not None:
            out.append(self.band)
        elif self.rtol is not None or self.atol:
            out.append(ApproximateCheck(rtol=self.rtol or 0.0, atol=self.atol, max_misses=self.max_misses))
        if self.timing_slow is not None:
            out.append(
                TimingCheck(
                    rel_band_slow=self.timing_slow, rel_band_fast=self.timing_fast, window=self.timing_window
                )
            )
        return tuple(out)


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """How a recipe runs on one hardware key."""

    key: str
    nproc: int
    """Processes per node (torchrun's `--nproc-per-node`)."""
    nnodes: int = 1
    """Nodes; the job has `nnodes * nproc` ranks."""
    backend: str
    """`gloo` (CPU) or `nccl` (GPU)."""
    dtype: str
    """`fp32` or `bf16` (sets `--bf16`)."""
    iterations: int | None = None
    """Overrides `--train-iters` (and scales `--save-interval` to half of it for ckpt-resume)."""
    deterministic: bool = True
    """False drops the exact lanes (upstream's --allow-nondeterministic-algo)."""
    check: tuple[str, ...] | None = None
    """Metrics checked on this hardware (a subset of METRICS); None: all of METRICS."""
    timeout: float = 600.0
    """Seconds one launch may take before it is killed."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One functional case as loaded from `recipes/<name>.yaml`."""

    name: str
    path: Path
    description: str
    env_vars: Mapping[str, str]
    model_args: Mapping[str, Any]
    """The raw MODEL_ARGS (validated); `${VAR}` placeholders are expanded by `resolve`."""
    test_type: str
    metrics: tuple[MetricSpec, ...]
    hardware: Mapping[str, HardwareSpec]

    def checks(self, hw: str) -> dict[str, tuple[Check, ...]]:
        """`{metric: checks}` for `golden_metrics.check` on hardware `hw`."""
        spec = self.hardware_spec(hw)
        names = spec.check if spec.check is not None else tuple(m.name for m in self.metrics)
        by_name = {m.name: m for m in self.metrics}
        return {n: by_name[n].checks(deterministic=spec.deterministic) for n in names}

    def hardware_spec(self, hw: str) -> HardwareSpec:
        """The HARDWARE entry of `hw`; `ValueError` naming the file and the keys it has."""
        if hw not in self.hardware:
            raise ValueError(
                f"{self.path}: HARDWARE has no entry for {hw!r} (has: {', '.join(self.hardware)})"
            )
        return self.hardware[hw]


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """A recipe resolved for one hardware key: everything a launch needs (JSON-serialisable)."""

    case: str
    hw: str
    nproc: int
    """Ranks per node."""
    nnodes: int = 1
    backend: str
    deterministic: bool
    timeout: float
    env: dict[str, str] = field(default_factory=dict)
    args: TrainArgs

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.args.model_parallel_size

    @property
    def num_microbatches(self) -> int:
        return self.args.global_batch_size // (self.args.micro_batch_size * self.data_parallel_size)


def _err(path: Path, key: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{path}: {key}={value!r}: {rule}")


def _mapping(path: Path, key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _err(path, key, value, "must be a mapping")
    return value


def _number(path: Path, key: str, value: Any, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value < minimum:
        raise _err(path, key, value, f"must be a number >= {minimum:g}")
    return float(value)


def _int(path: Path, key: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _err(path, key, value, f"must be an integer >= {minimum}")
    return value


def _unknown(path: Path, where: str, keys: Any, valid: tuple[str, ...]) -> None:
    extra = [k for k in keys if k not in valid]
    if extra:
        raise ValueError(
            f"{path}: {where}: unknown key(s) {', '.join(map(repr, extra))}; valid: {', '.join(valid)}"
        )


def _metric(path: Path, name: Any, raw: Any) -> MetricSpec:
    where = f"METRICS.{name}"
    if not isinstance(name, str) or not name:
        raise _err(path, "METRICS", name, "metric names must be non-empty strings")
    raw = _mapping(path, where, raw)
    _unknown(path, where, raw, _METRIC_KEYS)
    kw: dict[str, Any] = {"name": name}
    if "exact" in raw:
        if not isinstance(raw["exact"], bool):
            raise _err(path, f"{where}.exact", raw["exact"], "must be true or false")
        kw["exact"] = raw["exact"]
    for key in ("rtol", "atol"):
        if key in raw:
            kw[key] = _number(path, f"{where}.{key}", raw[key])
    if "max_misses" in raw:
        kw["max_misses"] = _int(path, f"{where}.max_misses", raw["max_misses"], minimum=0)
    if "band" in raw:
        if raw["band"] != "default":
            raise _err(
                path, f"{where}.band", raw["band"], "the only named band is 'default' (harness.golden.bands)"
            )
        if name not in DEFAULT_BANDS:
            raise _err(
                path,
                f"{where}.band",
                raw["band"],
                f"no default band for {name!r} (defaults: {', '.join(DEFAULT_BANDS)}); give rtol / atol",
            )
        clash = [k for k in ("rtol", "atol", "max_misses") if k in raw]
        if clash:
            raise _err(path, where, dict(raw), f"band: default and {', '.join(clash)} are exclusive")
        kw["band"] = DEFAULT_BANDS[name]
    if "timing" in raw:
        t = _mapping(path, f"{where}.timing", raw["timing"])
        _unknown(path, f"{where}.timing", t, _TIMING_KEYS)
        for key in ("slow", "fast"):
            if key not in t:
                raise _err(path, f"{where}.timing", dict(t), f"needs '{key}' (a relative band, e.g. 0.10)")
        kw["timing_slow"] = _number(path, f"{where}.timing.slow", t["slow"])
        kw["timing_fast"] = _number(path, f"{where}.timing.fast", t["fast"])
        if kw["timing_fast"] >= 1:
            raise _err(path, f"{where}.timing.fast", t["fast"], "must be < 1")
        if "window" in t:
            w = t["window"]
            if not (
                isinstance(w, list)
                and len(w) == 2
                and all(isinstance(s, int) and s >= 1 for s in w)
                and w[0] <= w[1]
            ):
                raise _err(
                    path, f"{where}.timing.window", w, "must be [first_step, last_step], 1 <= first <= last"
                )
            kw["timing_window"] = (w[0], w[1])
    spec = MetricSpec(**kw)
    if not spec.checks(deterministic=True):
        raise _err(path, where, dict(raw), "names no check: give exact: true, rtol/atol, or timing")
    return spec


def _hardware(path: Path, key: Any, raw: Any, metrics: tuple[MetricSpec, ...]) -> HardwareSpec:
    where = f"HARDWARE.{key}"
    if not isinstance(key, str) or not re.fullmatch(r"[a-z0-9_]+", key):
        raise _err(path, "HARDWARE", key, "hardware keys are lower-case names such as cpu_x86_64 or dgx_h100")
    raw = _mapping(path, where, raw)
    _unknown(path, where, raw, _HW_KEYS)
    for req in ("nproc", "backend", "dtype"):
        if req not in raw:
            raise ValueError(f"{path}: {where}: missing required key {req!r}")
    kw: dict[str, Any] = {"key": key, "nproc": _int(path, f"{where}.nproc", raw["nproc"])}
    if "nnodes" in raw:
        kw["nnodes"] = _int(path, f"{where}.nnodes", raw["nnodes"])
    if raw["backend"] not in ("gloo", "nccl"):
        raise _err(path, f"{where}.backend", raw["backend"], "valid: gloo, nccl")
    if raw["dtype"] not in ("fp32", "bf16"):
        raise _err(path, f"{where}.dtype", raw["dtype"], "valid: fp32, bf16")
    kw["backend"], kw["dtype"] = raw["backend"], raw["dtype"]
    if "iterations" in raw:
        kw["iterations"] = _int(path, f"{where}.iterations", raw["iterations"], minimum=2)
    if "deterministic" in raw:
        if not isinstance(raw["deterministic"], bool):
            raise _err(path, f"{where}.deterministic", raw["deterministic"], "must be true or false")
        kw["deterministic"] = raw["deterministic"]
    if "timeout" in raw:
        kw["timeout"] = _number(path, f"{where}.timeout", raw["timeout"], minimum=1)
    if "check" in raw:
        names = raw["check"]
        known = {m.name for m in metrics}
        if not isinstance(names, list) or not names or any(n not in known for n in names):
            raise _err(
                path,
                f"{where}.check",
                names,
                f"must be a non-empty list of METRICS names ({', '.join(sorted(known))})",
            )
        kw["check"] = tuple(names)
    return HardwareSpec(**kw)


def load_recipe(path: str | Path) -> Recipe:
    """Load and validate one recipe file; `ValueError` naming the file and the key on bad input."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read recipe: {exc.strerror}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a recipe is a mapping with keys {', '.join(TOP_KEYS)}")
    _unknown(path, "top level", doc, TOP_KEYS)
    for req in ("MODEL_ARGS", "TEST_TYPE", "METRICS", "HARDWARE"):
        if req not in doc:
            raise ValueError(f"{path}: missing required key {req!r}")
    env = _mapping(path, "ENV_VARS", doc.get("ENV_VARS") or {})
    for k, v in env.items():
        if not isinstance(k, str) or isinstance(v, dict | list) or v is None:
            raise _err(path, f"ENV_VARS.{k}", v, "must be a scalar")
    model_args = _mapping(path, "MODEL_ARGS", doc["MODEL_ARGS"])
    parse_model_args(_expand(model_args, {}, path, check_only=True), source=str(path))
    if doc["TEST_TYPE"] not in TEST_TYPES:
        raise _err(path, "TEST_TYPE", doc["TEST_TYPE"], f"valid: {', '.join(TEST_TYPES)}")
    if doc["TEST_TYPE"] == "ckpt-resume" and "--save-interval" not in model_args:
        raise _err(
            path, "TEST_TYPE", "ckpt-resume", "needs MODEL_ARGS --save-interval (the step to resume from)"
        )
    metrics = tuple(_metric(path, k, v) for k, v in _mapping(path, "METRICS", doc["METRICS"]).items())
    if not metrics:
        raise _err(path, "METRICS", {}, "must name at least one metric")
    hardware = {
        k: _hardware(path, k, v, metrics) for k, v in _mapping(path, "HARDWARE", doc["HARDWARE"]).items()
    }
    if not hardware:
        raise _err(path, "HARDWARE", {}, "must name at least one hardware key")
    description = doc.get("DESCRIPTION", "")
    if not isinstance(description, str):
        raise _err(path, "DESCRIPTION", description, "must be a string")
    return Recipe(
        name=path.stem,
        path=path,
        description=description.strip(),
        env_vars={k: str(v) for k, v in env.items()},
        model_args=dict(model_args),
        test_type=doc["TEST_TYPE"],
        metrics=metrics,
        hardware=hardware,
    )


def recipe_names(directory: Path = RECIPE_DIR) -> list[str]:
    """The case names of every recipe in `directory`, sorted."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def _expand(
    raw: Mapping[str, Any], variables: Mapping[str, str], path: Path, *, check_only: bool = False
) -> dict[str, Any]:
    out = {}
    for flag, value in raw.items():
        if isinstance(value, str):
            for name in _VAR.findall(value):
                if not check_only and name not in variables:
                    raise _err(
                        path,
                        f"MODEL_ARGS.{flag}",
                        value,
                        f"unknown variable ${{{name}}}; known: {', '.join(sorted(variables)) or 'none'}",
                    )
            if not check_only:
                value = _VAR.sub(lambda m: variables[m.group(1)], value)
        out[flag] = value
    return out


def resolve(
    recipe: Recipe,
    hw: str,
    *,
    variables: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    numerics: CpuNumerics | None = None,
) -> RunPlan:
    """The run plan of `recipe` on hardware `hw`.

    `variables` fill `${NAME}` in MODEL_ARGS values; `overrides` replace MODEL_ARGS entries, None removing
    one (a test hook: e.g. `{"--mhc-sinkhorn-iterations": 1}` breaks the model on purpose).
    The hardware entry's `iterations` replaces `--train-iters` (a ckpt-resume case then saves at
    half of it) and its `dtype` sets `--bf16`. A CPU run gets the pins of the `numerics` profile
    (default: `$MHC_CPU_NUMERICS`, else `avx2`; `harness/training/numerics.py`).
    """
    spec = recipe.hardware_spec(hw)
    raw = dict(recipe.model_args)
    if spec.iterations is not None:
        raw["--train-iters"] = spec.iterations
        if recipe.test_type == "ckpt-resume":
            raw["--save-interval"] = spec.iterations // 2
    raw["--bf16"] = spec.dtype == "bf16"
    for flag, value in (overrides or {}).items():
        if value is None:  # an override of None removes the flag (the recipe's value with it)
            raw.pop(flag, None)
        else:
            raw[flag] = value
    args = parse_model_args(_expand(raw, variables or {}, recipe.path), source=str(recipe.path))
    world = spec.nproc * spec.nnodes
    ranks = f"nproc {spec.nproc}" + (f" x nnodes {spec.nnodes}" if spec.nnodes > 1 else "")
    if world % args.model_parallel_size:
        raise _err(
            recipe.path,
            f"HARDWARE.{hw}.nproc",
            spec.nproc,
            f"{ranks} = {world} ranks must be a multiple of TP*PP = {args.model_parallel_size}",
        )
    dp = world // args.model_parallel_size
    if (dp * args.tensor_model_parallel_size) % args.expert_model_parallel_size:
        raise _err(
            recipe.path,
            "MODEL_ARGS.--expert-model-parallel-size",
            args.expert_model_parallel_size,
            f"must divide DP * TP = {dp} * {args.tensor_model_parallel_size} ({ranks} on {hw})",
        )
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise _err(
            recipe.path,
            "MODEL_ARGS.--global-batch-size",
            args.global_batch_size,
            f"must be a multiple of --micro-batch-size * DP = {args.micro_batch_size} * {dp} "
            f"(DP = {ranks} / TP*PP {args.model_parallel_size} on {hw})",
        )
    if spec.backend == "gloo" and args.sequence_parallel:
        raise _err(
            recipe.path,
            "MODEL_ARGS.--sequence-parallel",
            True,
            f"not possible on {hw} (gloo, no Transformer Engine / apex)",
        )
    if spec.backend == "gloo" and args.transformer_impl != "local":
        raise _err(
            recipe.path,
            "MODEL_ARGS.--transformer-impl",
            args.transformer_impl,
            f"only 'local' runs on {hw} (Transformer Engine needs CUDA)",
        )
    return RunPlan(
        case=recipe.name,
        hw=hw,
        nproc=spec.nproc,
        nnodes=spec.nnodes,
        backend=spec.backend,
        deterministic=spec.deterministic,
        timeout=spec.timeout,
        env={**cpu_isa_pins(spec.backend, profile=numerics), **recipe.env_vars},
        args=args,
    )


def as_nodes(plan: RunPlan, nnodes: int) -> RunPlan:
    """`plan` with the same ranks spread over `nnodes` nodes (same world, TP, PP, DP and batches,
    so the same golden values); `ValueError` when the world does not divide."""
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1 or plan.world_size % nnodes:
        raise ValueError(
            f"{plan.case}: cannot spread {plan.world_size} ranks over nnodes={nnodes!r} "
            f"(the world size must be a multiple of the node count)"
        )
    return dataclasses.replace(plan, nproc=plan.world_size // nnodes, nnodes=nnodes)


CPU_ISA_PINS = cpu_isa_pins("gloo", "x86_64", CpuNumerics.AVX2)
"""The default profile's pins (`harness/training/numerics.py`)."""


def dump_plan(plan: RunPlan, path: Path) -> Path:
    """Write `plan` as JSON (what the worker reads)."""
    Path(path).write_text(json.dumps(dataclasses.asdict(plan), indent=1) + "\n", encoding="utf-8")
    return Path(path)


def load_plan(path: Path) -> RunPlan:
    """Read a plan written by `dump_plan`."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    args = doc.pop("args")
    for name in ("recompute_modules", "cuda_graph_modules"):  # JSON has lists where TrainArgs has tuples
        if args.get(name) is not None:
            args[name] = tuple(args[name])
    args["upstream"] = tuple((flag, value) for flag, value in args.get("upstream", ()))
    return RunPlan(**doc, args=TrainArgs(**args))

"""What a training step leaves alive: no activation may outlive its step.

A rank's tensors after a step fall in two sets. *Owned*: what training keeps by definition: the
parameters, their gradients and main-gradient buffers, the registered buffers, everything the
optimizer reaches (state, fp32 main parameters, its grad buffers) and the RNG tracker's states;
a tensor is owned when its storage is one of theirs (views of a grad buffer included). Everything
else alive is *retained*, and named by where it is held (`RetainedTensor.where`): a module's
attribute (`decoder.layers.0.mlp._kept`), or the object chain from a module global or a class.

`RetentionCheck` runs beside a training loop: after the first step of a launch (which builds the
caches: rotary frequencies, router trackers, the schedules' buffers) it takes the inventory of
what is retained, and after each later checked step every retained tensor that was not in that
inventory, i.e. that a later step created and kept, is a finding. A finding held where
`BY_DESIGN` names (one scalar megatron-core replaces each step) is reported, never an error.

    check = RetentionCheck(chunks, optimizer)
    check.after_step(step)          # every step; it scans only where `checks` says
    check.findings                  # RetainedTensor s; raise_if_retained() raises naming them

`gc.get_objects()` is the scan (Python-visible tensors; a tensor reachable only from C++, e.g.
an autograd graph kept alive by a node, is not seen): about 0.1-0.3 s per scan on a CPU rank.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import time
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "BY_DESIGN",
    "PLANT_ENV_VAR",
    "RetainedTensor",
    "RetentionReport",
    "MOE_FULL_RECOMPUTE",
    "OUTSIDE_PYTHON",
    "UNATTRIBUTED_INTEGERS",
    "RetentionCheck",
    "RetentionError",
    "owned_storages",
    "plant_retention",
    "where_held",
]

PLANT_ENV_VAR = "MHC_FUNCTIONAL_TEST_RETAIN"
"""Test hook: the dotted name of a module of the model that keeps its forward output (`plant_retention`)."""

BY_DESIGN = {
    r"^megatron\.core\.transformer\.moe\.moe_utils\.MoEAuxLossAutoScaler\.main_loss_backward_scale$": (
        "megatron-core: the scale of the routers' aux-loss gradient, one scalar replaced every step"
    ),
    r"^megatron\.core\.transformer\.multi_token_prediction\.MTPLossAutoScaler\.main_loss_backward_scale$": (
        "megatron-core: the scale of the MTP loss gradient, one scalar replaced every step"
    ),
    r"(^|\.)decoder\.input_tensor(\.grad)?$": (
        "megatron-core: TransformerBlock.set_input_tensor keeps the last microbatch's received pipeline tensor "
        "[s, b, n*C] (and the gradient the schedule sent back) until the next step's first forward"
    ),
    r"\.token_dispatcher\.\w+$": (
        "megatron-core: the MoE token dispatcher keeps the last microbatch's routing state ([T, experts] "
        "routing map and probabilities, permutation indices) as attributes"
    ),
}
"""Holders (a regular expression over `RetainedTensor.where`) whose tensors megatron-core keeps after a step,
with why: reported as megatron-core's (bytes and where), not errors of this suite's model or trainer."""


OUTSIDE_PYTHON = "held outside Python"
"""How `where_held` begins for a tensor no Python object holds (a collective's handle, an autograd node)."""

UNATTRIBUTED_INTEGERS = (
    "unattributed: an integer tensor (counts or indices, never an activation) that only C++ holds, e.g. the "
    "splits of megatron-core's MoE all-to-all over expert parallelism"
)
"""The `by_design` of an integer tensor held outside Python: reported, not an error (no activation is integer)."""


MOE_FULL_RECOMPUTE = (
    "megatron-core: MoE under full recompute keeps each recomputed layer's input alive after the step, held by "
    "C++ only (megatron-core's own GPT without mHC keeps [s, b, C] per layer the same way; with mHC it is the "
    "n-stream state)"
)
"""Who keeps the float tensors only C++ holds after a step of an MoE model under full recompute."""


class RetentionError(RuntimeError):
    """A step's tensor stayed alive after the step."""


@dataclass(frozen=True, kw_only=True)
class RetainedTensor:
    """One tensor alive after `step` that training does not own."""

    step: int
    where: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    by_design: str | None = None
    """Who keeps it and why (`BY_DESIGN`), or None: an error."""

    def line(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"step {self.step}: {self.where} [{shape}] {self.dtype}, {self.bytes} bytes"

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "where": self.where,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.bytes,
            "by_design": self.by_design,
        }


@dataclass(frozen=True, kw_only=True)
class RetentionReport:
    """A rank's `retention-rank<r>.json`, read back: the inventory of its launch's first step and the findings."""

    seconds: float
    inventory: tuple[RetainedTensor, ...]
    findings: tuple[RetainedTensor, ...]

    @property
    def inventory_bytes(self) -> int:
        return sum(r.bytes for r in self.inventory)

    def errors(self) -> list[RetainedTensor]:
        return [f for f in self.findings if f.by_design is None]

    @classmethod
    def from_json(cls, doc: Any, *, source: str) -> RetentionReport:
        """`ValueError` naming `source` and the field when `doc` is not a report."""
        try:
            rows = {
                k: [RetainedTensor(**{**r, "shape": tuple(r["shape"])}) for r in doc[k]]
                for k in ("inventory", "findings")
            }
            return cls(
                seconds=float(doc["seconds"]),
                inventory=tuple(rows["inventory"]),
                findings=tuple(rows["findings"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{source}: not a retention report ({type(exc).__name__}: {exc})") from None


def _storage_key(t: torch.Tensor) -> int | None:
    """The data pointer of `t`'s storage (None for tensors without one: meta, size 0, sparse)."""
    try:
        if t.device.type == "meta" or t.layout != torch.strided:
            return None
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


_NOT_ENTERED = (types.ModuleType, type, types.FunctionType, types.MethodType, nn.Module)
"""What a walk does not enter: code, and modules (a module's parameters and buffers are owned, and its attributes
named, module by module; an optimizer's `model_chunks` are not the optimizer's)."""


def _reachable(
    obj: Any,
    path: str,
    depth: int,
    seen: set[int],
    *,
    limit: int | None = None,
    skip_optimizers: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(path, tensor)` for the tensors reachable from `obj` (named `path`) through containers and instance
    attributes, `depth` levels deep; `limit`: the most items of one container entered; `skip_optimizers`: objects
    with `param_groups` are not entered."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if isinstance(obj, _NOT_ENTERED):
        return
    if isinstance(obj, dict):
        items: list[tuple[str, Any]] = [
            (f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]", v) for k, v in obj.items()
        ]
        items += [(f"[{k!r}]", k) for k in obj if isinstance(k, torch.Tensor)]
    elif isinstance(obj, list | tuple | set | frozenset):
        items = [(f"[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(getattr(obj, "__dict__", None), dict) and not (
        skip_optimizers and hasattr(obj, "param_groups")
    ):
        items = [(f".{k}", v) for k, v in vars(obj).items()]
    else:
        return
    for key, child in items[:limit]:
        yield from _reachable(
            child, path + key, depth - 1, seen, limit=limit, skip_optimizers=skip_optimizers
        )


def _tensors_in(obj: Any, depth: int) -> Iterator[torch.Tensor]:
    """Tensors reachable from `obj` (`_reachable`), with a leaf's gradient and megatron-core's `main_grad`."""
    for _, t in _reachable(obj, "", depth, set()):
        yield t
        if t.is_leaf and t.grad is not None:
            yield t.grad
        main_grad = getattr(t, "main_grad", None)
        if isinstance(main_grad, torch.Tensor):
            yield main_grad


def owned_storages(chunks: Iterable[nn.Module], optimizer: Any = None) -> dict[int, str]:
    """`{storage data pointer: what owns it}` for the parameters, gradients, main-gradient buffers and
    registered buffers of `chunks`, everything `optimizer` reaches, and the RNG tracker's states."""
    owned: dict[int, str] = {}

    def add(tensors: Iterable[torch.Tensor], kind: str) -> None:
        for t in tensors:
            key = _storage_key(t)
            if key is not None:
                owned.setdefault(key, kind)

    for chunk in chunks:
        for m in chunk.modules():
            add(_tensors_in([p for p in m._parameters.values() if p is not None], 2), "parameter")
            add((b for b in m._buffers.values() if b is not None), "buffer")
            for attr in ("buffers", "expert_parallel_buffers", "param_to_bucket_group"):
                if hasattr(m, attr):  # megatron-core DDP's parameter / gradient buffers
                    add(_tensors_in(getattr(m, attr), 4), "grad buffer")
    if optimizer is not None:
        add(_tensors_in(optimizer, 8), "optimizer")
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        add(_tensors_in(get_cuda_rng_tracker(), 4), "rng state")
    except ImportError:
        pass
    return owned


def _named_modules(chunks: Sequence[nn.Module]) -> Iterator[tuple[str, nn.Module]]:
    """`(dotted name, module)` over the chunks (`chunk<i>.` prefixed when there are several)."""
    for i, chunk in enumerate(chunks):
        prefix = f"chunk{i}." if len(chunks) > 1 else ""
        for name, m in chunk.named_modules():
            yield (prefix + name).rstrip(".") or type(m).__name__, m


def _module_names(chunks: Sequence[nn.Module]) -> dict[int, str]:
    """`{id(module): dotted name}` over the chunks (`_named_modules`)."""
    names: dict[int, str] = {}
    for name, m in _named_modules(chunks):
        names.setdefault(id(m), name)
    return names


def _key_in(container: Any, child: Any) -> str | None:
    """How `container` holds `child`: `.attr`, `[key]`, `[i]`; None when it does not (directly)."""
    if isinstance(container, dict):
        for k, v in container.items():
            if v is child:
                return f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]"
    elif isinstance(container, list | tuple):
        for i, v in enumerate(container):
            if v is child:
                return f"[{i}]"
    elif isinstance(container, types.FrameType):
        for k, v in container.f_locals.items():
            if v is child:
                return f" local {k}"
    elif isinstance(getattr(container, "__dict__", None), dict):
        for k, v in vars(container).items():
            if v is child:
                return f".{k}"
    return None


def _root_name(holder: Any, modules: dict[int, str]) -> str | None:
    """The name of `holder` when it is a root: a model module, a loaded module, a class, a frame."""
    if id(holder) in modules:
        return modules[id(holder)]
    if isinstance(holder, types.ModuleType):
        return holder.__name__
    if isinstance(holder, type):
        return f"{holder.__module__}.{holder.__qualname__}"
    if isinstance(holder, types.FrameType):
        code = holder.f_code
        return f"frame {code.co_qualname} ({code.co_filename.rsplit('/', 1)[-1]}:{holder.f_lineno})"
    return None


def where_held(
    t: torch.Tensor,
    modules: dict[int, str],
    *,
    max_depth: int = 10,
    budget: int = 24,
    ignore: Iterable[Any] = (),
) -> str:
    """Where `t` is held: the shortest chain up `gc.get_referrers` to a model module, a loaded module, a class or
    a frame's local (`decoder.layers.0.mlp._kept`, `pkg.mod.Class.attr[2]`), else from the outermost object
    found (`<StabilityMonitor>._captured['x']`). `budget`: the most `gc.get_referrers` calls (each scans every
    object: ~0.1 s); `ignore`: the caller's own containers."""
    # The frames' ids only: a frame held in a local would be a reference cycle.
    skip = {id(sys._getframe()), id(sys._getframe(1))} | {id(o) for o in ignore}
    objs: list[Any] = [t]  # the frontier as two lists: a (object, path) pair would itself refer to the object
    paths: list[str] = [""]
    seen = {id(t)}
    outermost = ""
    for _ in range(max_depth):
        next_objs: list[Any] = []
        next_paths: list[str] = []
        skip.update((id(objs), id(next_objs)))
        for i in range(len(objs)):  # (no zip: its result tuple would refer to the object too)
            obj, path = objs[i], paths[i]
            if budget <= 0:
                return outermost or OUTSIDE_PYTHON + " (no referrer names it)"
            budget -= 1
            for ref in gc.get_referrers(obj):
                if id(ref) in seen or id(ref) in skip:
                    continue
                if isinstance(ref, types.FrameType) and ref.f_code.co_filename == __file__:
                    continue
                seen.add(id(ref))
                key = _key_in(ref, obj)
                if key is None:
                    continue
                holder = ref
                if isinstance(ref, dict):  # a namespace: continue from its owner (an instance or a class)
                    budget -= 1
                    owners = [
                        h
                        for h in gc.get_referrers(ref)
                        if getattr(h, "__dict__", None) is ref
                        or (isinstance(h, type) and any(v is obj for v in vars(h).values()))
                    ]
                    if owners:
                        holder = owners[0]
                        seen.add(id(holder))
                name = _root_name(holder, modules)
                if name is not None:
                    return name + key + path
                next_objs.append(holder)
                next_paths.append(key + path)
                outermost = f"<{type(holder).__name__}>{key}{path}"
        if not next_objs:
            break
        objs, paths = next_objs[:64], next_paths[:64]
    return outermost or OUTSIDE_PYTHON + " (no referrer names it)"


def _saved_by_graph(node: Any, path: str, depth: int = 3) -> Iterator[tuple[str, torch.Tensor]]:
    """`(path, tensor)` for the tensors the autograd nodes under `node` still save (`_saved_*`), `depth` deep."""
    if node is None or depth < 0:
        return
    for attr in dir(node):
        if attr.startswith("_saved_"):
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed by a backward
                continue
            for i, t in enumerate(value if isinstance(value, tuple | list) else [value]):
                if isinstance(t, torch.Tensor):
                    yield f"{path}.{attr}" + (f"[{i}]" if isinstance(value, tuple | list) else ""), t
    for i, (child, _) in enumerate(getattr(node, "next_functions", ())):
        yield from _saved_by_graph(child, f"{path}.next_functions[{i}]", depth - 1)


def names_from_roots(roots: dict[str, Any], *, depth: int = 4) -> dict[int, str]:
    """`{id(tensor): path}` for the tensors reachable from `roots` (`{name: object}`) through containers and
    instance attributes, `depth` levels deep: the cheap way to name what is held (no referrer scan). Modules
    and optimizers are not entered (their tensors are named by module, or owned)."""
    names: dict[int, str] = {}
    seen: set[int] = set()
    for name, root in roots.items():
        for path, t in _reachable(root, name, depth, seen, limit=256, skip_optimizers=True):
            names.setdefault(id(t), path)
            if t.is_leaf and t.grad is not None:  # a gradient is held by its tensor, out of gc's sight
                names.setdefault(id(t.grad), path + ".grad")
            for saved, s in _saved_by_graph(t.grad_fn, path + ".grad_fn"):  # so is what its graph saved
                names.setdefault(id(s), saved)
    return names


def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated module attributes warns
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


class RetentionCheck:
    """Finds the tensors later steps keep (module docstring). `checks`: the steps after which it looks (the
    launch's first step is the inventory, and is always taken); None: every step."""

    def __init__(
        self,
        chunks: Iterable[nn.Module],
        optimizer: Any,
        *,
        checks: Iterable[int] | None = None,
        roots: dict[str, Any] | None = None,
        outside_python: str | None = None,
    ):
        """`roots`: objects to name holders from (`{"<Trainer>": trainer}`), besides the model's modules and
        the loaded modules' globals. `outside_python`: who keeps a float tensor only C++ holds in this run, and
        why, where the run's configuration says (`MOE_FULL_RECOMPUTE`); None: such a tensor is an error."""
        self.chunks = list(chunks)
        self.roots = dict(roots or {})
        self.outside_python = outside_python
        self.optimizer = optimizer
        self.checks = None if checks is None else set(checks)
        self.findings: list[RetainedTensor] = []
        self.inventory: list[RetainedTensor] = []
        self._known: dict[int, weakref.ref[torch.Tensor]] | None = None
        self.seconds = 0.0
        """Time spent scanning, over the launch."""

    def _retained(self) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, int]]]:
        """(every live tensor, the retained ones with their storage key)."""
        owned = owned_storages(self.chunks, self.optimizer)
        live = _live_tensors()
        keyed = ((t, _storage_key(t)) for t in live)
        return live, [(t, key) for t, key in keyed if key is not None and key not in owned]

    def _names(self) -> dict[int, str]:
        """Cheap names: the model modules' attributes, `roots`, megatron-core's parallel state."""
        roots: dict[str, Any] = dict(self.roots)
        for name, m in _named_modules(self.chunks):
            roots[name] = {
                k: v for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")
            }
        state = sys.modules.get("megatron.core.parallel_state")
        if state is not None:
            roots["megatron.core.parallel_state"] = {
                k: v for k, v in vars(state).items() if k.startswith("_") and k.isupper()
            }
        return names_from_roots(roots)

    def _describe(
        self, t: torch.Tensor, step: int, names: dict[int, str], *, search: tuple[Any, ...] | None
    ) -> RetainedTensor:
        """`search`: None (name from the roots only), or the scan's own containers for a referrer search."""
        where = names.get(id(t))
        if where is None:
            where = (
                where_held(t, _module_names(self.chunks), ignore=search)
                if search is not None
                else "unnamed (not reachable from a root)"
            )
        why = next((why for pattern, why in BY_DESIGN.items() if re.search(pattern, where)), None)
        if why is None and where.startswith(OUTSIDE_PYTHON):
            why = self.outside_python if t.is_floating_point() or t.is_complex() else UNATTRIBUTED_INTEGERS
        return RetainedTensor(
            step=step,
            where=where,
            shape=tuple(t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            bytes=t.untyped_storage().nbytes(),
            by_design=why,
        )

    def after_step(self, step: int) -> None:
        """Takes the inventory on the first call; later, on checked steps, records what is new."""
        if self._known is not None and self.checks is not None and step not in self.checks:
            return
        start = time.perf_counter()
        try:
            self._scan(step)
        finally:
            self.seconds += time.perf_counter() - start

    def _scan(self, step: int) -> None:
        if self._known is None:
            self._known = {}
            names = self._names()
            for t, _ in self._retained()[1]:
                self._known[id(t)] = weakref.ref(t)
                self.inventory.append(self._describe(t, step, names, search=None))
            return
        names = self._names()
        seen_storages: set[int] = set()
        live, retained = self._retained()
        retained.sort(
            key=lambda pair: id(pair[0]) not in names
        )  # of tensors sharing a storage, name a named one
        for t, key in retained:
            ref = self._known.get(id(t))
            if (ref is not None and ref() is t) or key in seen_storages:
                continue
            seen_storages.add(key)
            self._known[id(t)] = weakref.ref(t)  # reported once
            self.findings.append(self._describe(t, step, names, search=(live, retained, *retained)))

    def errors(self) -> list[RetainedTensor]:
        return [f for f in self.findings if f.by_design is None]

    def raise_if_retained(self) -> None:
        """`RetentionError` listing each finding not in `BY_DESIGN` (where, shape, dtype, bytes)."""
        bad = self.errors()
        if bad:
            total = sum(f.bytes for f in bad)
            raise RetentionError(
                f"{len(bad)} tensor(s) of a training step outlived it ({total} bytes):\n  "
                + "\n  ".join(f.line() for f in bad)
            )

    def to_json(self) -> dict[str, Any]:
        """The inventory (what the first step left, bytes by holder) and the findings."""
        return {
            "seconds": round(self.seconds, 3),
            "inventory_bytes": sum(r.bytes for r in self.inventory),
            "inventory": [r.to_json() for r in self.inventory],
            "findings": [r.to_json() for r in self.findings],
        }

    def write(self, path: Path) -> None:
        """`to_json()` into `path`, atomically."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)


def plant_retention(model: nn.Module, name: str) -> None:
    """Module `name` of `model` keeps its latest forward output as the attribute `_planted_activation`: the
    retention a test plants (`$MHC_FUNCTIONAL_TEST_RETAIN`). Nothing when this rank's model has no such module
    (another pipeline stage holds it)."""
    modules = dict(model.named_modules())
    if name not in modules:
        return

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        module._planted_activation = output[0] if isinstance(output, tuple) else output

    modules[name].register_forward_hook(keep)

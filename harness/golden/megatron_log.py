"""A Megatron training log (its stdout, or its TensorBoard event files) as golden-schema series, so `diff`
and the plots work on a user's run.

Megatron-LM's `training_log` prints one line per logged step::

     iteration       10/     100 | consumed samples: 80 | elapsed time per iteration (ms): 41.2 |
     learning rate: 3.0E-04 | global batch size: 8 | lm loss: 5.552230E+00 | loss scale: 1.0 |
     grad norm: 3.626 | num zeros: 0.0 | number of skipped iterations: 0 | ...

and this suite's functional runs add `mhc amax gain: <fwd>/<bwd>` (`mhc_core.monitor`; a user's
run logs the same through `log_report`). Every `key: number` field becomes a series named as the
golden files name it (`lm loss`, `grad-norm`, `num-zeros`, `iteration-time` in seconds,
`mhc-amax-gain-fwd` / `-bwd`; any other key with spaces turned into dashes). Lines without
`iteration N/M` are ignored; a step logged twice (a resumed run) keeps its last value.

A TensorBoard log directory (or one `events.out.tfevents.*` file) is read with TensorBoard's own
`EventAccumulator`: every scalar tag becomes a series under its tag, `mhc/<metric>` (what
`mhc_core.monitor.log_report` writes) under `<metric>`. Needs the `tensorboard` package.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path

from harness.golden.errors import GoldenFormatError
from harness.golden.schema import Golden, MetricSeries

__all__ = ["parse_log", "read_log", "read_tensorboard"]

_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)")
_FIELD = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 ()/_.-]*?)\s*:\s*([-+0-9.eEinfINFnaN/]+)\s*$")
_NAMES = {
    "lm loss": "lm loss",
    "grad norm": "grad-norm",
    "num zeros": "num-zeros",
    "elapsed time per iteration (ms)": "iteration-time",
}
_SKIP = (
    "consumed samples",
    "global batch size",
    "number of skipped iterations",
    "number of nan iterations",
    "learning rate",
    "loss scale",
)


def _name(key: str) -> str:
    return _NAMES.get(key, re.sub(r"[^a-z0-9]+", "-", key.lower()).strip("-"))


def parse_log(lines: Iterable[str], *, source: str) -> Golden:
    """The series of every numeric field of the iteration lines (see the module docstring)."""
    series: dict[str, dict[int, float]] = {}
    seen = 0
    for lineno, line in enumerate(lines, start=1):
        m = _ITER.search(line)
        if not m:
            continue
        seen += 1
        step = int(m.group(1))
        for part in line[m.end() :].split("|"):
            f = _FIELD.match(part)
            if not f or f.group(1) in _SKIP:
                continue
            key, raw = f.group(1), f.group(2)
            if key == "mhc amax gain":
                fwd, _, bwd = raw.partition("/")
                pairs = [("mhc-amax-gain-fwd", fwd), ("mhc-amax-gain-bwd", bwd)]
            else:
                pairs = [(_name(key), raw)]
            for name, text in pairs:
                try:
                    value = float(text)
                except ValueError:
                    raise GoldenFormatError(
                        f"{source}: line {lineno}: {key!r} value {text!r} is not a number"
                    ) from None
                if not math.isfinite(value):
                    raise GoldenFormatError(
                        f"{source}: line {lineno} (step {step}): {key} is {text}; a result "
                        "file holds finite values only"
                    )
                if name == "iteration-time":
                    value /= 1e3  # ms -> s, as the golden files
                series.setdefault(name, {})[step] = value
    if not seen:
        raise GoldenFormatError(f"{source}: no Megatron iteration lines (' iteration N/M | ...') in the log")
    if not series:
        raise GoldenFormatError(f"{source}: {seen} iteration lines but no 'key: number' fields in them")
    return {name: MetricSeries.from_steps(values) for name, values in series.items()}


def read_tensorboard(path: str | Path) -> Golden:
    """The scalar series of a TensorBoard log directory or event file (see the module docstring)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise GoldenFormatError(
            f"{path}: reading TensorBoard event files needs the tensorboard package (pip install tensorboard)"
        ) from None
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    if not tags:
        raise GoldenFormatError(f"{path}: no TensorBoard scalars (not an event file or log directory?)")
    out: Golden = {}
    for tag in tags:
        values = {}
        for event in acc.Scalars(tag):
            if not math.isfinite(event.value):
                raise GoldenFormatError(
                    f"{path}: tag {tag!r} step {event.step} is {event.value}; a result file "
                    "holds finite values only"
                )
            values[int(event.step)] = float(event.value)
        out[tag.removeprefix("mhc/")] = MetricSeries.from_steps(values)
    return out


def read_log(path: str | Path) -> Golden:
    """A TensorBoard directory or `events.out.tfevents.*` file (`read_tensorboard`), else a text log
    (`parse_log`, decoded as UTF-8, undecodable bytes replaced)."""
    path = Path(path)
    if path.is_dir() or path.name.startswith("events.out.tfevents"):
        return read_tensorboard(path)
    with path.open(encoding="utf-8", errors="replace") as f:
        return parse_log(f, source=str(path))

"""Megatron's golden schema: real files load, written files round-trip, helpers build series."""

from __future__ import annotations

import json
import math

import pytest

from harness.golden.compare import compare, upstream_checks
from harness.golden.errors import GoldenFormatError, NonFiniteError
from harness.golden.schema import (
    MetricSeries,
    dumps_golden,
    golden_digest,
    load_golden,
    parse_golden,
    series_from_list,
    to_golden,
)

MEGATRON = "golden_values_dev_dgx_h100.json"
LEGACY = "golden_values_legacy_nan.json"


class TestMegatronFile:
    def test_loads_as_is(self, data_dir):
        """Megatron's golden_values_dev_dgx_h100.json loads with its four metrics and steps."""
        g = load_golden(data_dir / MEGATRON)
        assert ["lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes"] == list(g)
        assert tuple(range(1, 51)) == g["lm loss"].steps
        assert tuple(range(2, 51)) == g["iteration-time"].steps

    def test_compares_with_upstream_checks(self, data_dir):
        """A Megatron file compared with itself passes upstream's checks, timing lane included."""
        g = load_golden(data_dir / MEGATRON)
        checks = upstream_checks(["lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes"])
        results = compare(g, g, checks)
        assert all(r.ok for r in results), [r.message for r in results]

    def test_legacy_nan_string_rejected_on_read(self, data_dir):
        """An old file with "nan" for iteration-time step 1 is rejected, naming file, metric and step."""
        with pytest.raises(
            NonFiniteError, match=r"golden_values_legacy_nan\.json: metric 'iteration-time' step 1"
        ):
            load_golden(data_dir / LEGACY)

    def test_legacy_nan_string_dropped_on_import(self, data_dir):
        """allow_nan_strings drops the "nan" step, as upstream main omits unobserved steps."""
        g = load_golden(data_dir / LEGACY, allow_nan_strings=True)
        assert 2 == g["iteration-time"].steps[0]
        assert 1 == g["iteration-time"].start_step


class TestWrite:
    def test_only_metric_keys_at_top_level(self, data_dir):
        """A written document has exactly the metric names at top level and the four schema keys each."""
        doc = json.loads(dumps_golden(load_golden(data_dir / MEGATRON)))
        assert {"lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes"} == set(doc)
        assert all({"start_step", "end_step", "step_interval", "values"} == set(m) for m in doc.values())

    def test_round_trip_is_exact(self):
        """Full float64 precision survives dump and load (no rounding)."""
        x = [0.1 + 0.2, 1 / 3, 10.861534567891234]
        g = {"lm loss": series_from_list(x)}
        back = parse_golden(dumps_golden(g), source="mem")
        assert x == list(back["lm loss"].values.values())

    def test_nan_rejected_on_write(self):
        """Dumping NaN raises, naming the target, metric and step."""
        g = {"lm loss": series_from_list([1.0, math.nan])}
        with pytest.raises(NonFiniteError, match=r"out\.json: metric 'lm loss' step 2"):
            dumps_golden(g, target="out.json")

    def test_digest_ignores_formatting(self, data_dir):
        """The content digest is the same for a reformatted file."""
        g = load_golden(data_dir / MEGATRON)
        assert golden_digest(g) == golden_digest(parse_golden(dumps_golden(g), source="x"))


class TestParseErrors:
    def test_malformed_names_line_and_column(self):
        """Malformed JSON names the source with line and column."""
        with pytest.raises(GoldenFormatError, match=r"f\.json: malformed JSON at line 2 column 1"):
            parse_golden('{"lm loss":\n}', source="f.json")

    def test_duplicate_key_names_its_lines(self):
        """A key written twice in one object is named with the lines it is written at."""
        text = '{"lm loss": {"start_step": 1, "end_step": 1, "step_interval": 1,\n  "values": {"1": 2.0}},\n "lm loss": {}}'
        with pytest.raises(
            GoldenFormatError,
            match=r"f\.json: duplicate key 'lm loss' in one object "
            r"\(the key is written at lines 1, 3\)",
        ):
            parse_golden(text, source="f.json")

    def test_extra_top_level_key_rejected(self):
        """A non-metric top-level key (e.g. embedded meta) is rejected by name."""
        with pytest.raises(GoldenFormatError, match="metric 'meta': expected an object"):
            parse_golden('{"meta": "x"}', source="f.json")

    def test_off_grid_step_rejected(self):
        """A step off the start/interval grid is named."""
        doc = {"m": {"start_step": 1, "end_step": 9, "step_interval": 2, "values": {"1": 1.0, "4": 2.0}}}
        with pytest.raises(GoldenFormatError, match="step 4 is off the grid"):
            parse_golden(json.dumps(doc), source="f.json")

    def test_infinity_literal_rejected(self):
        """An Infinity literal is rejected on read, naming metric and step."""
        text = '{"m": {"start_step": 1, "end_step": 1, "step_interval": 1, "values": {"1": Infinity}}}'
        with pytest.raises(NonFiniteError, match="metric 'm' step 1"):
            parse_golden(text, source="f.json")


class TestToGolden:
    def test_list_means_steps_from_one(self):
        """A list of per-step values becomes steps 1..N."""
        s = to_golden({"lm loss": [3.0, 2.0, 1.0]})["lm loss"]
        assert (1, 3, 1) == (s.start_step, s.end_step, s.step_interval)

    def test_step_mapping_infers_interval(self):
        """{step: value} infers the interval as the gcd of the gaps."""
        s = to_golden({"m": {5: 1.0, 15: 2.0, 25: 3.0}})["m"]
        assert (5, 25, 10) == (s.start_step, s.end_step, s.step_interval)

    def test_schema_dict_accepted(self):
        """Values already in golden schema pass through."""
        raw = {"start_step": 2, "end_step": 3, "step_interval": 1, "values": {"2": 1.0, "3": 2.0}}
        assert (2, 3) == to_golden({"m": raw})["m"].steps

    def test_bad_value_names_metric(self):
        """A non-numeric value is reported with the metric name."""
        with pytest.raises(GoldenFormatError, match="metric 'm'"):
            to_golden({"m": ["a"]})

    def test_series_config_error_names_field(self):
        """A bad header field raises ValueError naming it."""
        with pytest.raises(ValueError, match="step_interval=0"):
            MetricSeries(start_step=1, end_step=2, step_interval=0, values={1: 1.0})

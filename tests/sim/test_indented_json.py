"""The report writer (kvserve.sim.indented_json) writes what ``json.dumps(value, indent=n,
allow_nan=False)`` writes, byte for byte: the report format (docs/architecture.md, "Files and
formats") is unchanged by writing it faster."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.sim import indented_json
from kvserve.sim import report as reports
from kvserve.sim.deployment import Deployment

from .helpers import req

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                    st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=6))
keys = st.one_of(st.text(max_size=5), st.integers(-5, 5), st.booleans(), st.none(),
                 st.floats(allow_nan=False, allow_infinity=False))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.tuples(inner, inner),
    st.dictionaries(st.text(max_size=5), inner, max_size=5),
    st.dictionaries(keys, inner, max_size=4)), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(value=values, indent=st.integers(1, 3))
def test_random_values_are_written_as_json_dumps_writes_them(value, indent):
    assert indented_json.dumps(value, indent) == json.dumps(value, indent=indent,
                                                            allow_nan=False)


@pytest.mark.parametrize("bad", [math.nan, [1.0, math.inf], {"a": {"b": [-math.inf]}}])
def test_non_finite_floats_are_refused_as_json_dumps_refuses_them(bad):
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        indented_json.dumps(bad)


def test_indent_below_one_is_refused():
    with pytest.raises(ValueError, match="indent must be at least 1, got 0"):
        indented_json.dumps([1], 0)


def test_a_report_with_preemptions_stalls_and_tenants_is_written_unchanged():
    """A whole report: nested config echo, aggregate, rows with stalls (a nested list in a
    row) and tenants, and the time series."""
    trace = [req(f"r{i}", 40 + 7 * i, 30, arrival=0.01 * i, tenant=f"t{i % 2}")
             for i in range(12)]
    echo, result = Deployment(model="llama-3.1-8b", hardware="h100-sxm").simulate(
        trace, {"num_kv_blocks": 12, "block_size": 16, "max_num_seqs": 8})
    assert result.num_preemptions > 0
    report = reports.build_report(echo, result)
    assert any(row["stalls"] for row in report["requests"])
    assert reports.dumps(report) == json.dumps(report, indent=1, allow_nan=False) + "\n"

"""Tenants in the simulator: the trace's ``tenant`` field drives the fair-share order and
the prefix cache scope (T1, T7), and the report shows service per tenant and Jain's index."""

from __future__ import annotations

import json

import pytest

from kvserve.sim.report import aggregate, jain_index, request_rows
from kvserve.sim.trace import TraceRequest, parse_request

from .helpers import by_id, req, simulate


def flood_trace() -> list[TraceRequest]:
    """Tenant "flood" sends 20 requests at t=0, "quiet" 2 a moment later."""
    trace = [req(f"f{i}", 32, 8, 0.0, tenant="flood", max_tokens=8, ignore_eos=True)
             for i in range(20)]
    trace += [req(f"q{i}", 32, 8, 0.001, tenant="quiet", max_tokens=8, ignore_eos=True)
              for i in range(2)]
    return trace


def test_trace_tenant_round_trips_and_is_checked():
    row = {"request_id": "a", "arrival_time": 0, "prompt_len": 4, "output_len": 1,
           "tenant": "team-a"}
    request = parse_request(row)
    assert request.tenant == "team-a"
    assert request.to_json()["tenant"] == "team-a"
    assert request.sampling_params(64).tenant == "team-a"
    assert "tenant" not in parse_request({**row, "tenant": ""}).to_json()
    with pytest.raises(ValueError, match="tenant must be a string, got 3"):
        parse_request({**row, "tenant": 3})


@pytest.mark.parametrize("fairness", ["off", "vtc"])
def test_vtc_admits_the_quiet_tenant_ahead_of_the_flood(fairness):  # T1
    """Two seats: under FCFS q0 waits behind all 20 flood requests; under VTC it is admitted
    as soon as the flood's counter passes the quiet tenant's (which starts at the flood's)."""
    records = by_id(simulate(flood_trace(), max_num_seqs=2, tenant_fairness=fairness))
    started = {rid: r.metrics.first_scheduled_time for rid, r in records.items()}
    if fairness == "vtc":
        assert started["q0"] <= started["f3"]
    else:
        assert started["q0"] >= started["f19"]


def test_report_shows_service_per_tenant_and_jains_index():
    result = simulate(flood_trace(), max_num_seqs=2)
    figures = aggregate(result)
    tenants = figures["tenants"]
    assert list(tenants) == ["flood", "quiet"]
    # every request: 32 prompt tokens x 1 + 8 output tokens x 2 = 48
    assert (tenants["flood"]["service"], tenants["quiet"]["service"]) == (960.0, 96.0)
    assert tenants["quiet"]["service_share"] == pytest.approx(96 / 1056, abs=1e-6)
    assert figures["jain_fairness_index"] == pytest.approx(1056 ** 2 / (2 * (960 ** 2 + 96 ** 2)),
                                                           abs=1e-6)
    assert request_rows(result)[0]["tenant"] == "flood"
    json.dumps(figures)


def test_a_trace_without_tenants_reports_as_before():
    result = simulate([req("a", 32, 4)])
    assert "tenants" not in aggregate(result)
    assert "tenant" not in request_rows(result)[0]


def test_jain_index():
    assert jain_index([5.0, 5.0]) == 1.0
    assert jain_index([1.0, 0.0]) == 0.5
    assert jain_index([0.0, 0.0]) == 1.0


def test_tenant_scope_keeps_tenants_caches_apart():  # T7
    shared = tuple(range(100, 164))
    trace = [TraceRequest("a", 0.0, 2, prompt_token_ids=shared, tenant="A"),
             TraceRequest("b", 5.0, 2, prompt_token_ids=shared, tenant="B"),
             TraceRequest("a2", 10.0, 2, prompt_token_ids=shared, tenant="A")]
    hits = {scope: {r.request_id: r.metrics.num_cached_tokens
                    for r in simulate(trace, prefix_cache_scope=scope).records}
            for scope in ("global", "tenant")}
    assert hits == {"global": {"a": 0, "b": 48, "a2": 48}, "tenant": {"a": 0, "b": 0, "a2": 48}}


def test_the_report_echoes_tenant_settings_only_when_set():
    """So a report with default flags stays byte-identical to one from before tenants."""
    from kvserve.core import SchedulerConfig
    from kvserve.sim.deployment import _scheduler_echo

    assert "tenant_fairness" not in _scheduler_echo(SchedulerConfig())
    echo = _scheduler_echo(SchedulerConfig(tenant_fairness="vtc", prefix_cache_scope="tenant"))
    assert (echo["tenant_fairness"], echo["prefix_cache_scope"]) == ("vtc", "tenant")
    assert "tenant_weights" not in echo


def two_floods(path) -> None:
    """Tenants "gold" and "plain" each send 40 identical requests at t=0."""
    from kvserve.sim.trace import write_trace

    write_trace(path, [req(f"{tenant[0]}{i:02d}", 32, 8, 0.0, tenant=tenant, max_tokens=8,
                           ignore_eos=True)
                       for i in range(40) for tenant in ("gold", "plain")])


def admitted_first(report: dict, count: int) -> dict[str, int]:
    """How many of each tenant's requests are among the first ``count`` admitted."""
    rows = sorted(report["requests"], key=lambda r: (r["first_scheduled_time"], r["request_id"]))
    tenants = [r["tenant"] for r in rows[:count]]
    return {t: tenants.count(t) for t in ("gold", "plain")}


def test_simulate_tenant_weight_gives_a_tenant_its_share(tmp_path):  # T4
    """Both backlogged the whole time: with gold's weight 3, gold is charged a third per
    token, so VTC admits three of its requests for each of plain's."""
    from kvserve.cli import main

    trace, report = tmp_path / "t.jsonl", tmp_path / "r.json"
    two_floods(trace)
    shares = {}
    for weights in ([], ["--tenant-weight", "gold=3"]):
        assert main(["simulate", "--trace", str(trace), "--cost-model", "unit",
                     "--num-kv-blocks", "400", "--max-num-seqs", "2",
                     "--tenant-fairness", "vtc", "--report", str(report), "--quiet",
                     *weights]) == 0
        data = json.loads(report.read_text())
        shares[bool(weights)] = admitted_first(data, 40)
        echoed = data["config"]["scheduler"].get("tenant_weights")
        assert echoed == ([["gold", 3.0]] if weights else None)
    assert shares == {False: {"gold": 20, "plain": 20}, True: {"gold": 30, "plain": 10}}


@pytest.mark.parametrize(("flags", "message"), [
    (["--tenant-weight", "gold"], "--tenant-weight 'gold': write TENANT=WEIGHT, e.g. team-a=2"),
    (["--tenant-weight", "gold=x"], "--tenant-weight 'gold=x': write TENANT=WEIGHT"),
    (["--tenant-weight", "=2"], "--tenant-weight '=2': write TENANT=WEIGHT"),
    (["--tenant-weight", "gold=0"], "--tenant-weight 'gold=0': the weight must be in (0, 1e6]"),
    (["--tenant-weight", "gold=nan"], "--tenant-weight 'gold=nan': the weight must be in"),
    (["--tenant-weight", "gold=inf"], "--tenant-weight 'gold=inf': the weight must be in"),
    (["--tenant-weight", "gold=2", "--tenant-weight", "gold=3"], "tenant 'gold' is given twice"),
])
def test_bad_tenant_weights_are_one_line_errors(tmp_path, capsys, flags, message):
    from kvserve.cli import main

    trace = tmp_path / "t.jsonl"
    two_floods(trace)
    assert main(["simulate", "--trace", str(trace), "--tenant-fairness", "vtc", "--quiet",
                 *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_tenant_weight_without_fair_share_is_refused(tmp_path, capsys):
    from kvserve.cli import main

    trace = tmp_path / "t.jsonl"
    two_floods(trace)
    assert main(["simulate", "--trace", str(trace), "--tenant-weight", "gold=2",
                 "--quiet"]) == 2
    assert "--tenant-weight needs --tenant-fairness vtc" in capsys.readouterr().err


def test_a_weight_for_a_tenant_the_trace_lacks_is_warned_of(tmp_path, capsys):
    from kvserve.cli import main

    trace = tmp_path / "t.jsonl"
    two_floods(trace)
    assert main(["simulate", "--trace", str(trace), "--tenant-fairness", "vtc", "--quiet",
                 "--cost-model", "unit", "--tenant-weight", "ghost=2",
                 "--tenant-weight", "gold=2"]) == 0
    assert "warning: --tenant-weight names 'ghost', which no request of the trace is from" \
        in capsys.readouterr().err

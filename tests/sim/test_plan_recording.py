"""``kvserve plan --trace DIR`` on a server's recording plans the recorded server as it ran
(its settings, its KV pool in blocks, step times fitted on its steps, its router), unless a
deployment is named (docs/recording.md, "Planning from a recording")."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main

from .test_replica_replay import build


def plan(capsys, directory, *argv):
    assert main(["plan", "--trace", str(directory), "--json", "--candidates", "1,2",
                 "--no-capacity-search", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_recording_is_planned_as_the_server_ran(tmp_path, capsys):
    directory = build(tmp_path / "rec")
    out = plan(capsys, directory)
    assert out["recorded"] == {"recording": str(directory), "model": "", "num_steps": 12,
                               "data_parallel_size": 2, "router": "prefix-affinity"}
    assert out["hardware"] is None and "activation_reserve_bytes" not in out
    assert out["num_blocks"] == 32 and out["block_size"] == 16  # the recorded pool
    assert out["pool_max_num_seqs"] == 1  # the recorded max_num_seqs
    assert [row["num_kv_blocks"] for row in out["sweep"]] == [32, 32]
    assert [row["max_num_seqs"] for row in out["sweep"]] == [1, 2]  # the recorded 1 in
    # priced by the fit on the recorded 0.5 s and 1 s steps, not an H100's microseconds
    assert out["sweep"][0]["ttft_p99"] > 0.3
    # the recorded cluster, two replicas behind its router: a row is simulate's figure
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(directory), "--max-num-seqs", "2", "--quiet",
                 "--report", str(report)]) == 0
    simulated = json.loads(report.read_text())
    assert simulated["config"]["data_parallel"]["size"] == 2
    # no preset priced or limited it (QA: the report echoed h100-sxm, plan null)
    assert simulated["config"]["deployment"]["hardware"] is None
    assert out["sweep"][1]["throughput_output_tok_s"] == \
        simulated["aggregate"]["throughput_output_tok_s"]


def test_a_named_deployment_plans_the_recordings_requests_on_it(tmp_path, capsys):
    directory = build(tmp_path / "rec")
    out = plan(capsys, directory, "--hardware", "h100-sxm")
    assert "recorded" not in out and out["hardware"] == "h100-sxm"
    assert out["num_blocks"] != 32 and out["sweep"][0]["ttft_p99"] < 0.3


def test_a_replica_plan_goes_through_the_recorded_router(tmp_path, capsys):
    directory = build(tmp_path / "rec")

    def replica_plan(*argv):  # no --candidates: a replica sweep refuses the other's flags
        assert main(["plan", "--trace", str(directory), "--json", "--max-replicas", "2",
                     *argv]) == 0
        return json.loads(capsys.readouterr().out)

    out = replica_plan()
    assert out["router"] == "prefix-affinity"
    assert [row["replicas"] for row in out["replica_sweep"]] == [1, 2]
    out = replica_plan("--router", "round-robin")
    assert out["router"] == "round-robin"
    out = plan(capsys, directory, "--router", "round-robin")  # the recorded cluster, rerouted
    assert out["recorded"]["router"] == "round-robin" and out["sweep"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--kv-pool-gib", "1"], "--kv-pool-gib sizes a planned device's memory"),
    (["--gpu-memory-gib", "80"], "--gpu-memory-gib sizes a planned device's memory"),
    (["--kv-cache-memory", "1GiB"], "give num_kv_blocks (--num-kv-blocks) instead"),
])
def test_a_recorded_pool_is_resized_in_blocks(tmp_path, capsys, argv, needle):
    directory = build(tmp_path / "rec")
    assert main(["plan", "--trace", str(directory), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_recorded_pool_is_checked_against_a_named_hardware_only(tmp_path, capsys):
    """A recording's pool ran on its own machine: no preset's memory limits it unless a
    --hardware is named (then the pool must fit in it, beside the weights)."""
    directory = build(tmp_path / "rec")
    assert plan(capsys, directory, "--num-kv-blocks", "100000")["num_blocks"] == 100_000
    assert main(["plan", "--trace", str(directory), "--num-kv-blocks", "100000",
                 "--hardware", "l4"]) == 2
    err = capsys.readouterr().err
    assert "a KV pool of 195.31 GiB does not fit in the l4 preset's 22.00 GiB" in err
    assert err.count("\n") == 1


def test_a_poor_fit_is_said_once_however_many_runs_use_it(tmp_path, capsys):
    """The recorded steps are fitted once, before the runs go to the workers (QA: the
    warning came once per simulation, seven times for four candidates)."""
    directory = build(tmp_path / "rec")
    steps = directory / "steps-1-00000.jsonl"  # replica 1's steps ten times faster than 0's
    rows = [json.loads(line) for line in steps.read_text().splitlines()]
    steps.write_text("".join(json.dumps({**row, "duration": 0.05} if row["type"] == "step"
                                        else row) + "\n" for row in rows))
    assert main(["plan", "--trace", str(directory), "--candidates", "2,4,8,16", "--json",
                 "--workers", "2"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines()
                if "the fit prices single steps poorly" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {directory}: ")


def test_the_title_says_what_was_planned(tmp_path, capsys):
    directory = build(tmp_path / "rec")
    assert main(["plan", "--trace", str(directory), "--candidates", "1",
                 "--no-capacity-search"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "as recorded (2 replicas behind prefix-affinity, the KV figures per replica; " \
        "step times fitted on its 12 steps)" in out
    assert "activation reserve" not in out


def test_simulate_says_what_a_named_deployment_prices_on_a_recording(tmp_path, capsys):
    """The simulator pass: ``simulate --trace REC --hardware l4`` kept the recorded steps'
    prices and said nothing (plan with the same flags plans an L4; whatif notes it), and
    took --gpu-memory-gib without --hardware, sizing nothing (its check read the default
    hardware as given)."""
    directory = build(tmp_path / "rec")
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(directory), "--hardware", "l4", "--quiet",
                 "--max-num-seqs", "2", "--report", str(report)]) == 0
    assert "note: --hardware prices only what the recorded steps cannot" in \
        capsys.readouterr().err
    assert json.loads(report.read_text())["config"]["deployment"]["hardware"] == "l4"
    assert main(["simulate", "--trace", str(directory), "--cost-model", "roofline",
                 "--quiet", "--report", str(report)]) == 0  # the default preset prices it
    assert json.loads(report.read_text())["config"]["deployment"]["hardware"] == "h100-sxm"
    assert main(["simulate", "--trace", str(directory), "--gpu-memory-gib", "0.1",
                 "--quiet"]) == 2
    assert "--gpu-memory-gib sizes a planned device's memory" in capsys.readouterr().err


def test_plan_warns_of_a_row_priced_on_shapes_the_recording_lacks(tmp_path, capsys):
    """The simulator pass: simulate and whatif warned that a run was priced on step shapes
    the recording barely has; plan showed the same row, and a capacity, with no caveat."""
    directory = build(tmp_path / "rec")  # its steps: prefills and decodes of one request
    assert main(["plan", "--trace", str(directory), "--candidates", "1,4",
                 "--no-capacity-search", "--json"]) == 0
    out = capsys.readouterr()
    shares = {row["max_num_seqs"]: row["off_record"]["share"]
              for row in json.loads(out.out)["sweep"]}
    assert shares[1] == pytest.approx(1 / 3)  # its prefill steps: 4 recorded, fewer than 5
    assert shares[4] == 1.0  # two or more requests a step: shapes never recorded
    assert "warning: 100% of max_num_seqs=4's step time went to step shapes the recording " \
        "has fewer than 5 steps of" in out.err

"""Every key `plan --json` and `simulate --report` write is documented in docs/simulator.md,
"Output keys" (QA: capacity_qps, blocked_steps, kvserve_report ... were documented nowhere):
the commands run in the modes that add keys, and each key path they write must match a row
of the page's table for that output."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

from kvserve.cli import main

from .test_replica_replay import build

DOCS = Path(__file__).resolve().parents[2] / "docs" / "simulator.md"


def documented(heading: str) -> list[re.Pattern[str]]:
    """The key column of the table under ``heading``, as patterns: ``{a,b}`` is each name,
    ``<name>`` any one key."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split(f"### {heading}\n", 1)[1].split("\n#", 1)[0]
    patterns = []
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+)` \|", line)
        if match is None:
            continue
        parts = re.split(r"(\{[^}]*\})", match.group(1))
        choices = [part[1:-1].split(",") if part.startswith("{") else [part] for part in parts]
        for names in itertools.product(*choices):
            key = re.escape("".join(names))
            patterns.append(re.compile(re.sub(r"<[a-z_]+>", r"[^.\\[\\]]+", key) + "$"))
    assert patterns, f"no table under {heading!r}"
    return patterns


def key_paths(value: object, prefix: str = "") -> set[str]:
    """Every key's path: ``a.b`` inside objects, ``a[].b`` inside a list's objects."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            path = f"{prefix}.{key}" if prefix else key
            found.add(path)
            found |= key_paths(inner, path)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                found |= key_paths(item, prefix + "[]")
    return found


def undocumented(paths: set[str], heading: str) -> list[str]:
    patterns = documented(heading)
    return sorted(p for p in paths if not any(pattern.match(p) for pattern in patterns))


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0, argv
    return json.loads(capsys.readouterr().out)


def test_every_key_of_plan_json_is_documented(tmp_path, trace, capsys):
    common = ["--json", "--workers", "1"]
    outputs = [
        run_json(capsys, ["plan", "--trace", str(trace), "--num-kv-blocks", "60",
                          "--candidates", "2,8", "--queue-delay-p99", "0.5", *common]),
        # a candidate whose activation reserve leaves no pool: its row's error
        run_json(capsys, ["plan", "--trace", str(trace), "--model", "llama-3.1-8b",
                          "--hardware", "l4", "--gpu-memory-utilization", "0.70",
                          "--candidates", "8,1024", "--no-capacity-search", *common]),
        run_json(capsys, ["plan", "--trace", str(trace), "--max-replicas", "2",
                          "--slo-ttft-p99", "1", "--num-kv-blocks", "300", *common]),
        run_json(capsys, ["plan", "--trace", str(build(tmp_path / "rec")), "--candidates",
                          "1,2", *common]),
        run_json(capsys, ["plan", "--prompt-len", "10", "--output-len", "10", "--json"]),
    ]
    paths = set().union(*(key_paths(out) for out in outputs))
    assert {"capacity_qps", "sweep[].error", "replica_sweep[].replicas",
            "recorded.num_steps"} <= paths  # the modes ran
    assert undocumented(paths, "`plan --json`") == []
    cost = run_json(capsys, ["plan", "--preemption-cost", "--seq-len", "100", "--json"])
    assert undocumented(key_paths(cost), "`plan --preemption-cost --json`") == []


def test_every_key_of_a_simulation_report_is_documented(tmp_path, trace, capsys):
    chat = tmp_path / "chat.jsonl"  # tenants and multi-turn sessions
    assert main(["workload", "gen", "-n", "20", "--rate", "5", "--turns", "fixed:3",
                 "--think-time", "1", "--sessions", "--prompt-len", "uniform:32,64",
                 "--output-len", "uniform:8,16", "--seed", "2", "-o", str(chat)]) == 0
    rows = [json.loads(line) for line in chat.read_text().splitlines()]
    chat.write_text("".join(json.dumps({**row, "tenant": "ab"[i % 2]}) + "\n"
                            for i, row in enumerate(rows)))
    runs = [
        [str(chat), "--max-session-kv", "0.5", "--num-kv-blocks", "200"],
        [str(trace), "--num-kv-blocks", "30", "--preemption-mode", "swap",
         "--num-host-blocks", "60", "--max-model-len", "300"],  # swaps, refusals, cut short
        [str(trace), "--num-kv-blocks", "60", "--data-parallel-size", "2"],
        [str(trace), "--num-kv-blocks", "60", "--sweep", "max_num_seqs=2,4", "--workers", "1"],
    ]
    paths: set[str] = set()
    for number, argv in enumerate(runs):
        report = tmp_path / f"r{number}.json"
        assert main(["simulate", "--trace", *argv, "--quiet", "--report", str(report)]) == 0
        for path in key_paths(json.loads(report.read_text())):
            if path.startswith("config."):  # the settings' echo: documented by section
                path = ".".join(path.split(".")[:2])
            paths.add(path.replace("sweep.rows[].aggregate.", "aggregate."))
    assert {"aggregate.sessions.session_hits", "aggregate.tenants.a.service",
            "aggregate.swapped_out_blocks", "requests[].num_swaps", "replicas[].replica",
            "router.prefix_hit_share", "sweep.rows[].value"} <= paths  # the modes ran
    assert undocumented(paths, "`simulate --report`") == []


def test_an_undocumented_key_is_caught():
    """The check itself: a key the tables do not name is reported, a data key is not."""
    assert undocumented({"aggregate.ttft_p99", "aggregate.finish_reasons.stop",
                         "aggregate.ttft_p42", "sweep[].new_figure"},
                        "`simulate --report`") == ["aggregate.ttft_p42", "sweep[].new_figure"]

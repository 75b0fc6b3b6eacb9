"""The engine half's section: the engine's figures (median of the rounds, min-max), the
calibrated simulator's prediction beside them, whether the two order the configurations
alike, and the per-request breakdown that explains the conversations' ordering."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from data_parallel_engine import CONFIGS, key

FIGURES = ("prefix_hit_rate", "ttft_p50", "ttft_p90", "e2e_p50", "e2e_p90", "queue_p50",
           "queue_p90", "computed_prompt_tokens", "output_tok_s", "busiest_replica_share")


def ms(value: float) -> str:
    return f"{value * 1000:,.0f}"


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds, and its range."""
    out: dict[str, Any] = {}
    for figure in FIGURES:
        values = [r[figure] for r in runs]
        out[figure] = statistics.median(values)
        out[figure + "_range"] = (min(values), max(values))
    decisions: dict[str, int] = {}
    for r in runs:
        for reason, count in r["decisions"].items():
            decisions[reason] = decisions.get(reason, 0) + count
    out["decisions"] = {k: round(v / len(runs), 1) for k, v in sorted(decisions.items())}
    return out


def _spread(m: dict[str, Any], figure: str, fmt: Any) -> str:
    low, high = m[figure + "_range"]
    if fmt(low) == fmt(high):
        return fmt(m[figure])
    return f"{fmt(m[figure])} ({fmt(low)}-{fmt(high)})"


def _label(config: tuple[int, int, str]) -> str:
    return f"| {config[0]} x {config[1]} | {config[2] if config[0] > 1 else '—'} |"


def engine_table(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["| replicas x threads | router | prefix hit rate | TTFT p50 ms | TTFT p90 ms | "
             "E2E p50 ms | queue p90 ms | output tok/s | busiest replica's share | "
             "decisions (per round) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for config in CONFIGS:
        m = medians(runs[key(config)])
        lines.append(
            f"{_label(config)} {_spread(m, 'prefix_hit_rate', lambda v: f'{v:.1%}')} | "
            f"{_spread(m, 'ttft_p50', ms)} | {_spread(m, 'ttft_p90', ms)} | "
            f"{_spread(m, 'e2e_p50', ms)} | {_spread(m, 'queue_p90', ms)} | "
            f"{m['output_tok_s']:,.1f} | {m['busiest_replica_share']:.0%} | "
            f"{', '.join(f'{k} {v:g}' for k, v in m['decisions'].items())} |")
    return lines


def sim_table(sim: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| replicas x threads | router | prefix hit rate | TTFT p50 ms | TTFT p90 ms | "
             "E2E p50 ms | queue p90 ms | output tok/s | busiest replica's share |",
             "|---|---|---|---|---|---|---|---|---|"]
    for config in CONFIGS:
        s = sim[key(config)]
        lines.append(f"{_label(config)} {s['prefix_hit_rate']:.1%} | {ms(s['ttft_p50'])} | "
                     f"{ms(s['ttft_p90'])} | {ms(s['e2e_p50'])} | {ms(s['queue_p90'])} | "
                     f"{s['output_tok_s']:,.1f} | {s['busiest_replica_share']:.0%} |")
    return lines


def breakdown(runs: dict[str, list[dict[str, Any]]], sim: dict[str, dict[str, Any]],
              ) -> list[str]:
    """Where each configuration's time to first token goes, engine (median round) against
    simulated: prompt tokens computed per request (the rest hit the cache), queueing on the
    replica, and how unevenly the requests spread."""
    lines = ["| replicas x threads | router | computed prompt tokens a request (engine / sim) | "
             "queue p50 ms (engine / sim) | queue p90 ms (engine / sim) | "
             "TTFT p50 ms (engine / sim) |", "|---|---|---|---|---|---|"]
    for config in CONFIGS:
        m, s = medians(runs[key(config)]), sim[key(config)]
        lines.append(f"{_label(config)} {m['computed_prompt_tokens']:,.0f} / "
                     f"{s['computed_prompt_tokens']:,.0f} | {ms(m['queue_p50'])} / "
                     f"{ms(s['queue_p50'])} | {ms(m['queue_p90'])} / {ms(s['queue_p90'])} | "
                     f"{ms(m['ttft_p50'])} / {ms(s['ttft_p50'])} |")
    return lines


def pair(runs: dict[str, list[dict[str, Any]]], sim: dict[str, dict[str, Any]], figure: str,
         a: tuple[int, int, str], b: tuple[int, int, str]) -> dict[str, Any]:
    """Whether configuration ``a`` beats ``b`` on ``figure`` (lower is better, except the
    hit rate), on the engine (medians) and simulated, and whether the two agree."""
    engine = [medians(runs[key(c)])[figure] for c in (a, b)]
    simulated = [sim[key(c)][figure] for c in (a, b)]
    higher = figure == "prefix_hit_rate"

    def wins(x: list[float]) -> bool:
        return x[0] > x[1] if higher else x[0] < x[1]
    return {"figure": figure, "a": key(a), "b": key(b), "engine": engine,
            "simulated": simulated, "engine_a_wins": wins(engine),
            "sim_a_wins": wins(simulated), "agree": wins(engine) == wins(simulated)}


def verdict(name: str, runs: dict[str, list[dict[str, Any]]],
            sim: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Prefix affinity against round robin (where prefixes are shared), and one replica of
    two threads against two of one, on the engine and simulated."""
    one, rr, pa = CONFIGS[0], CONFIGS[1], CONFIGS[3]
    checks = [pair(runs, sim, "ttft_p50", one, rr), pair(runs, sim, "e2e_p50", one, rr)]
    if any(r["prefix_hit_rate"] for r in runs[key(pa)]):
        checks = [pair(runs, sim, "prefix_hit_rate", pa, rr),
                  pair(runs, sim, "ttft_p50", pa, rr), *checks]
    fmt = {"prefix_hit_rate": lambda v: f"{v:.1%}", "ttft_p50": lambda v: f"{ms(v)} ms",
           "e2e_p50": lambda v: f"{ms(v)} ms"}
    names = {"prefix_hit_rate": "prefix hit rate", "ttft_p50": "TTFT p50",
             "e2e_p50": "E2E p50"}
    parts = []
    for c in checks:
        f = fmt[c["figure"]]
        parts.append(f"{c['a']} against {c['b']}, {names[c['figure']]}: "
                     f"{f(c['engine'][0])} vs {f(c['engine'][1])} on the engine, "
                     f"{f(c['simulated'][0])} vs {f(c['simulated'][1])} simulated "
                     f"(**{'agree' if c['agree'] else 'disagree'}**)")
    return f"*{name}*: " + "; ".join(parts) + ".", {
        "checks": checks, "all_agree": all(c["agree"] for c in checks)}


def _calibration_line(path: str | None, who: str) -> str:
    if not path:
        return f"{who}: none given, so the uncalibrated cpu-local roofline (this machine's " \
               "peak rates: its times are not the engine's)"
    data = json.loads(Path(path).read_text())
    terms = ", ".join(f"{k} {v:.3g}" for k, v in data["coefficients"].items() if v)
    return f"{who}: `{Path(path).name}` ({data.get('source', '')}; {terms}; " \
           f"min_tokens {data.get('min_tokens', 0)})"


def engine_section(results: dict[str, Any], simulated: dict[str, Any],
                   traces: dict[str, list[Any]], machine: str, calibration: str | None,
                   calibration_two_threads: str | None) -> tuple[str, dict[str, Any]]:
    """The whole "Data parallel on the engine" section, and its rows for --json."""
    p = results["params"]
    conv = traces["conversations"]
    pieces = results["pieces"]
    loads = [x for piece in pieces for x in (piece["load_before"], piece["load_after"])]
    lines = [
        "### Data parallel on the engine", "",
        "Pieces run under the bench lock (each appends its rounds to one results file): "
        + "; ".join(f"`{x['command']}` at {x['started']} UTC ({x['rounds']} round(s))"
                    for x in pieces)
        + f". On {machine}; load average (1 min) {min(loads):.1f}-{max(loads):.1f} at the "
        "pieces' starts and ends (other helpers' tests and simulations ran at nice 19).", "",
        f"**Traces.** *conversations*: {len(conv)} requests of "
        f"{len({r.request_id.split('-')[0] for r in conv})} conversations starting at "
        f"{p['engine_rate']:g}/s, 3-6 turns {p['think_time']:g} s apart on average, each "
        "turn's prompt the conversation so far plus 64-160 new tokens "
        f"({sum(r.num_prompt_tokens for r in conv) / len(conv):,.0f} prompt tokens a request "
        "on average), 16-32 tokens out." + (
            f" *w3*: W3's first {p['w3_requests']} requests at {p['w3_rate']:g}/s (prompts "
            "64-512 tokens, 32-256 out, no shared prefixes)." if "w3" in traces else "")
        + " Greedy, ignore_eos; the bundled SmolLM2-135M in bf16, each replica an engine "
        f"process with a 1 GiB KV pool and OMP_WAIT_POLICY={p['wait_policy']}, other flags "
        f"at their defaults. Each configuration ran {results['rounds_done']} times, the "
        "order reversed every round; each cell is the median of the rounds, (min-max) when "
        "they differ. TTFT and E2E are measured in the calling process (the replica's pipe "
        "included), queue time on the replica (first scheduled - arrival); the prefix hit "
        "rate is the replicas' own counters.", "",
        "**The simulator**, on the same trace files (`" + simulated["conversations"][
            key(CONFIGS[1])]["command"] + "`, the replicas and router varied), with the cost "
        "model calibrated on this engine:", "",
        "- " + _calibration_line(calibration, "2 x 1 rows, one replica with one thread"),
        "- " + _calibration_line(calibration_two_threads,
                                 "1 x 2 row, one replica with two threads")]
    rows: dict[str, Any] = {"params": p, "rounds": results["rounds_done"], "traces": {}}
    for name in traces:
        runs = results["runs"][name]
        text, agree = verdict(name, runs, simulated[name])
        lines += ["", f"#### {name}: the engine", "", *engine_table(runs), "",
                  f"#### {name}: the calibrated simulator's prediction", "",
                  *sim_table(simulated[name]), "", text]
        if name == "conversations":
            lines += ["", "Where the time goes (engine median / simulated):", "",
                      *breakdown(runs, simulated[name])]
        rows["traces"][name] = {
            "engine": {k: medians(v) for k, v in runs.items()}, "runs": runs,
            "simulated": simulated[name], **agree}
    return "\n".join(lines), rows

#!/usr/bin/env python
"""Multi-turn chat with sessions off, on, and on with lpm (docs/scheduler.md, U): in the
simulator, and briefly on the engine.

1. Simulator: ``kvserve workload gen --sessions`` conversations (default 32 x 4 turns, mean
   think time 2 s, new text 64-192 tokens and answers 32-128 tokens per turn), each turn
   sent only after the previous answer (closed loop), on a KV pool sized to about half of
   the conversations' final length together. Runs: sessions off (prefix caching only),
   ``--max-session-kv 0.5``, and that with ``--scheduling-policy lpm``. Figures: TTFT p50
   and p99 of the later turns (turn 2 on), the tokens computed (prefill, decode and
   recomputation: what sessions save), the prompt tokens found held or cached, and
   preemptions.
2. Engine (the bundled model, greedy, ``ignore_eos``): a few conversations driven closed
   loop by this script, each turn's prompt the conversation so far (the model's real
   answers) plus new tokens, sessions off and on, on a pool too small to keep every
   conversation cached. Figures as above, plus whether every answer is the same in both.

    python benchmarks/sessions.py [--conversations 32] [--turns 4] [--think 2.0]
        [--engine-conversations 6] [--engine-turns 3] [--skip-engine] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from docs_section import publish
from sched_ab import cpu_description

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16


def kvserve(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-m", "kvserve", *args], check=True, env=env,
                   capture_output=True, text=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def simulate_runs(args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], str,
                                                                 int]:
    trace = work / "chat.jsonl"
    gen = ["workload", "gen", "--num-requests", str(args.conversations * args.turns),
           "--rate", str(args.rate), "--turns", f"fixed:{args.turns}", "--think-time",
           str(args.think), "--prompt-len", "uniform:64,192", "--output-len",
           "uniform:32,128", "--sessions", "--seed", "0", "-o", str(trace)]
    kvserve(*gen)
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line]
    finals: dict[str, int] = {}
    for row in rows:  # a conversation's last turn holds it all
        finals[row["session_id"]] = row["prompt_len"] + row["output_len"]
    num_blocks = sum(finals.values()) // 2 // BLOCK_SIZE
    base = ["simulate", "--trace", str(trace), "--model", "smollm2-135m", "--hardware",
            "cpu-local", "--num-kv-blocks", str(num_blocks), "--max-num-seqs", "32",
            "--quiet"]
    runs = [("off", []), ("on", ["--max-session-kv", "0.5"]),
            ("on + lpm", ["--max-session-kv", "0.5", "--scheduling-policy", "lpm"])]
    out = []
    for name, extra in runs:
        report_path = work / f"{name.replace(' ', '')}.json"
        kvserve(*base, *extra, "--report", str(report_path))
        report = json.loads(report_path.read_text())
        later = [r["ttft_s"] for r in report["requests"]
                 if not r["request_id"].endswith("-t0") and r["ttft_s"] is not None]
        agg = report["aggregate"]
        out.append({"run": name, "ttft_p50": percentile(later, 50),
                    "ttft_p99": percentile(later, 99),
                    "computed": agg["scheduled_tokens"],
                    "hit": sum(r["cached_tokens"] for r in report["requests"]),
                    "preemptions": agg["num_preemptions"],
                    "sessions": agg.get("sessions")})
    command = ("kvserve " + " ".join(gen[:-2]) + " -o chat.jsonl; kvserve "
               + " ".join([*base[:2], "chat.jsonl", *base[3:]])
               + " [--max-session-kv 0.5 [--scheduling-policy lpm]]")
    return out, command, num_blocks


def engine_runs(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool, int]:
    sys.path.insert(0, str(ROOT / "src"))
    from kvserve.core import SamplingParams
    from kvserve.engine.llm import build_engine

    new_lens = [(160 + 37 * i) % 200 + 100 for i in range(args.engine_conversations
                                                             * args.engine_turns)]
    final = sum(new_lens) + len(new_lens) * args.engine_output
    num_blocks = max(final // 2 // BLOCK_SIZE, 64)
    results, answers = [], []
    for name, kv in (("off", 0.0), ("on", 0.5)):
        engine = build_engine(None, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
                              detokenize=False, max_session_kv=kv, max_num_seqs=16)
        convs = [{"history": [], "turn": 0, "due": 0.25 * c, "live": None}
                 for c in range(args.engine_conversations)]
        ttfts, hits, mine = [], 0, {}
        start = time.monotonic()
        while any(c["turn"] < args.engine_turns or c["live"] for c in convs):
            now = time.monotonic() - start
            for index, conv in enumerate(convs):
                if conv["live"] is None and conv["turn"] < args.engine_turns and \
                        now >= conv["due"]:
                    k = index * args.engine_turns + conv["turn"]
                    prompt = conv["history"] + [(7 * j + 13 * k) % 30000 + 100
                                                for j in range(new_lens[k])]
                    request_id = f"c{index}-t{conv['turn']}"
                    params = SamplingParams(max_tokens=args.engine_output, temperature=0.0,
                                            ignore_eos=True,
                                            session_id=f"c{index}" if kv else None)
                    engine.add_request(request_id, prompt, params)
                    conv["live"], conv["prompt"] = request_id, prompt
                    mine[request_id] = []
            if not engine.has_unfinished_requests():
                time.sleep(0.01)
                continue
            for chunk in engine.step().chunks:
                mine[chunk.request_id] += chunk.new_token_ids
                if not chunk.finished:
                    continue
                index, turn = (int(x) for x in chunk.request_id[1:].split("-t"))
                conv = convs[index]
                conv["history"] = conv["prompt"] + mine[chunk.request_id]
                conv["live"], conv["turn"] = None, turn + 1
                conv["due"] = time.monotonic() - start + args.engine_think
                metrics = chunk.metrics
                if turn > 0 and metrics is not None and metrics.first_token_time is not None:
                    ttfts.append(metrics.first_token_time - metrics.arrival_time)
                    hits += metrics.num_cached_tokens
        stats = engine.scheduler.stats()
        answers.append(mine)
        results.append({"run": name, "ttft_p50": percentile(ttfts, 50),
                        "ttft_p99": percentile(ttfts, 99), "computed":
                        stats.num_scheduled_tokens, "hit": hits,
                        "preemptions": stats.num_preemptions,
                        "sessions": {"session_hits": stats.num_session_hits,
                                     "session_releases": stats.session_releases}
                        if kv else None})
    return results, answers[0] == answers[1], num_blocks


def table(rows: list[dict[str, Any]]) -> str:
    off = rows[0]["computed"]
    lines = ["| run | later turns' TTFT p50 / p99 (s) | tokens computed | saved vs off | "
             "prompt tokens held or cached | preemptions | sessions |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        sessions = row["sessions"]
        note = "" if not sessions else (f"{sessions['session_hits']} hits, releases "
                                        f"{json.dumps(sessions['session_releases'])}")
        lines.append(f"| {row['run']} | {row['ttft_p50']:.3f} / {row['ttft_p99']:.3f} | "
                     f"{row['computed']:,} | {1 - row['computed'] / off:.1%} | "
                     f"{row['hit']:,} | {row['preemptions']} | {note} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--think", type=float, default=2.0)
    parser.add_argument("--rate", type=float, default=4.0,
                        help="conversation starts per second")
    parser.add_argument("--engine-conversations", type=int, default=6)
    parser.add_argument("--engine-turns", type=int, default=3)
    parser.add_argument("--engine-output", type=int, default=16)
    parser.add_argument("--engine-think", type=float, default=0.5)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        sim_rows, sim_command, sim_blocks = simulate_runs(args, Path(work))
    section = [
        "### Sessions: multi-turn chat with held KV (issue 13)", "",
        f"Measured on {cpu_description()}, Python {platform.python_version()}; load average "
        f"{load_before:.1f} at the start (2 cores shared with other work). Later turns: "
        "turn 2 on; each turn is sent when the previous answer is complete (closed loop). "
        "'Tokens computed' counts prefill, decode and recomputation. The simulator's "
        "figures are on its virtual clock: the machine's load does not change them.", "",
        f"Simulator, `{sim_command}` ({args.conversations} conversations x {args.turns} "
        f"turns, think time {args.think} s, {sim_blocks} KV blocks of {BLOCK_SIZE}: about "
        "half of the conversations' final length together; smollm2-135m on cpu-local):", "",
        table(sim_rows)]
    rows: dict[str, Any] = {"simulator": sim_rows}
    if not args.skip_engine:
        engine_rows, same, engine_blocks = engine_runs(args)
        rows["engine"] = engine_rows
        command = " ".join(["python benchmarks/sessions.py", *sys.argv[1:]])
        section += ["", f"Engine, `{command}` (the bundled model, greedy, "
                    f"{args.engine_conversations} conversations x {args.engine_turns} turns, "
                    f"100-299 new tokens and {args.engine_output}-token answers per turn, "
                    f"think time {args.engine_think} s, {engine_blocks} KV blocks; answers "
                    f"{'identical' if same else 'DIFFERENT'} with sessions on and off; "
                    f"load average {os.getloadavg()[0]:.1f} at the end):", "",
                    table(engine_rows)]
    publish("sessions", "\n".join(section), [rows], args.json, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

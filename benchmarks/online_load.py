#!/usr/bin/env python
"""Online load against `kvserve serve` with `kvserve bench serve`, then a disconnect soak.

1. W3 of ../shared/WORKLOADS.md: 200 requests, Poisson arrivals at 4 req/s (seed 1), prompt
   lengths uniform in [64, 512] (token ids), max_tokens uniform in [32, 256], greedy,
   ignore_eos, streaming. Figures: TTFT / ITL p50 and p99, output tok/s, req/s, preemptions.
2. Soak: 200 clients at once that each go away mid-stream at a random token; then the server
   must drain to 0 running, 0 waiting and 0% KV usage (polled with a deadline).

    python benchmarks/online_load.py [--dtype bfloat16] [--n 200] [--write-docs]
                                     [-- extra kvserve serve flags]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
OUT = ROOT / "out"
BEGIN, END = "<!-- online_load:begin -->", "<!-- online_load:end -->"
W3_FIRST_IDS = [33454, 26203, 39617, 11871, 7233]  # ../shared/WORKLOADS.md
KVSERVE = str(Path(sys.executable).with_name("kvserve"))
PEERS = ("vLLM CPU 0.32.0 (bf16): TTFT p50/p99 1.61 s / 27.6 s, ITL p50/p99 218 ms / "
         "1.35 s, 311 output tok/s; llama.cpp: TTFT 329 s / 671 s, 40 output tok/s")


def w3_count(text: str) -> int:
    """--n: how many of W3's 200 requests (an argparse type: one line for a bad value; QA:
    --n 250 was an IndexError after the parse)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= n <= 200:
        raise argparse.ArgumentTypeError(f"W3 has 200 requests: give 1 to 200, not {n}")
    return n


def w3_trace(path: Path, n: int = 200) -> None:
    """The exact W3 draw (numpy default_rng(1): lengths, max_tokens, gaps, then prompts)."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(64, 513, size=200)
    max_tokens = rng.integers(32, 257, size=200)
    gaps = rng.exponential(1.0 / 4.0, size=200)
    arrivals = np.cumsum(gaps) - gaps[0]
    prompts = [rng.integers(1000, 40000, size=int(length)).tolist() for length in lengths]
    assert prompts[0][:5] == W3_FIRST_IDS, "W3 generator drifted from WORKLOADS.md"
    with path.open("w") as file:
        for index in range(n):
            file.write(json.dumps({
                "request_id": f"w3-{index}", "arrival_time": float(arrivals[index]),
                "prompt_token_ids": prompts[index], "output_len": int(max_tokens[index]),
                "max_tokens": int(max_tokens[index]), "ignore_eos": True}) + "\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, dtype: str, extra: list[str], log: Path) -> subprocess.Popen:
    command = [KVSERVE, "serve", "--port", str(port), "--dtype", dtype,
               "--log-stats-interval", "10", *extra]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    import httpx
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"kvserve serve exited: see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("kvserve serve did not come up in 300 s")


def bench(url: str, args: list[str], output: Path) -> dict:
    subprocess.run([KVSERVE, "bench", "serve", "--base-url", url, "--output", str(output),
                    *args], check=True)
    return json.loads(output.read_text())


def gauges(url: str) -> dict[str, float]:
    import httpx
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        match = re.match(r"^(vllm:[a-z_]+)\{[^}]*\}\s+(\S+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def drain(url: str, timeout: float = 120.0) -> tuple[float, dict[str, float]]:
    """Seconds until nothing runs, nothing waits and the KV cache is empty."""
    start = time.monotonic()
    while True:
        values = gauges(url)
        if values.get("vllm:num_requests_running") == 0 and \
                values.get("vllm:num_requests_waiting") == 0 and \
                values.get("vllm:kv_cache_usage_perc") == 0:
            return time.monotonic() - start, values
        if time.monotonic() - start > timeout:
            raise SystemExit(f"the server did not drain in {timeout} s: {values}")
        time.sleep(0.2)


def section(w3: dict, soak: dict, drain_s: float, command: str, dtype: str, n: int,
            serve_flags: list[str]) -> str:
    t, i = w3["ttft"], w3["itl"]
    flags = f" and `{' '.join(serve_flags)}`" if serve_flags else ""
    return "\n".join([
        BEGIN, "## Online load", "",
        f"`{command}` on {platform.machine()}, {os.cpu_count()} cores shared with other jobs. "
        f"`kvserve serve` with the bundled SmolLM2-135M-Instruct in {dtype}, the default "
        f"1 GiB KV cache{flags}; W3 of ../shared/WORKLOADS.md sent by `kvserve bench serve "
        f"--trace` (the first {n} of its 200 requests, Poisson 4 req/s, prompts 64-512 token "
        "ids, max_tokens 32-256, "
        "greedy, ignore_eos, streaming). The arrival rate overloads every engine on this "
        "machine, so this measures behaviour under overload; this run does not separate "
        "server overhead from model time.", "",
        "| figure | kvserve |", "|---|---|",
        f"| completed / failed | {w3['completed']} / {w3['failed']} |",
        f"| duration | {w3['duration_s']:.1f} s |",
        f"| TTFT p50 / p99 | {t['p50_ms'] / 1000:.2f} s / {t['p99_ms'] / 1000:.2f} s |",
        f"| ITL p50 / p99 | {i['p50_ms']:.0f} ms / {i['p99_ms']:.0f} ms |",
        f"| output tok/s | {w3['output_throughput']:.0f} |",
        f"| requests/s | {w3['request_throughput']:.2f} |",
        f"| preemptions (from /metrics) | {w3['preemptions']:.0f} |", "",
        f"Peers on the same workload (WORKLOADS.md): {PEERS}.", "",
        f"Disconnect soak: {soak['num_requests']} streaming clients at once, each gone at a "
        f"random token ({soak['disconnected']} disconnected, {soak['completed']} finished "
        f"before its chosen token, {soak['failed']} failed); the "
        f"server drained to 0 running, 0 waiting and 0% KV usage {drain_s:.1f} s after the "
        "last client left.", END, ""])


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        doc = head + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    DOCS.write_text(doc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--n", type=w3_count, default=200, help="W3 requests (first n)")
    parser.add_argument("--soak-clients", type=int, default=200)
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("serve_flags", nargs="*", help="extra kvserve serve flags (after --)")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    trace = OUT / "w3-trace.jsonl"
    w3_trace(trace, args.n)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, args.dtype, args.serve_flags, OUT / "online_load_server.log")
    try:
        w3 = bench(url, ["--trace", str(trace), "--no-progress"], OUT / "online_load_w3.json")
        _, idle = drain(url)
        soak = bench(url, ["--num-prompts", str(args.soak_clients), "--input-len", "64:512",
                           "--output-len", "32:256", "--request-rate", "inf",
                           "--disconnect-prob", "1", "--seed", "2", "--no-progress"],
                     OUT / "online_load_soak.json")
        drain_s, after = drain(url)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    command = "python benchmarks/online_load.py " + " ".join(sys.argv[1:])
    text = section(w3, soak, drain_s, command.strip(), args.dtype, args.n,
                   args.serve_flags)
    print(text)
    print(json.dumps({"w3": w3, "soak": soak, "drain_s": drain_s, "after": after,
                      "idle_before_soak": idle}, indent=2), file=sys.stderr)
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

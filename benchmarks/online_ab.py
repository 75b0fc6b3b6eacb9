#!/usr/bin/env python
"""W3 online, `vllm serve` (vLLM's CPU build) and `kvserve serve` alternately, vLLM first.

Both servers get the same settings (``--dtype``: bf16 where the CPU computes it natively,
float32 elsewhere; 2 GiB of KV cache, prefix caching off, max model length 1024) and the
same client, ../shared/bench/load_client.py (streaming /v1/completions, token-id prompts,
greedy, ignore_eos, one warm-up request first), run by the vLLM venv's Python (it has
aiohttp). Both servers start once, before the first pair, and stay up (idle,
prefix caching off, so nothing carries over) while the other side runs: a vLLM start compiles
for minutes, which on a loaded 2-core machine is longer than a run. vLLM runs
from the scratch venv ../shared/bench/setup_vllm.sh builds (under $PEERS_DIR, default
/tmp/peers) with vllm_env.sh's settings (2 OpenMP threads bound to cores 0-1, tcmalloc and
Intel OpenMP preloaded); kvserve runs from this checkout. The figures follow
benchmarks/ab_protocol.py; with --write-docs the table for this CPU in docs/benchmarks.md is
replaced. Run it under the bench lock, on as quiet a machine as you can get:

    flock /tmp/kvserve-bench.lock python benchmarks/online_ab.py --pairs 5 --write-docs
    python benchmarks/online_ab.py --pairs 1 --requests 20        # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import ab_protocol as ab
from docs_section import publish

ROOT = Path(__file__).resolve().parents[1]
BENCH = ab.shared_bench()
PEERS = Path(os.environ.get("PEERS_DIR", Path(tempfile.gettempdir()) / "peers"))
VLLM_PYTHON = PEERS / "venvs/vllm/bin/python"
OUT = ROOT / "out"
W3_ARRIVAL_RATE = 4.0  # requests/s (WORKLOADS.md)
FIGURES = [
    ab.Figure("output_tok_s", "output tok/s", True, "{:.0f}"),
    ab.Figure("wall_s", "wall s", False),
    ab.Figure("ttft_p50_s", "TTFT p50 s", False, "{:.2f}"),
    ab.Figure("ttft_p99_s", "TTFT p99 s", False, "{:.2f}"),
    ab.Figure("itl_p50_ms", "ITL p50 ms", False, "{:.0f}"),
    ab.Figure("itl_p99_ms", "ITL p99 ms", False, "{:.0f}"),
]
SHARED = ["--host", "127.0.0.1", "--max-model-len", "1024", "--served-model-name", "smollm2"]
PEAK = {"bfloat16": "bf16_flops", "float32": "fp32_flops"}  # the roofline's matmul rate


def vllm_command(port: int, dtype: str) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="0-1",
               LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:"
                          f"{PEERS / 'venvs/vllm/lib/libiomp5.so'}")
    # (the `vllm` entry point fails in vllm-cpu, ../shared/bench/bench_vllm_serve.sh says why)
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(PEERS / "smollm2-hf"), "--port", str(port), *SHARED, "--dtype", dtype,
            "--kv-cache-memory-bytes", str(2 << 30), "--no-enable-prefix-caching"], env


def kvserve_command(port: int, extra: list[str], dtype: str
                    ) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return [sys.executable, "-m", "kvserve", "serve", "--port", str(port), *SHARED,
            "--dtype", dtype,
            "--kv-cache-memory", "2GiB", "--no-enable-prefix-caching",
            "--log-stats-interval", "0", *extra], env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}): see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not healthy after {timeout:.0f} s: see {log}")


def stop(process: subprocess.Popen) -> None:
    """SIGINT then SIGKILL to the server's whole process group (vLLM has child processes)."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Server:
    """One side's server, started once: ``run()`` sends it W3 through the load client."""

    def __init__(self, side: str, extra: list[str], dtype: str) -> None:
        self.side = side
        port = free_port()
        command, env = vllm_command(port, dtype) if side == "vllm" else \
            kvserve_command(port, extra, dtype)
        self.log = OUT / f"online_ab_{side}.log"
        with self.log.open("w") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"

    def wait(self) -> None:
        wait_healthy(self.url, self.process, self.log)

    def run(self, pair: int, requests: int) -> dict:
        out = OUT / f"online_ab_{self.side}_{pair}.json"
        client_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        subprocess.run([str(VLLM_PYTHON), str(BENCH / "load_client.py"), "--base-url",
                        self.url, "--workload", "w3", "--n", str(requests), "--warmup",
                        "--max-duration", "1800", "--json", str(out)],
                       check=True, env=client_env, stdout=subprocess.DEVNULL)
        summary = json.loads(out.read_text())["summary"]
        summary["ttft_p50_s"] = summary["ttft_p50_ms"] / 1000
        summary["ttft_p99_s"] = summary["ttft_p99_ms"] / 1000
        return summary

    def stop(self) -> None:
        stop(self.process)


def floor_s(run: dict, requests: int, peaks: dict[str, float] | None, dtype: str
            ) -> float | None:
    """The run's least possible wall time: its matmul work at the dtype's peak, or the last
    arrival (about requests / 4 s), whichever is longer."""
    if not peaks:
        return None
    work = ab.roofline_floor_s(run["prompt_tokens"], run["output_tokens"], peaks[PEAK[dtype]])
    return max(work, (requests - 1) / W3_ARRIVAL_RATE)


def w3_cells(r: dict) -> str:
    """A W3 run's figures as table cells: tok/s, wall, TTFT p50 / p99, ITL p50 / p99,
    completed / failed (online_knob.py's rows too)."""
    return (f"{r['output_tok_s']:.0f} | {r['wall_s']:.1f} | "
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
            f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} | {r['completed']} / {r['failed']}")


def run_row(pair: int, side: str, r: dict, conditions: ab.Conditions,
            floor: float | None) -> str:
    fraction = "-" if floor is None else f"{floor / r['wall_s']:.2f}"
    return f"| {pair} | {side} | {w3_cells(r)} | {conditions} | {fraction} |"


def section(args: argparse.Namespace, model: str, flags: str, peaks: dict[str, float] | None,
            runs: dict[str, list[dict]], rows: list[str], pairs_done: int) -> str:
    command = ab.kernel_env() + "python benchmarks/online_ab.py " + " ".join(sys.argv[1:])
    done = "" if pairs_done == args.pairs else f" (cut short: {pairs_done} pairs done)"
    return "\n".join([
        f"### W3 online against vLLM on {ab.cpu_title(model, flags)}{done}", "",
        f"`flock /tmp/kvserve-bench.lock {command.strip()}` on "
        f"{ab.machine_line(model, flags, peaks)}. The first {args.requests} requests of W3 "
        "(../shared/WORKLOADS.md) through ../shared/bench/load_client.py against `vllm serve` "
        "(vllm-cpu 0.32.0, torch.compile) and `kvserve serve` alternately, vLLM first; each "
        f"server started once and idle while the other runs; both {args.dtype}, 2 GiB KV, prefix "
        "caching off, max model length 1024, each side's own defaults otherwise (vLLM's CPU "
        "server: 128 seats, 2,048 batched tokens; kvserve: 256 seats, 2,048). The machine is "
        "shared with other jobs: each run's load average before it, steal time during it and "
        "a 1024^3 bf16 matmul's rate just before it are in the rows. Roofline: the run's "
        f"matmul work at the measured {args.dtype} peak, or the last arrival if later, over "
        "its wall time.", "",
        *ab.summary_table(ab.summarize(FIGURES, runs["vllm"], runs["kvserve"])), "",
        "| pair | server | output tok/s | wall s | TTFT p50 / p99 s | ITL p50 / p99 ms | "
        "completed / failed | load / steal / bf16 GFLOP/s | roofline fraction |",
        "|---|---|---|---|---|---|---|---|---|", *rows])


def prepare(args: argparse.Namespace) -> tuple[str, str] | None:
    """What every W3 script here needs before its servers start: the vLLM venv (its Python
    runs the load client, and vLLM), out/, and this CPU's model and flags, ``args.dtype``
    resolved on them; None, said on stderr, where the venv is missing."""
    if not VLLM_PYTHON.exists():
        print(f"no vLLM venv under {PEERS}: run ../shared/bench/setup_vllm.sh first",
              file=sys.stderr)
        return None
    OUT.mkdir(exist_ok=True)
    model, flags = ab.cpu()
    if args.dtype == "auto":
        args.dtype = ab.fast_dtype(flags)
    return model, flags


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="first N of W3 (smoke: 20)")
    parser.add_argument("--no-peaks", action="store_true",
                        help="skip measuring this machine's peaks (no roofline column)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="both servers' dtype (auto: bfloat16 where the CPU computes it "
                             "natively, AMX or AVX512-BF16; float32 elsewhere)")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("serve_flags", nargs="*", help="extra kvserve serve flags (after --)")
    args = parser.parse_args()
    if args.pairs < 1 or not 1 <= args.requests <= 200:
        print("--pairs must be >= 1 and --requests in [1, 200]", file=sys.stderr)
        return 2
    machine = prepare(args)
    if machine is None:
        return 2
    model, flags = machine
    peaks = None if args.no_peaks else ab.measure_peaks()
    runs: dict[str, list[dict]] = {"vllm": [], "kvserve": []}
    rows: list[str] = []
    servers = [Server(side, args.serve_flags, args.dtype) for side in ("vllm", "kvserve")]
    try:
        for server in servers:
            server.wait()
        for pair in range(1, args.pairs + 1):
            for server in servers:
                result, conditions = ab.measured(
                    lambda server=server, pair=pair: server.run(pair, args.requests))
                runs[server.side].append(result)
                rows.append(run_row(pair, server.side, result, conditions,
                                    floor_s(result, args.requests, peaks, args.dtype)))
                print(rows[-1], flush=True)
            # each finished pair is published: a run cut short keeps what it measured
            publish(f"online_ab:{ab.cpu_slug(model, flags)}",
                    section(args, model, flags, peaks, runs, rows, pair),
                    write_docs=args.write_docs)
    finally:
        for server in servers:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""W1 / W2 offline, vLLM's CPU build and kvserve alternately (vLLM first), same machine.

vLLM runs from the scratch venv that ../shared/bench/setup_vllm.sh builds (under
$PEERS_DIR, default /tmp/peers) with ../shared/bench/vllm_env.sh's runtime settings;
kvserve runs benchmarks/offline_throughput.py. Both exclude model load; vLLM's script
warms up on two short requests first. The ratio is vLLM wall / kvserve wall per pair.

    python benchmarks/offline_ab.py [--pairs 2] [--workload w1 w2] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from docs_section import publish

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT.parent / "shared" / "bench"
PEERS = Path(os.environ.get("PEERS_DIR", Path(tempfile.gettempdir()) / "peers"))
# W1 in 2 GiB of KV on both sides (no preemption); W2 in 4,096 KV tokens with 64 seats
# (vLLM's CPU attention needs blocks of 32, so 128 x 32 against kvserve's 256 x 16).
VLLM_ARGS = {"w1": ["--kv-cache-gib", "2"],
             "w2": ["--kv-blocks", "128", "--block-size", "32", "--max-num-seqs", "64"]}
KVSERVE_ARGS = {"w1": ["--kv-cache-memory", "2GiB"], "w2": []}


def vllm_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="0-1",
               LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:"
                          f"{PEERS / 'venvs/vllm/lib/libiomp5.so'}")
    return env


def run_vllm(workload: str, out: Path) -> dict:
    subprocess.run([str(PEERS / "venvs/vllm/bin/python"), str(BENCH / "bench_vllm_offline.py"),
                    "--dtype", "bfloat16", "--json", str(out), *VLLM_ARGS[workload]],
                   check=True, env=vllm_env(), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_kvserve(workload: str, out: Path) -> dict:
    subprocess.run([sys.executable, str(ROOT / "benchmarks/offline_throughput.py"),
                    "--workload", workload, "--dtype", "bfloat16", "--json", str(out),
                    *KVSERVE_ARGS[workload]], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--workload", nargs="+", default=["w1", "w2"], choices=("w1", "w2"))
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if not (PEERS / "venvs/vllm/bin/python").exists():
        print(f"no vLLM venv under {PEERS}: run ../shared/bench/setup_vllm.sh first",
              file=sys.stderr)
        return 2
    lines = ["### Offline throughput, A/B against vLLM on this machine", "",
             f"`python benchmarks/offline_ab.py {' '.join(sys.argv[1:])}`: vLLM CPU (bf16, "
             "torch.compile) and kvserve (bf16) alternately, vLLM first, model load "
             "excluded. W1 in 2 GiB of KV cache on both sides; W2 in 4,096 KV tokens "
             "(vLLM 128 blocks of 32, its CPU attention's smallest; kvserve 256 of 16), "
             "max_num_seqs 64.", "",
             "| workload | pair | vLLM wall s | vLLM preemptions | kvserve wall s | "
             "kvserve preemptions | kvserve recomputed tokens | vLLM / kvserve |",
             "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        for workload in args.workload:
            ratios = []
            for pair in range(1, args.pairs + 1):
                vllm = run_vllm(workload, Path(scratch) / f"vllm-{workload}-{pair}.json")
                ours = run_kvserve(workload, Path(scratch) / f"ours-{workload}-{pair}.json")
                ratio = vllm["wall_s"] / ours["wall_s"]
                ratios.append(ratio)
                preempted = "?" if vllm["preemptions"] is None else f"{vllm['preemptions']:.0f}"
                row = (f"| {workload.upper()} | {pair} | {vllm['wall_s']:.1f} | "
                       f"{preempted} | {ours['wall_s']:.1f} | "
                       f"{ours['preemptions']} | {ours['recomputed_tokens']} | {ratio:.2f}x |")
                print(row, flush=True)
                lines.append(row)
            lines.append(f"| {workload.upper()} | median | | | | | | "
                         f"**{statistics.median(ratios):.2f}x** |")
    publish("offline_ab", "\n".join(lines), write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

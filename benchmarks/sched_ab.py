#!/usr/bin/env python
"""The scheduler's CPU cost at two git revisions, alternated in one run: did a change to
core/ make the default path slower?

Each revision's src/ is exported (``git archive``) to a temporary directory; each pair runs
``sched_overhead.measure`` (256 running decodes, 1,000 waiting) once per revision in a fresh
process, the order alternating from pair to pair so drifting machine load hits both sides.

    python benchmarks/sched_ab.py --before main --after HEAD [--pairs 5] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from docs_section import publish

ROOT = Path(__file__).resolve().parents[1]
MEASURE = ("import json, sys; sys.path[:0] = sys.argv[1:3]; import sched_overhead; "
           "print(json.dumps(sched_overhead.measure(int(sys.argv[3]), 1000, int(sys.argv[4]), "
           "sys.argv[5] == 'on', clock=sys.argv[6])))")


def export_src(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def measure(src: Path, running: int, steps: int, caching: bool, clock: str = "wall") -> dict:
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(src), str(ROOT / "benchmarks"), str(running),
         str(steps), "on" if caching else "off", clock],
        check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    return json.loads(result.stdout)


def cpu_description() -> str:
    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = [f for f in line.split(":", 1)[1].split() if f.startswith(
                    ("avx512f", "avx512_bf16", "amx", "avx2"))]
                break
    except OSError:
        pass
    return f"{model} ({', '.join(flags) or 'no AVX flags read'})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="main")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by wall clock or by the process's CPU time, which "
                             "other work on a loaded machine disturbs less")
    parser.add_argument("--section", default="sched_ab",
                        help="the docs/benchmarks.md section to write")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    revs = {}
    for name in (args.before, args.after):
        revs[name] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", name],
                                    check=True, capture_output=True, text=True).stdout.strip()
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {name: export_src(name, Path(tmp) / name.replace("/", "_")) for name in revs}
        for caching in (False, True):
            pairs = []
            for pair in range(args.pairs):
                order = [args.before, args.after][::1 if pair % 2 == 0 else -1]
                got = {name: measure(srcs[name], args.running, args.steps, caching,
                                     args.clock)["step_us"]
                       for name in order}
                pairs.append((got[args.before], got[args.after]))
                print(json.dumps({"caching": caching, "pair": pair, "before_us": got[
                    args.before], "after_us": got[args.after]}), flush=True)
            rows.append(dict(prefix_caching=caching, pairs=pairs, ratio=statistics.median(
                after / before for before, after in pairs)))
    load_after = os.getloadavg()[0]
    lines = [
        f"### Scheduler step cost: {args.after} ({revs[args.after]}) against {args.before} "
        f"({revs[args.before]})",
        "",
        f"`python benchmarks/sched_ab.py --before {args.before} --after {args.after} "
        f"--pairs {args.pairs} --running {args.running} --steps {args.steps}"
        f"{' --clock cpu' if args.clock == 'cpu' else ''}` on "
        f"{cpu_description()}, Python {platform.python_version()}; load average "
        f"{load_before:.1f} before, {load_after:.1f} after (2 cores shared with other work, so "
        f"single figures are noisy: compare the ratio). {args.running} running decodes, 1,000 "
        f"waiting; median step µs ({args.clock} clock) of {args.steps} timed steps per run; "
        "the order alternates.",
        "",
        "| prefix caching | before µs (range) | after µs (range) | after / before, median of "
        "pairs |",
        "|---|---|---|---|",
    ]
    for row in rows:
        before = [b for b, _ in row["pairs"]]
        after = [a for _, a in row["pairs"]]
        lines.append(f"| {'on' if row['prefix_caching'] else 'off'} | {min(before):.0f}–"
                     f"{max(before):.0f} | {min(after):.0f}–{max(after):.0f} | "
                     f"**{row['ratio']:.3f}** |")
    publish(args.section, "\n".join(lines) + "\n", rows, args.json, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The simulator's speed at two git revisions, alternated in one run: did a change make
``benchmarks/sim_speed.py`` slower?

Each revision's src/ is exported as sched_ab.py does; each pair runs this tree's
sim_speed.py once per revision in a fresh process, the order alternating from pair to pair.
The figure is the simulation's CPU seconds (``simulation CPU``), which other work on a loaded
machine disturbs far less than its wall time (recorded beside it).

    python benchmarks/sim_speed_ab.py --before main --after HEAD [--pairs 3] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from docs_section import publish
from sched_ab import ROOT, cpu_description, export_src


def measure(src: Path) -> dict[str, float]:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_speed.py")],
                         check=True, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(src)}).stdout
    figures = {}
    for key in ("wall", "CPU"):
        found = re.search(rf"^simulation {key}\s+([\d.]+) s", out, re.M)
        if found is None:
            raise RuntimeError(f"sim_speed.py printed no 'simulation {key}' line")
        figures[key] = float(found.group(1))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="main")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--section", default="sim_speed_ab",
                        help="the docs/benchmarks.md section to write")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    revs = {name: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", name],
                                 check=True, capture_output=True, text=True).stdout.strip()
            for name in (args.before, args.after)}
    load_before = os.getloadavg()[0]
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {name: export_src(name, Path(tmp) / name.replace("/", "_")) for name in revs}
        for pair in range(args.pairs):
            order = [args.before, args.after][::1 if pair % 2 == 0 else -1]
            got = {name: measure(srcs[name]) for name in order}
            pairs.append((got[args.before], got[args.after]))
            print(json.dumps({"pair": pair, "before": got[args.before],
                              "after": got[args.after]}), flush=True)
    load_after = os.getloadavg()[0]
    ratio = statistics.median(a["CPU"] / b["CPU"] for b, a in pairs)
    lines = [
        f"### Simulator speed: {args.after} ({revs[args.after]}) against {args.before} "
        f"({revs[args.before]})",
        "",
        f"`python benchmarks/sim_speed_ab.py --before {args.before} --after {args.after} "
        f"--pairs {args.pairs}` on {cpu_description()}, Python {platform.python_version()}; "
        f"load average {load_before:.1f} before, {load_after:.1f} after (2 cores shared with "
        "other work: compare the CPU ratio). sim_speed.py's 10,000-request trace; the order "
        "alternates.",
        "",
        "| pair | before CPU s (wall s) | after CPU s (wall s) | after / before, CPU |",
        "|---|---|---|---|",
    ]
    for index, (b, a) in enumerate(pairs):
        lines.append(f"| {index} | {b['CPU']:.2f} ({b['wall']:.2f}) | {a['CPU']:.2f} "
                     f"({a['wall']:.2f}) | {a['CPU'] / b['CPU']:.3f} |")
    lines.append(f"| median of pairs | | | **{ratio:.3f}** |")
    publish(args.section, "\n".join(lines) + "\n", [list(p) for p in pairs], args.json,
            args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Terminal tables for people (rich, imported lazily: the library never needs it)."""

from __future__ import annotations

from typing import Any


def fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.1f} ms"
    return f"{value:.2f} s"


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _console(file: Any = None) -> Any:
    from rich.console import Console

    return Console(file=file, width=110, highlight=False)


def _host_tier_rows(a: dict) -> list[tuple[str, str]]:
    """Swap figures, when the report has them (preemption mode swap or auto)."""
    if "swapped_out_blocks" not in a:
        return []
    by_mode = a["preemptions_by_mode"]
    return [("preemptions: swap / recompute / for urgent",
             f"{by_mode['swap']} / {by_mode['recompute']} / {by_mode['priority']}"),
            ("swapped out / in", f"{a['swapped_out_blocks']} / {a['swapped_in_blocks']} "
                                 f"blocks ({a['swapped_out_bytes'] / 2**30:.2f} GiB out)")]


def _session_rows(sessions: dict[str, Any]) -> list[tuple[str, str]]:
    """With --max-session-kv: turns started from held KV and why holds ended (the figures
    were in the --report JSON only)."""
    if "session_hits" not in sessions:
        return []
    releases = ", ".join(f"{k} {v}" for k, v in sorted(sessions["session_releases"].items()))
    return [("session hits", f"{sessions['session_hits']} turns, "
                             f"{sessions['session_hit_tokens']:,} tokens not prefilled"),
            ("session releases", releases or "none"),
            ("sessions held at end", str(sessions["sessions_held_at_end"]))]


def print_aggregate(aggregate: dict[str, Any], title: str, file: Any = None,
                    wall_seconds: float | None = None) -> None:
    from rich.table import Table

    a = aggregate
    summary = Table(show_header=False)
    summary.add_column("figure", style="bold")
    summary.add_column("value", justify="right")
    reasons = ", ".join(f"{k} {v}" for k, v in a["finish_reasons"].items())
    rows = [
        ("requests", f"{a['num_requests']} ({reasons})"),
        ("steps / simulated time", f"{a['num_steps']} / {a['duration_s']:.2f} s"),
        ("output throughput", f"{a['throughput_output_tok_s']:.1f} tok/s"),
        # tokens computed per second (recomputation in, prefix hits out): not vLLM's
        # "total token throughput", (prompt + output) / duration
        ("computed tokens", f"{a['throughput_total_tok_s']:.1f} tok/s"),
        ("preemptions", f"{a['num_preemptions']} ({a['num_preempted_requests']} requests)"),
        ("recomputed tokens (wasted)",
         f"{a['recomputed_tokens']} ({fmt_pct(a['wasted_fraction'])})"),
        *_host_tier_rows(a),
        ("longest stall", fmt_s(a["longest_stall_s"])),
        ("prefix hit rate", fmt_pct(a["prefix_hit_rate"])),
        ("KV usage peak / mean", f"{fmt_pct(a['kv_usage_peak'])} / "
                                 f"{fmt_pct(a['kv_usage_mean'])}"),
        *_session_rows(a.get("sessions") or {}),
    ]
    for name, value in rows:
        summary.add_row(name, value)
    latency = Table(title="latency", title_justify="left")
    latency.add_column("")
    for column in ("mean", "p50", "p90", "p99", "max"):
        latency.add_column(column, justify="right")
    for name, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E"), ("queue", "queue")):
        latency.add_row(label, *(fmt_s(a[f"{name}_{c}"])
                                 for c in ("mean", "p50", "p90", "p99", "max")))
    console = _console(file)
    console.print(title, style="bold")
    console.print(summary)
    console.print(latency)
    if a.get("tenants"):
        console.print(_tenant_table(a))
    if wall_seconds:
        console.print(f"simulated {a['duration_s']:.1f} s in {wall_seconds:.2f} s of wall time "
                      f"({a['duration_s'] / wall_seconds:,.0f}x)", style="dim")


def _tenant_table(a: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"tenants (Jain's fairness index {a['jain_fairness_index']:.3f})",
                  title_justify="left")
    for column in ("tenant", "requests", "service share", "TTFT p50", "TTFT p99"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for tenant, row in a["tenants"].items():
        table.add_row(tenant, str(row["num_requests"]), fmt_pct(row["service_share"]),
                      fmt_s(row["ttft_p50"]), fmt_s(row["ttft_p99"]))
    return table


SWEEP_COLUMNS = (
    ("preempt", lambda a: str(a["num_preemptions"])),
    ("wasted", lambda a: fmt_pct(a["wasted_fraction"])),
    ("out tok/s", lambda a: f"{a['throughput_output_tok_s']:.1f}"),
    ("TTFT p50", lambda a: fmt_s(a["ttft_p50"])),
    ("TTFT p99", lambda a: fmt_s(a["ttft_p99"])),
    ("ITL p99", lambda a: fmt_s(a["itl_p99"])),
    ("E2E p99", lambda a: fmt_s(a["e2e_p99"])),
    ("stall", lambda a: fmt_s(a["longest_stall_s"])),
    ("KV peak", lambda a: fmt_pct(a["kv_usage_peak"])),
)


def print_sweep(name: str, rows: list[tuple[Any, dict[str, Any]]], title: str,
                file: Any = None) -> None:
    from rich.table import Table

    table = Table()
    table.add_column(name, no_wrap=True)
    for label, _ in SWEEP_COLUMNS:
        table.add_column(label, justify="right")
    for value, aggregate in rows:
        table.add_row(str(value), *(fn(aggregate) for _, fn in SWEEP_COLUMNS))
    console = _console(file)
    console.print(title, style="bold")
    console.print(table)


class Progress:
    """A progress bar on stderr that appears only once a run has taken over a second."""

    def __init__(self, total: int, label: str = "simulating") -> None:
        import sys
        import time

        self._time = time.perf_counter
        self._start = self._time()
        self._total = total
        self._label = label
        self._bar: Any = None
        self._task: Any = None
        self._enabled = sys.stderr.isatty()

    def __call__(self, now: float, num_finished: int, total: int) -> None:
        """A simulation's progress: requests finished by simulated time ``now``."""
        self.update(num_finished, f"t={now:.1f}s")

    def update(self, done: int, note: str = "") -> None:
        """``done`` of the total, with a note after the label."""
        if not self._enabled:
            return
        if self._bar is None:
            if self._time() - self._start < 1.0:
                return
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self._label, total=self._total)
        self._bar.update(self._task, completed=done,
                         description=f"{self._label} {note}".rstrip())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

"""Registers the simulator's subcommands with ``kvserve``'s parser."""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    from kvserve.sim import cli_plan, cli_simulate, cli_whatif, cli_workload

    cli_simulate.add_parser(subparsers)
    cli_plan.add_parser(subparsers)
    cli_workload.add_parser(subparsers)
    cli_whatif.add_parser(subparsers)

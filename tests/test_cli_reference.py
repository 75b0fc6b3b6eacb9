"""docs/cli.md is the parser's own reference: regenerate it and compare, so a flag added,
renamed or re-described without the page being rewritten fails here (python -m
kvserve.cli_reference > docs/cli.md rewrites it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.cli import build_parser
from kvserve.cli_reference import commands, render

ROOT = Path(__file__).resolve().parents[1]


def test_docs_cli_md_is_what_the_parser_says():
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert page == render(build_parser()), \
        "docs/cli.md is stale: run python -m kvserve.cli_reference > docs/cli.md"


def test_every_command_and_flag_is_on_the_page():
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    names = [name for name, _ in commands(build_parser())]
    assert "kvserve simulate" in names and "kvserve workload gen" in names
    for name, parser in commands(build_parser()):
        assert f"\n## {name}\n" in page
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}`" in page, (name, option)

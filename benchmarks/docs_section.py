"""Each benchmark owns one marked section of docs/benchmarks.md and rewrites only that."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(name: str, body: str, docs: Path = DOCS, title: str = "# Benchmarks") -> None:
    """Replace the section ``name`` (between its markers) of ``docs`` with ``body``, or
    append it (a new file starts with ``title``)."""
    begin, end = markers(name)
    section = f"{begin}\n{body.strip()}\n{end}"
    text = docs.read_text() if docs.exists() else title + "\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)


def publish(name: str, section: str, rows: list[Any] | None = None,
            json_path: str | None = None, write_docs: bool = False, docs: Path = DOCS,
            title: str = "# Benchmarks") -> None:
    """A benchmark's ending: print its section, and write its rows and the docs if asked."""
    print(section)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    if write_docs:
        write_section(name, section, docs, title)

"""Each benchmark owns one marked section of docs/benchmarks.md and rewrites only that."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(name: str, body: str) -> None:
    """Replace the section ``name`` (between its markers) with ``body``, or append it."""
    begin, end = markers(name)
    section = f"{begin}\n{body.strip()}\n{end}"
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    DOCS.write_text(text)

"""Every rule code the code cites is defined in docs/scheduler.md (issue 17, item 1).

The code cites rules as a capital letter and a number: "(D1-D8)", "rule J2", "# H2", "F3)".
A rule letter is one with a section in docs/scheduler.md (`### D. ...`); a code is defined by
its anchor, ``<a id="D3"></a>``, followed by a ``#### D3 ...`` heading. Other letter+digit
tokens are not rules and are not checked: W1-W3 are workloads, "vLLM V1" a version, -O3 a
compiler flag; F16 and F32 are GGUF tensor types and H100 (three digits) a GPU. A token of a
rule letter that is not a rule (an L4 GPU in a preset's comment) is harmless as long as the
rule of that code exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "scheduler.md"
SCANNED = ("src", "tests", "benchmarks")
CITATION = re.compile(r"(?<![\w.])([A-Z])([1-9][0-9]?)(?!\w)")
NOT_RULES = {"F16", "F32"}  # tensor types
ANCHOR = re.compile(r'<a id="([A-Z][1-9][0-9]?)"></a>\n#### (\S+) ')
LETTER_SECTION = re.compile(r"^### ([A-Z])\. ", re.M)
SPEC_LETTERS = set("ABCDEFGHIJKLMN")  # the scheduler spec's sections: never dropped


def defined_codes(text: str) -> set[str]:
    codes = set()
    for anchor, heading in ANCHOR.findall(text):
        assert anchor == heading, f"anchor {anchor} heads the rule {heading}"
        assert anchor not in codes, f"rule {anchor} is defined twice"
        codes.add(anchor)
    return codes


def citations(letters: set[str]) -> dict[str, list[str]]:
    """code -> the files citing it, for codes of the given letters."""
    cited: dict[str, list[str]] = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue  # its examples below are not citations
            for letter, digit in CITATION.findall(path.read_text()):
                if letter in letters and letter + digit not in NOT_RULES:
                    files = cited.setdefault(letter + digit, [])
                    name = str(path.relative_to(ROOT))
                    if name not in files:
                        files.append(name)
    return cited


def test_every_cited_rule_is_defined_in_docs_scheduler_md():
    text = PAGE.read_text()
    letters = set(LETTER_SECTION.findall(text))
    assert letters >= SPEC_LETTERS, f"sections missing: {sorted(SPEC_LETTERS - letters)}"
    defined = defined_codes(text)
    missing = {code: files for code, files in citations(letters).items()
               if code not in defined}
    assert not missing, "cited but not defined in docs/scheduler.md: " + "; ".join(
        f"{code} (in {', '.join(files)})" for code, files in sorted(missing.items()))


def test_each_rule_sits_under_its_letter():
    text = PAGE.read_text()
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    for section in sections:
        letter = section[0]
        for code in defined_codes(section):
            assert code[0] == letter, f"rule {code} is under section {letter}"


def test_the_scan_finds_citations_and_would_catch_an_undefined_one():
    cited = citations(SPEC_LETTERS)
    # The scheduler cites these; if the scan stopped seeing them the test above would pass
    # vacuously.
    assert {"D1", "F3", "H2", "I1", "J2", "K4"} <= cited.keys()
    assert "core/scheduler.py" in " ".join(cited["D1"])
    found = {a + b for a, b in CITATION.findall(
        "(D1-D8) rule J2, F3) # H2 F10 H100 W1 0xE5 E4M3 v1.D2 -O3")}
    assert found == {"D1", "D8", "J2", "F3", "H2", "F10", "W1", "O3"}  # W, O: not rule letters
    assert "F16" not in cited and "F32" not in cited  # the tensor types, cited as such
    assert "Z9" not in defined_codes(PAGE.read_text())

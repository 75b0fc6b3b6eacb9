"""What a user's tools read of the installed package."""

from __future__ import annotations

from pathlib import Path

import kvserve

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_says_it_is_typed():
    """PEP 561: without py.typed in the wheel, users' type checkers took LLM, SamplingParams
    and the scheduler as Any (QA)."""
    assert (Path(kvserve.__file__).parent / "py.typed").is_file()
    assert '"kvserve" = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()  # in wheels
    assert kvserve.__all__ == ["LLM", "SamplingParams"]
    assert kvserve.SamplingParams.__name__ == "SamplingParams"  # the lazy name resolves

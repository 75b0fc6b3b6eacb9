"""Servers shared by the tests of this folder: one plain server for the whole session, the
others built by the tests that need a special configuration."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .helpers import LiveServer


@pytest.fixture(scope="session")
def server() -> Iterator[LiveServer]:
    with LiveServer(max_model_len=256) as live:
        yield live

"""Fixtures shared by the serving tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sparse_testing.reference import NoCacheReference


@pytest.fixture(scope="session")
def nocache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NoCacheReference]:
    """The session's one ``--disable-radix-cache`` server (tiny Qwen3-Next, seed 0): greedy
    reference tokens for every module, started on first use (see
    :mod:`sparse_testing.reference`)."""
    ref = NoCacheReference(tmp_path_factory.mktemp("nocache_reference"))
    try:
        yield ref
    finally:
        ref.stop()

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


#: the tiny Nemotron-H of the Mamba2 serving tests (SSM chunk 128: SGLang's state grid lcm(128, page))
NEMOTRON_H = {"arch": "nemotron_h", "mamba_chunk_size": 128}


@pytest.fixture(scope="session")
def nemotron_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NoCacheReference]:
    """The session's ``--disable-radix-cache`` server on the tiny Nemotron-H (:data:`NEMOTRON_H`,
    seed 0), shared by every module that serves it; started on first use."""
    ref = NoCacheReference(tmp_path_factory.mktemp("nocache_nemotron_h"), **NEMOTRON_H)
    try:
        yield ref
    finally:
        ref.stop()

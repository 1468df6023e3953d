"""The strict option check refuses misspelt backend options but lets the project's other
``SGLANG_SPARSE_*`` variables through (a user who exported the traces' data directory for the
benchmarks can still start the server)."""

from __future__ import annotations

import pytest

from sglang_sparse.sglang_adapter.config import NON_OPTION_ENV, SparseConfig, SparseConfigError
from sglang_sparse.traces.data import ENV_VAR as DATA_ENV


def test_project_variables_are_not_options() -> None:
    assert DATA_ENV in NON_OPTION_ENV
    cfg = SparseConfig.from_env({DATA_ENV: "/x", "SGLANG_SPARSE_CPU_NO_DEVICE_ACTIVITY": "1"})
    assert cfg == SparseConfig.from_env({})


def test_misspelt_option_still_refused_beside_them() -> None:
    with pytest.raises(SparseConfigError, match="unknown variable SGLANG_SPARSE_POLCY"):
        SparseConfig.from_env({DATA_ENV: "/x", "SGLANG_SPARSE_POLCY": "lru"})


def test_platform_switch_name_is_the_exempt_one() -> None:
    from sglang_sparse_kernels.sgl_kernel_cpu import sglang_platform

    assert sglang_platform._NO_DEVICE_ACTIVITY in NON_OPTION_ENV

"""Module-level skips for tests that need the serving stack (one definition for every serving test).

Call at the top of a test module, before importing anything from the stack::

    require_serving_stack(cpu_platform=True)

Imports only the standard library (pytest lazily), so collecting a skipped module costs nothing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from importlib.metadata import entry_points

#: what a real SGLang CPU server needs (``sgl_kernel`` is the project's CPU shim)
SERVING_MODULES = ("torch", "sglang", "transformers", "sgl_kernel")
#: the project's out-of-tree SGLang platform (SGLang's extra_buffer path on the CPU)
CPU_PLATFORM = "sglang_sparse_cpu"


def require_serving_stack(modules: Sequence[str] = SERVING_MODULES, *, cpu_platform: bool = False) -> None:
    """Skip the calling test module unless every module in ``modules`` is importable and, with
    ``cpu_platform``, the ``sglang_sparse_cpu`` platform entry point is installed."""
    import pytest

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"serving stack not installed ({', '.join(missing)} missing); run tools/setup_env.sh",
            allow_module_level=True,
        )
    if cpu_platform and CPU_PLATFORM not in {ep.name for ep in entry_points(group="sglang.srt.platforms")}:
        pytest.skip(
            f"the {CPU_PLATFORM} platform is not installed; run tools/setup_env.sh", allow_module_level=True
        )

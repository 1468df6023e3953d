"""Builds the optional C fast paths; everything else lives in pyproject.toml.

* ``sglang_sparse.placement._cht_native``: the placement DP (fallback: the pure-Python O(N·M) hull).
* ``sglang_sparse.tree._lcp_native``: the radix tree's longest-common-prefix of int32 token buffers
  (fallback: the chunked numpy ``lcp_numpy`` in ``sglang_sparse/tree/lcp.py``).

If no C compiler is available the package still installs and uses the fallbacks (same results,
slower).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure must not break the install
            print(f"warning: native extensions not built ({exc}); using the pure-Python fallbacks")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"warning: {ext.name} not built ({exc}); using its pure-Python fallback")


setup(
    ext_modules=[
        Extension(
            "sglang_sparse.placement._cht_native",
            sources=["sglang_sparse/placement/_cht_native.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "sglang_sparse.tree._lcp_native",
            sources=["sglang_sparse/tree/_lcp_native.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)

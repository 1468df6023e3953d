"""Builds the optional C fast path of the placement DP; everything else lives in pyproject.toml.

If no C compiler is available the package still installs and falls back to the pure-Python
O(N·M) hull (same results, slower).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure must not break the install
            print(f"warning: native placement DP not built ({exc}); using the pure-Python DP")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"warning: native placement DP not built ({exc}); using the pure-Python DP")


setup(
    ext_modules=[
        Extension(
            "sglang_sparse.placement._cht_native",
            sources=["sglang_sparse/placement/_cht_native.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)

"""One ``--disable-radix-cache`` server for a whole test session: the greedy reference tokens.

Every serving test compares a cache's greedy tokens with a no-cache server's on the same prompts.
Each test module used to start its own reference server (15 starts of ~45 s on 2 cores, a sixth of
the serving suite). Greedy tokens depend only on the weights and the prompt, so one server answers
them all: :class:`NoCacheReference` serves the default tiny Qwen3-Next
(:func:`~sglang_sparse.models.tiny.make_tiny_model`, ``arch="qwen3_next"``, seed 0) with a context
long enough for every module, starts on first use and memoizes each ``(prompt, max_new_tokens)``.

A module's own checkpoint must be that model: :meth:`NoCacheReference.check_model` compares the
checkpoint stamps (arch, size, seed, spec, torch version) apart from ``max_position_embeddings``,
which sizes the context and creates no weight, and raises otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from sglang_sparse.models.tiny import make_tiny_model
from sglang_sparse.testing.server import GenerateResult, SGLangServer, strategy_setup

#: context of the reference server (tokens): the longest prompt of any serving test fits
REFERENCE_CONTEXT = 8192
_STAMP = "sglang_sparse_tiny.json"


def _weights_stamp(model_dir: str | Path) -> dict:
    stamp = json.loads((Path(model_dir) / _STAMP).read_text())
    stamp["spec"] = {k: v for k, v in stamp["spec"].items() if k != "max_position_embeddings"}
    return stamp


class NoCacheReference:
    """A lazily started ``--disable-radix-cache`` no_buffer server on a tiny model (by default the
    tiny Qwen3-Next, seed 0; ``arch`` and ``overrides`` as :func:`make_tiny_model`'s).

    ``workdir``: where its checkpoint and log go. :meth:`generate` answers like
    :meth:`SGLangServer.generate` (greedy, ``ignore_eos``) and memoizes; :meth:`stop` ends it.
    """

    def __init__(self, workdir: str | Path, arch: str = "qwen3_next", **overrides: int | str) -> None:
        self.workdir = Path(workdir)
        self.model_dir = make_tiny_model(
            self.workdir / "model", arch=arch, seed=0, max_position_embeddings=REFERENCE_CONTEXT, **overrides
        )
        self._srv: SGLangServer | None = None
        self._memo: dict[tuple[tuple[int, ...], int], GenerateResult] = {}

    def check_model(self, model_dir: str | Path) -> None:
        """Raise ``ValueError`` unless ``model_dir`` holds the reference's weights."""
        if _weights_stamp(model_dir) != _weights_stamp(self.model_dir):
            raise ValueError(
                f"{model_dir} is not the reference model ({self.model_dir}): "
                "start a module-local --disable-radix-cache server for it instead"
            )

    @property
    def server(self) -> SGLangServer:
        if self._srv is None:
            base, env = strategy_setup("no_buffer")
            srv = SGLangServer(
                self.model_dir,
                base_args=base,
                env=env,
                # sleeps on idle (the harness's CPU flags): it idles through most of the session
                extra_args=["--disable-radix-cache"],
                context_length=REFERENCE_CONTEXT,
                max_total_tokens=2 * REFERENCE_CONTEXT,
                max_mamba_cache_size=8,
                log_path=self.workdir / "nocache_reference.log",
            )
            srv.start(timeout=300)
            self._srv = srv
        return self._srv

    def generate(
        self, input_ids: Sequence[int], max_new_tokens: int, timeout: float = 300.0
    ) -> GenerateResult:
        """Greedy ``max_new_tokens`` after ``input_ids`` without any prefix cache (``timeout``:
        seconds for a request the memo does not hold)."""
        key = (tuple(int(t) for t in input_ids), int(max_new_tokens))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self.server.generate(list(key[0]), key[1], timeout=timeout)
        return hit

    def outputs(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """The greedy output ids of every prompt, in order."""
        return [self.generate(p, max_new_tokens).output_ids for p in prompts]

    def stop(self) -> None:
        if self._srv is not None:
            self._srv.stop()
            self._srv = None

"""Offline references for the serving tests: SGLang's ``Engine`` on the CPU with the settings of
:class:`~sglang_sparse.testing.server.SGLangServer`, and HF transformers greedy generation (fp32,
torch-only GDN path) that the CPU server's tokens are checked against."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from sglang_sparse.testing.server import CPU_ENV, GenerateResult, _mapped_shm


@contextlib.contextmanager
def cpu_engine(model_path: str | Path, **kwargs: Any) -> Iterator[Any]:
    """An offline ``sglang.Engine`` on the CPU with the same settings as :class:`SGLangServer`.

    ``kwargs`` override/extend the engine's ServerArgs fields. Yields the engine; shuts it down and
    unlinks the ``/dev/shm`` files its scheduler processes mapped (SGLang's shutdown leaves its
    ``sglang_loads_*.shm`` segment behind).
    """
    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    import sglang

    defaults: dict[str, Any] = dict(
        device="cpu",
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        dtype="float32",
        mem_fraction_static=0.05,
        mamba_radix_cache_strategy="no_buffer",
        disable_overlap_schedule=True,
        max_total_tokens=4096,
        max_mamba_cache_size=16,
        log_level="error",
        sleep_on_idle=True,  # an idle scheduler busy-polls a core otherwise
    )
    defaults.update(kwargs)
    others = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. a server fixture's
    engine = sglang.Engine(model_path=str(model_path), **defaults)
    children = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in others]
    try:
        yield engine
    finally:
        shm = _mapped_shm(children)
        engine.shutdown()
        for path in shm:
            with contextlib.suppress(OSError):
                os.unlink(path)


def engine_generate(engine: Any, input_ids: Sequence[int], max_new_tokens: int = 8) -> GenerateResult:
    """Greedy generation through an offline Engine, same result type as the HTTP helper."""
    out = engine.generate(
        input_ids=list(input_ids),
        sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    )
    return GenerateResult(output_ids=list(out["output_ids"]), meta=dict(out.get("meta_info", {})))


# -- HF transformers reference ---------------------------------------------------------------
_TORCH_PATH_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
_HF_MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
)


def force_hf_torch_path() -> list[str]:
    """Point HF's GDN layers at their pure-torch functions.

    transformers resolves ``chunk_gated_delta_rule`` etc. at import time and prefers FLA (Triton)
    or causal-conv1d when importable; those crash on a CPU. Each module-level wrapper keeps the torch
    function as ``__wrapped__``; this rebinds the module globals to it. Returns the names rebound.
    """
    import importlib

    rebound = []
    for mod_name in _HF_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name in _TORCH_PATH_FUNCS:
            fn = getattr(mod, name, None)
            if fn is None:
                continue
            base = inspect.unwrap(fn)
            if base is not fn:
                setattr(mod, name, base)
                rebound.append(f"{mod_name}.{name}")
    return rebound


class HFReference:
    """Greedy generation with HF transformers on the CPU (fp32, torch-only GDN path)."""

    def __init__(self, model_path: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        force_hf_torch_path()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        self.model.eval()

    def greedy(self, input_ids: Sequence[int], max_new_tokens: int = 8) -> list[int]:
        """Greedy continuation of ``input_ids`` (prefill + cached decode, like a server)."""
        torch = self.torch
        ids = torch.tensor([list(input_ids)], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        return [int(t) for t in out[0, ids.shape[1] :].tolist()]

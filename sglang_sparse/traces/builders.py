"""Registry of the trace builders and the public ``build_trace`` entry point.

Every trace is a pure function of ``(name, seed, params, data files, tokenizer)``: randomness comes
only from ``numpy.random.default_rng(seed)`` and timestamps are logical seconds, never wall-clock.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .agent import DESCRIPTION as AGENT_DESCRIPTION
from .agent import build as build_agent
from .common import BuiltTrace
from .data import DATA_FILES, resolve_data_dir
from .docqa import DESCRIPTION as DOCQA_DESCRIPTION
from .docqa import build as build_docqa
from .rag import DESCRIPTION as RAG_DESCRIPTION
from .rag import build as build_rag
from .schema import Request
from .sysprompt import DESCRIPTION as SYSPROMPT_DESCRIPTION
from .sysprompt import build as build_sysprompt
from .tokenizer import get_tokenizer

FORMAT = "jsonl/marconi-v1"
"""Identifier of the on-disk format (see :mod:`sglang_sparse.traces.schema`)."""


@dataclass(frozen=True)
class TraceSpec:
    """A named trace: its one-line description and builder ``(seed, data_dir, **params) -> BuiltTrace``."""

    name: str
    description: str
    builder: Callable[..., BuiltTrace]

    def defaults(self) -> dict[str, Any]:
        """The builder's keyword parameters and their default values."""
        sig = inspect.signature(self.builder)
        return {
            p.name: p.default for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
        }


TRACES: dict[str, TraceSpec] = {
    s.name: s
    for s in (
        TraceSpec("system_prompts", SYSPROMPT_DESCRIPTION, build_sysprompt),
        TraceSpec("agent", AGENT_DESCRIPTION, build_agent),
        TraceSpec("doc_qa", DOCQA_DESCRIPTION, build_docqa),
        TraceSpec("rag", RAG_DESCRIPTION, build_rag),
    )
}
TRACE_NAMES: tuple[str, ...] = tuple(TRACES)


def get_spec(name: str) -> TraceSpec:
    """The spec of ``name``; ValueError listing the valid names otherwise."""
    try:
        return TRACES[name]
    except KeyError:
        raise ValueError(f"unknown trace {name!r}; valid names: {', '.join(TRACE_NAMES)}") from None


def resolve_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Defaults of trace ``name`` overridden by ``params``; ValueError on an unknown parameter."""
    defaults = get_spec(name).defaults()
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) for trace {name!r}: {', '.join(unknown)}; "
            f"valid: {', '.join(sorted(defaults))}"
        )
    return {**defaults, **params}


def build_trace_with_meta(
    name: str, seed: int = 0, data_dir: str | os.PathLike[str] | None = None, **params: Any
) -> tuple[list[Request], dict[str, Any]]:
    """Build trace ``name`` and its metadata dict (name, seed, params, tokenizer, stats, builder info).
    Raises ValueError for an unknown name/parameter and DataNotFoundError for missing data."""
    spec = get_spec(name)
    full = resolve_params(name, params)
    ddir = resolve_data_dir(data_dir)
    built = spec.builder(int(seed), ddir, **full)
    reqs = built.requests
    meta: dict[str, Any] = {
        "name": name,
        "description": spec.description,
        "format": FORMAT,
        "seed": int(seed),
        "params": full,
        "tokenizer": get_tokenizer().name,
        "data_files": list(DATA_FILES),
        "num_requests": len(reqs),
        "num_sessions": len({r.session_id for r in reqs}),
        "total_input_tokens": sum(r.num_input_tokens for r in reqs),
        "total_output_tokens": sum(r.num_output_tokens for r in reqs),
        "info": built.info,
    }
    return reqs, meta


def build_trace(
    name: str, seed: int = 0, data_dir: str | os.PathLike[str] | None = None, **params: Any
) -> list[Request]:
    """Requests of trace ``name`` (sorted by ``ts``) for ``seed``; ``params`` override builder defaults.
    ``data_dir`` defaults to ``$SGLANG_SPARSE_DATA`` or ``<repo>/../shared/data``."""
    return build_trace_with_meta(name, seed, data_dir, **params)[0]

"""Request traces built from real data (system prompts, SWE-agent runs, QuALITY) for prefix-cache studies.

Format: Marconi-compatible JSONL (see :mod:`.schema`). Lengths are tokens of the Qwen3.5 tokenizer;
timestamps are logical seconds. Heavy imports (tokenizer, matplotlib, tqdm) happen lazily.
"""

from .builders import TRACE_NAMES, build_trace, build_trace_with_meta
from .data import DataNotFoundError, resolve_data_dir
from .overlap import PrefixIndex, overlap_depths
from .schema import Request, TraceFormatError, read_trace, write_meta, write_trace
from .tokenizer import get_tokenizer

__all__ = [
    "TRACE_NAMES",
    "DataNotFoundError",
    "PrefixIndex",
    "Request",
    "TraceFormatError",
    "build_trace",
    "build_trace_with_meta",
    "get_tokenizer",
    "overlap_depths",
    "read_trace",
    "resolve_data_dir",
    "write_meta",
    "write_trace",
]

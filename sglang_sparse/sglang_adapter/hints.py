"""Positions a request names itself: planned states of the ``sparse`` backend from the first request on.

An application often knows where its prompts will diverge: a chat has a system prompt and turns, a
RAG framework knows where its retrieved document ends. The backend plans a state at such positions
(not on probation) the first time a request names them, so the second request on a new system
prompt or document resumes there without any learned prior.

Two sources, both carried in SGLang's ``sampling_params.custom_params`` (JSON-safe, it travels to
the scheduler with the request on every path; :data:`CHECKPOINTS_KEY`):

* a hint in the request body: ``/generate`` with
  ``"sampling_params": {"custom_params": {"sparse_checkpoints": [1024, 2048]}}`` (token positions:
  the state after the first ``p`` prompt tokens), or ``/v1/chat/completions`` with
  ``"custom_params": {"sparse_checkpoint_messages": [2]}`` (the state after the first 2 messages,
  whatever the chat template makes of them; OpenAI clients pass it in ``extra_body``);
* message boundaries of ``/v1/chat/completions``, automatically: the end of the leading system
  message(s) and the end of the messages before the last one (the previous turn).

A chat boundary after ``j`` messages is the longest common token prefix of the prompt rendered from
the first ``j`` messages (with SGLang's own chat-template code path) and the full prompt: exactly
what this conversation shares with any other that continued differently after message ``j``,
whatever the template does at message edges (:func:`chat_boundaries`). That costs one template
render and tokenization per boundary in the HTTP server process, never in the scheduler.

In the scheduler, :func:`request_checkpoints` reads the positions of a request: ints in
``(0, len(prompt))``, at most :data:`MAX_CHECKPOINTS`, sorted, deduplicated; anything else is
ignored (a hint is advice; a bad one must not fail the request). The policy floors them to its grid
when SGLang can only snapshot states there (extra_buffer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("sglang_sparse")

#: ``custom_params`` key with token positions (ints) to plan states at
CHECKPOINTS_KEY = "sparse_checkpoints"
#: ``custom_params`` key (chat only) with message counts: a state after the first ``j`` messages
MESSAGES_KEY = "sparse_checkpoint_messages"
#: at most this many named positions per request are planned
MAX_CHECKPOINTS = 8


def request_checkpoints(custom_params: Any, prompt_len: int) -> tuple[int, ...]:
    """The valid named positions of a request (sorted, unique, in ``(0, prompt_len)``)."""
    if not isinstance(custom_params, dict):
        return ()
    raw = custom_params.get(CHECKPOINTS_KEY)
    if not isinstance(raw, (list, tuple)):
        return ()
    ok = (p for p in raw if isinstance(p, int) and not isinstance(p, bool))
    out = sorted({int(p) for p in ok if 0 < p < prompt_len})
    return tuple(out[:MAX_CHECKPOINTS])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def boundary_message_counts(roles: Sequence[str], named: Sequence[int] = ()) -> list[int]:
    """Message counts ``j`` (``0 < j < len(roles)``) whose end is a chat boundary: the leading
    system messages, the messages before the last one, and the ``named`` ones."""
    n = len(roles)
    js: set[int] = set()
    n_sys = 0
    while n_sys < n and roles[n_sys] in ("system", "developer"):
        n_sys += 1
    if 0 < n_sys < n:
        js.add(n_sys)
    if n >= 2:
        js.add(n - 1)
    js.update(j for j in named if isinstance(j, int) and not isinstance(j, bool) and 0 < j < n)
    return sorted(js)


def chat_boundaries(serving: Any, request: Any, full_ids: Sequence[int], is_multimodal: bool) -> list[int]:
    """Token positions of the chat boundaries of ``request`` (a ``ChatCompletionRequest``) in its
    prompt ``full_ids``: for each message count ``j`` of :func:`boundary_message_counts`, the
    common prefix of the prompt of the first ``j`` messages (SGLang's ``_process_messages`` on a
    copy of the request) with ``full_ids``. A prefix the template refuses is skipped."""
    messages = list(getattr(request, "messages", None) or [])
    roles = [str(getattr(m, "role", "")) for m in messages]
    named = (getattr(request, "custom_params", None) or {}).get(MESSAGES_KEY) or ()
    out: set[int] = set()
    tok = serving.tokenizer_manager.tokenizer
    for j in boundary_message_counts(roles, named if isinstance(named, (list, tuple)) else ()):
        try:
            part = request.model_copy(deep=True, update={"messages": messages[:j]})
            ids = serving._process_messages(part, is_multimodal).prompt_ids  # noqa: SLF001
            if isinstance(ids, str):
                ids = tok.encode(ids)
        except Exception:  # noqa: BLE001 - a template may refuse a partial conversation: no boundary
            continue
        k = common_prefix(ids, full_ids)
        if 0 < k < len(full_ids):
            out.add(k)
    return sorted(out)


def add_chat_boundaries(serving: Any, adapted: Any, request: Any) -> None:
    """Add the chat boundaries of ``request`` to ``adapted`` (its ``GenerateReqInput``) under
    :data:`CHECKPOINTS_KEY`, merged with positions the request named itself. Never raises."""
    try:
        mm = bool(serving.tokenizer_manager.model_config.is_multimodal)
        if mm or getattr(adapted, "image_data", None) or getattr(adapted, "audio_data", None):
            return
        full = getattr(adapted, "input_ids", None)
        if full is None:
            text = getattr(adapted, "text", None)
            if not isinstance(text, str):
                return
            full = serving.tokenizer_manager.tokenizer.encode(text)
        if not full or not isinstance(full[0], int):
            return
        found = chat_boundaries(serving, request, full, mm)
        if not found:
            return
        sp = adapted.sampling_params if isinstance(adapted.sampling_params, dict) else None
        if sp is None:
            return
        custom = dict(sp.get("custom_params") or {})
        mine = custom.get(CHECKPOINTS_KEY)
        given = [p for p in mine if isinstance(p, int)] if isinstance(mine, list) else []
        custom[CHECKPOINTS_KEY] = sorted(set(given) | set(found))[:MAX_CHECKPOINTS]
        sp["custom_params"] = custom
    except Exception:  # noqa: BLE001 - a hint must never fail the request
        logger.exception("sparse cache: chat message boundaries could not be computed")

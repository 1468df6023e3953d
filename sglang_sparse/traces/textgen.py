"""Synthetic short texts (user turns, questions, answers) drawn from templates with a numpy Generator.

Everything is a pure function of the Generator state: no wall-clock, no global randomness.
Lengths are in tokens of :func:`~sglang_sparse.traces.tokenizer.get_tokenizer`.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from .tokenizer import IM_END_ID, get_tokenizer

_TOPICS = (
    "my Python script",
    "a SQL query",
    "the quarterly report",
    "a cover letter",
    "our API design",
    "a React component",
    "this error message",
    "my travel plans",
    "a unit test",
    "the budget",
    "a Dockerfile",
    "the meeting notes",
    "a marketing email",
    "my resume",
    "a recipe",
    "the onboarding guide",
    "a regex",
    "a shell one-liner",
    "the release notes",
    "a data pipeline",
    "a physics problem",
    "the contract clause",
    "a poem",
    "a bug in production",
    "a chart",
)
_VERBS = (
    "review",
    "improve",
    "explain",
    "summarize",
    "fix",
    "rewrite",
    "shorten",
    "translate",
    "debug",
    "optimize",
    "outline",
    "critique",
    "simplify",
    "extend",
    "document",
)
_STYLES = (
    "in plain English",
    "step by step",
    "as a bulleted list",
    "briefly",
    "with an example",
    "for a beginner",
    "in a formal tone",
    "with code",
    "in under 100 words",
    "like an expert",
)
_USER_TEMPLATES = (
    "Can you {verb} {topic} {style}?",
    "Please {verb} {topic}.",
    "I need help: {verb} {topic} {style}.",
    "How would you {verb} {topic}? Answer {style}.",
    "Hi! Could you {verb} {topic} for me?",
    "What's the best way to {verb} {topic}?",
    "{Verb} {topic} {style}, please.",
    "Quick question about {topic}: can you {verb} it?",
)
_EXTRA_SENTENCES = (
    "It is for work and the deadline is tomorrow.",
    "Keep the original meaning.",
    "I have tried a few things already but nothing worked.",
    "Assume I know the basics.",
    "Mention any caveats you see.",
    "Please be concise and precise.",
    "Also list the main risks.",
    "Here is some context: it runs on Linux and uses Python 3.11.",
    "Thanks in advance!",
    "Compare two alternatives if there are any.",
)
_ANSWER_TEXT = (
    "Sure. Here is a short answer. First, consider the main goal and the constraints that apply. "
    "Second, break the task into small steps and check each one before moving on. In most cases the "
    "simplest approach works well: keep inputs validated, handle errors explicitly, and write down "
    "assumptions. If performance matters, measure before optimizing and focus on the hot path. "
    "Finally, review the result with a fresh eye, compare it with the requirements, and adjust the "
    "details. Let me know if you would like a more detailed walkthrough or an example. "
)
_DOC_QUESTION_TEMPLATES = (
    'What does the document say about "{snippet}"?',
    'Explain the passage containing "{snippet}" in your own words.',
    'Why does the text mention "{snippet}"? Answer in two sentences.',
    'Summarize the section around "{snippet}".',
    'Is the statement "{snippet}" consistent with the rest of the document? Explain.',
    'Who or what is referred to near "{snippet}"?',
    'List three facts from the document that relate to "{snippet}".',
    'Quote the sentence that follows "{snippet}" and interpret it.',
)
_RAG_QUESTION_TEMPLATES = (
    'Based on the passages above, what is said about "{snippet}"?',
    'Using only the retrieved context, explain "{snippet}".',
    'Which passage mentions "{snippet}", and what does it imply?',
    'Answer from the context: how should the assistant handle "{snippet}"?',
    'Do the passages agree about "{snippet}"? Cite passage numbers.',
)


def _pick(rng: np.random.Generator, items: tuple[str, ...]) -> str:
    return items[int(rng.integers(len(items)))]


def user_turn_tokens(rng: np.random.Generator, min_tokens: int = 10, max_tokens: int = 60) -> list[int]:
    """Tokens of a short varied user request; ``min_tokens <= len <= max_tokens`` (cut if longer)."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    tok = get_tokenizer()
    verb = _pick(rng, _VERBS)
    text = _pick(rng, _USER_TEMPLATES).format(
        verb=verb, Verb=verb.capitalize(), topic=_pick(rng, _TOPICS), style=_pick(rng, _STYLES)
    )
    target = int(rng.integers(min_tokens, max_tokens + 1))
    ids = tok.encode(text)
    while len(ids) < target:
        text += " " + _pick(rng, _EXTRA_SENTENCES)
        ids = tok.encode(text)
    return ids[:target]


@functools.lru_cache(maxsize=8)
def _answer_pool(repeats: int) -> list[int]:
    return get_tokenizer().encode(_ANSWER_TEXT * repeats)


def synthetic_answer_tokens(
    rng: np.random.Generator, min_tokens: int = 16, max_tokens: int = 128
) -> list[int]:
    """Deterministic stand-in for a model answer: a window of a fixed answer text + ``<|im_end|>``.
    Length (including the final ``<|im_end|>``) is uniform in ``[min_tokens, max_tokens]``."""
    if not 2 <= min_tokens <= max_tokens:
        raise ValueError(f"need 2 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    pool = _answer_pool(max_tokens // 60 + 2)
    n = int(rng.integers(min_tokens, max_tokens + 1)) - 1
    start = int(rng.integers(0, len(pool) - n + 1))
    return pool[start : start + n] + [IM_END_ID]


def snippet(
    rng: np.random.Generator, doc_tokens: list[int], min_tokens: int = 4, max_tokens: int = 12
) -> str:
    """A short single-line excerpt decoded from a random window of ``doc_tokens`` (may be empty)."""
    if not doc_tokens:
        return ""
    n = int(rng.integers(min_tokens, max_tokens + 1))
    start = int(rng.integers(0, max(1, len(doc_tokens) - n)))
    text = get_tokenizer().decode(doc_tokens[start : start + n])
    text = re.sub(r"\s+", " ", text.replace("\ufffd", "")).strip().replace('"', "'")
    return text[:120]


def doc_question(rng: np.random.Generator, doc_tokens: list[int]) -> str:
    """A QuALITY-like question about a random snippet of the document."""
    return _pick(rng, _DOC_QUESTION_TEMPLATES).format(snippet=snippet(rng, doc_tokens) or "the main topic")


def rag_question(rng: np.random.Generator, chunk_tokens: list[int]) -> str:
    """A question about a random snippet of one retrieved chunk."""
    return _pick(rng, _RAG_QUESTION_TEMPLATES).format(snippet=snippet(rng, chunk_tokens) or "this topic")

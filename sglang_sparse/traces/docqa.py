"""``doc_qa`` trace: long documents, each followed by many different questions (QuALITY-like).

Documents (lengths in tokens, each cut to a per-document target uniform in
``[min_doc_tokens, max_doc_tokens]``) come from three real sources: the QuALITY article(s) (HTML
stripped; always included), the longest system prompts, and SWE-agent trajectories flattened to
text. Each request is a single-turn session ``docqa-dXX-qYY``::

    <|im_start|>system\\n{instructions}<|im_end|>\\n
    <|im_start|>user\\n{document}\\n\\nQuestion: {q}<|im_end|>\\n<|im_start|>assistant\\n

The document tokens are concatenated (not re-tokenized with the question), so all questions on a
document share exactly ``shared_prefix_tokens`` (reported per document in the metadata) and the
overlap depth concentrates at that length. Documents start as a Poisson process (mean gap
``doc_interarrival_s``); each document's questions follow as a Poisson process (mean gap
``question_interarrival_s``), so documents interleave in time.
"""

from __future__ import annotations

import os

import numpy as np

from .common import (
    BuiltTrace,
    check_positive,
    check_range,
    poisson_arrivals,
    single_turn,
    sort_requests,
    system_prompt_tokens,
)
from .data import Trajectory, load_quality, load_trajectories
from .schema import Request
from .textgen import doc_question
from .tokenizer import footer, get_tokenizer, header, render_text_message

DESCRIPTION = "long real documents (QuALITY, system prompts, agent logs), each with many questions"

INSTRUCTIONS = (
    "You are a careful reading assistant. Answer the question using only the document provided by "
    "the user. Quote the relevant passage when it helps, and say so if the document does not contain "
    "the answer."
)


def flatten_trajectory(traj: Trajectory) -> str:
    """A trajectory's final context as plain text: ``ROLE: content`` blocks, tool calls included."""
    parts = []
    for m in traj.messages:
        if m["role"] == "exit":
            continue
        text = str(m.get("content") or "")
        for call in m.get("tool_calls") or []:
            text += f"\n[tool call {call['function'].get('name')}] {call['function'].get('arguments')}"
        parts.append(f"{m['role'].upper()}: {text}")
    return "\n\n".join(parts)


def build(
    seed: int,
    data_dir: str | os.PathLike[str] | None,
    *,
    num_docs: int = 12,
    min_doc_tokens: int = 4096,
    max_doc_tokens: int = 32768,
    min_questions: int = 8,
    max_questions: int = 24,
    doc_interarrival_s: float = 30.0,
    question_interarrival_s: float = 6.0,
    output_min_tokens: int = 16,
    output_max_tokens: int = 128,
) -> BuiltTrace:
    """Build the trace; times are logical seconds, lengths tokens."""
    check_positive(num_docs=num_docs)
    check_range("doc tokens", min_doc_tokens, max_doc_tokens, minimum=1)
    check_range("questions per doc", min_questions, max_questions, minimum=1)
    check_range("output tokens", output_min_tokens, output_max_tokens, minimum=2)
    rng = np.random.default_rng(seed)
    tok = get_tokenizer()

    # Candidate documents: (source label, tokens, real questions).
    docs: list[tuple[str, list[int], tuple[str, ...]]] = []
    for art in load_quality(data_dir)[:num_docs]:
        docs.append((f"quality:{art.article_id}", tok.encode(art.text), art.questions))
    rest = num_docs - len(docs)
    n_sys = (rest + 1) // 2
    prompts = [p for p in system_prompt_tokens(data_dir) if len(p[1]) >= min_doc_tokens]
    prompts.sort(key=lambda p: (-len(p[1]), p[0]))
    pool = prompts[: max(3 * n_sys, n_sys)]
    if len(pool) < n_sys:
        raise ValueError(f"only {len(pool)} system prompts have >= {min_doc_tokens} tokens, need {n_sys}")
    for i in sorted(rng.choice(len(pool), size=n_sys, replace=False)):
        docs.append((f"system_prompt:{pool[int(i)][0]}", list(pool[int(i)][1]), ()))
    n_traj = rest - n_sys
    if n_traj:
        trajs = load_trajectories(data_dir)
        taken = 0
        for i in rng.permutation(len(trajs)):
            t = trajs[int(i)]
            ids = tok.encode(flatten_trajectory(t))
            if len(ids) >= min_doc_tokens:
                docs.append((f"trajectory:{t.instance_id}", ids, ()))
                taken += 1
                if taken == n_traj:
                    break
        if taken < n_traj:
            raise ValueError(f"only {taken} trajectories have >= {min_doc_tokens} tokens, need {n_traj}")

    head = render_text_message("system", INSTRUCTIONS) + header("user")
    tail = footer() + header("assistant")
    order = rng.permutation(len(docs))  # interleave sources in time
    doc_starts = poisson_arrivals(rng, len(docs), doc_interarrival_s)
    requests: list[Request] = []
    docs_info = []
    for slot, d in enumerate(order):
        source, ids, real_qs = docs[int(d)]
        target = int(rng.integers(min_doc_tokens, max_doc_tokens + 1))
        doc_ids = ids[:target]
        prefix = head + doc_ids
        nq = int(rng.integers(min_questions, max_questions + 1))
        times = poisson_arrivals(rng, nq, question_interarrival_s, start_s=float(doc_starts[slot]))
        unused_real = list(rng.permutation(len(real_qs))) if real_qs else []
        for j in range(nq):
            if unused_real and rng.random() < 0.5:
                q = real_qs[int(unused_real.pop())]
            else:
                q = doc_question(rng, doc_ids)
            inp = prefix + tok.encode("\n\nQuestion: " + q) + tail
            sid = f"docqa-d{slot:02d}-q{j:02d}"
            requests.append(single_turn(rng, sid, times[j], inp, output_min_tokens, output_max_tokens))
        docs_info.append(
            {
                "session_prefix": f"docqa-d{slot:02d}-",
                "source": source,
                "doc_tokens": len(doc_ids),
                "shared_prefix_tokens": len(prefix),
                "questions": nq,
            }
        )
    return BuiltTrace(sort_requests(requests), {"docs": docs_info})

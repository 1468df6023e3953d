"""Export of traces to bench_serving datasets: exact token round trip and SGLang's own loaders."""

from __future__ import annotations

import json
import sys
import types
from argparse import Namespace
from pathlib import Path

import pytest

from sglang_sparse.traces.cli import main
from sglang_sparse.traces.export import (
    default_format,
    export_trace,
    remap_token,
    to_agentic,
    to_custom_rows,
    turn_deltas,
    word_text,
)
from sglang_sparse.traces.schema import Request, write_trace

VOCAB = 4096


@pytest.fixture
def sglang_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let ``sglang.benchmark.datasets`` import without HF ``datasets`` (only its MMMU loader needs it)."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        stub = types.ModuleType("datasets")
        stub.load_dataset = None  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "datasets", stub)


def _session() -> list[Request]:
    """Three turns; each prompt = previous prompt + previous output + new user tokens."""
    p0, o0 = [10, 11, 12, 13], [20, 21]
    p1 = p0 + o0 + [30, 31, 32]
    o1 = [40, 41, 42]
    p2 = p1 + o1 + [50]
    return [
        Request.make("s", 0, 0.0, p0, o0),
        Request.make("s", 1, 1.0, p1, o1),
        Request.make("s", 2, 2.0, p2, [60, 61]),
    ]


def _tokenizer():  # noqa: ANN202 - a transformers tokenizer
    from sglang_sparse.models.tiny import _build_tokenizer

    return _build_tokenizer(VOCAB)


def test_remap_in_range_and_deterministic() -> None:
    ids = [remap_token(t, VOCAB) for t in range(0, 300000, 997)]
    assert all(4 <= i < VOCAB for i in ids)
    assert ids == [remap_token(t, VOCAB) for t in range(0, 300000, 997)]
    with pytest.raises(ValueError):
        remap_token(1, 4)


def test_word_text_round_trips_through_tiny_tokenizer() -> None:
    tok = _tokenizer()
    toks = [248045, 8678, 198, 5, 0, 123456]
    assert tok.encode(word_text(toks, VOCAB)) == [remap_token(t, VOCAB) for t in toks]


def test_turn_deltas_rebuild_prompts() -> None:
    sess = _session()
    deltas = turn_deltas(sess)
    assert deltas == [(10, 11, 12, 13), (30, 31, 32), (50,)]
    prev: tuple[int, ...] = ()
    for r, d in zip(sess, deltas, strict=True):
        assert prev + d == r.input_tokens
        prev = r.input_tokens + r.output_tokens


def test_turn_deltas_reject_non_extending_prompt() -> None:
    bad = [Request.make("s", 0, 0.0, [1, 2], [3]), Request.make("s", 1, 1.0, [1, 9, 3, 4], [5])]
    with pytest.raises(ValueError, match="does not extend"):
        turn_deltas(bad)


def test_custom_rows_loaded_by_sglang(tmp_path: Path, sglang_datasets: None) -> None:
    from sglang.benchmark.datasets.custom import sample_custom_requests

    reqs = [Request.make(f"d{i}", 0, float(i), [7] * 5 + [i, i + 1, i + 2], [1, 2, 3]) for i in range(6)]
    path = export_trace(reqs, tmp_path / "x.custom.jsonl", "custom", vocab=VOCAB)
    rows = sample_custom_requests(str(path), num_requests=6, tokenizer=_tokenizer())
    want = {tuple(remap_token(t, VOCAB) for t in r.input_tokens) for r in reqs}
    got = {tuple(_tokenizer().encode(row.prompt)) for row in rows}
    assert got == want
    assert all(row.prompt_len == 8 and row.output_len == 3 for row in rows)


def test_agentic_loaded_by_sglang(tmp_path: Path, sglang_datasets: None) -> None:
    from sglang.benchmark.datasets.agentic_trace import AgenticTraceDataset

    other = [Request.make("t", 0, 0.5, [99, 98, 97], [96, 95])]
    path = export_trace(_session() + other, tmp_path / "a.agentic.json", "agentic", vocab=VOCAB)
    ds = AgenticTraceDataset.from_args(
        Namespace(
            dataset_path=str(path),
            num_prompts=0,
            sharegpt_output_len=None,
            dataset_offset=0,
            agentic_max_turns=None,
        )
    )
    rows = ds.load(_tokenizer())
    assert [len(r.prompt) for r in rows] == [3, 1]
    tok = _tokenizer()
    first = [tok.encode(turn[0]["content"]) for turn in rows[0].prompt]
    assert first == [[remap_token(t, VOCAB) for t in d] for d in turn_deltas(_session())]
    assert rows[0].prompt_len == 4


def test_default_format_and_custom_short_outputs() -> None:
    assert default_format(_session()) == "agentic"
    single = [Request.make("a", 0, 0.0, [1, 2, 3], [4])]
    assert default_format(single) == "custom"
    (row,) = to_custom_rows(single, vocab=VOCAB)
    # bench_serving drops completions shorter than 2 tokens; the export pads to 2
    assert len(row["conversations"][1]["content"].split()) == 2
    assert to_agentic(single)["metadata"]["sessions"] == 1


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "agent.jsonl"
    write_trace(src, _session())
    assert main(["export", str(src), "--out", str(tmp_path / "out"), "--vocab", str(VOCAB)]) == 0
    data = json.loads((tmp_path / "out" / "agent.agentic.json").read_text())
    assert len(data["conversations"]) == 1 and len(data["conversations"][0]) == 3
    assert "agentic" in capsys.readouterr().out
    argv = ["export", str(src), "--out", str(tmp_path / "o2"), "--format", "custom", "--limit", "2"]
    assert main(argv) == 0
    lines = (tmp_path / "o2" / "agent.custom.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert main(["export", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)]) == 2

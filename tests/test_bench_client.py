"""The bench_serving wrapper builds the client command it documents (no server)."""

from __future__ import annotations

import pytest

from benchmarks.bench_client import client_command


def test_client_command_flags() -> None:
    cmd = client_command(
        base_url="http://127.0.0.1:30000",
        dataset_name="custom",
        dataset_path="d.jsonl",
        tokenizer="/m",
        num_prompts=12,
        request_rate=4.0,
        max_concurrency=4,
        output_file="o.jsonl",
        output_len=8,
    )
    args = cmd[3:]
    pairs = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert pairs["--backend"] == "sglang" and pairs["--dataset-name"] == "custom"
    assert pairs["--request-rate"] == "4.0" and pairs["--max-concurrency"] == "4"
    assert pairs["--temperature"] == "0" and pairs["--sharegpt-output-len"] == "8"
    chat = client_command(
        base_url="http://127.0.0.1:1",
        dataset_name="agentic-trace",
        dataset_path="a.json",
        tokenizer="/m",
        num_prompts=2,
        request_rate=1.0,
        max_concurrency=None,
        output_file="o",
    )
    assert "sglang-oai-chat" in chat and "--max-concurrency" not in chat


def test_client_refuses_remote_server() -> None:
    with pytest.raises(ValueError, match="non-local"):
        client_command(
            base_url="http://10.0.0.1:30000",
            dataset_name="custom",
            dataset_path="d",
            tokenizer="t",
            num_prompts=1,
            request_rate=1.0,
            max_concurrency=1,
            output_file="o",
        )

"""Positions a request names itself are planned states from the first request on.

Real CPU server, ``sparse`` on SGLang's default path (extra_buffer, overlap on) with probation off
(``SGLANG_SPARSE_PROBATION=0``), so nothing but the named positions can place a state at a first
divergence, and no learned prior is warm (these are the server's first requests):

* ``/v1/chat/completions``: the second conversation on a new system prompt resumes exactly at the
  end of that system prompt (an automatic chat boundary);
* ``/generate`` with ``sampling_params.custom_params.sparse_checkpoints``: the second question on a
  new document resumes at the document's end; without the hint it resumes nowhere (0);
* greedy tokens equal a no-cache server's.
About 2 minutes on 2 cores.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack(cpu_platform=True)

import requests  # noqa: E402

from benchmarks.bench_client import write_word_chat_template  # noqa: E402
from sglang_sparse.models.tiny import make_tiny_model  # noqa: E402
from sglang_sparse.testing.server import SGLangServer, strategy_setup  # noqa: E402

VOCAB = 4096
SYSTEM = 256  # tokens: on the 64-token state grid, so extra_buffer can resume exactly there
DOC = 320


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def text(ids: list[int]) -> str:
    """Word-level text the tiny tokenizer maps back to exactly ``ids``."""
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_named"), arch="qwen3_next", seed=0)


def server(model_dir: Path, tmp: Path, extra: list[str], strategy: str) -> SGLangServer:
    base, env = strategy_setup(strategy)
    base = tuple(a for a in base if a != "--skip-tokenizer-init")  # the chat endpoint needs it
    tpl = write_word_chat_template(tmp / "word.jinja")
    return SGLangServer(
        model_dir,
        extra_args=[
            "--chunked-prefill-size",
            "256",
            "--chat-template",
            str(tpl),
            "--enable-cache-report",
            *extra,
        ],
        env={**env, "SGLANG_SPARSE_PROBATION": "0", "SGLANG_SPARSE_CHECK_INVARIANTS": "1"},
        base_args=base,
        context_length=2048,
        max_total_tokens=8000,
        max_mamba_cache_size=24,
    ).start(timeout=300)


def chat(srv: SGLangServer, model_dir: Path, messages: list[dict]) -> tuple[str, int]:
    r = requests.post(
        f"{srv.url}/v1/chat/completions",
        json={"model": str(model_dir), "messages": messages, "max_tokens": 4, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return body["choices"][0]["message"]["content"], int(details.get("cached_tokens") or 0)


def scenario(srv: SGLangServer, model_dir: Path) -> dict:
    """Two questions on a document without a hint (the control), three conversations on one new
    system prompt (user turns of 100 tokens: the extend's own last grid point, 320, is not the
    system prompt's end), then two questions on a document named by its first request."""
    system = text(words(SYSTEM, 1))
    out: dict = {}
    # The control first: a document without a hint, while no divergence has been seen (the tail
    # prior learns from 2, so after the conversations below it would plan a state here itself).
    plain_doc = words(DOC, 3)
    first = srv.generate(plain_doc + words(100, 30), 4)
    again = srv.generate(plain_doc + words(90, 31), 4)
    replies, cached = [], []
    for k in range(3):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": text(words(100, 10 + k))}]
        reply, c = chat(srv, model_dir, msgs)
        replies.append(reply)
        cached.append(c)
    out["chat"], out["chat_cached"] = replies, cached
    doc = words(DOC, 2)
    # Questions of 100 tokens: the extend's own last grid point (384) is not the document end, so
    # only a state captured at the named position can serve the next question.
    hinted = srv.generate(
        doc + words(100, 20), 4, sampling_params={"custom_params": {"sparse_checkpoints": [DOC]}}
    )
    second = srv.generate(doc + words(90, 21), 4)
    out["gen"] = [r.output_ids for r in (hinted, second, first, again)]
    out["gen_cached"] = [r.cached_tokens for r in (hinted, second, first, again)]
    return out


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("named")
    out = {}
    for name, extra, strategy in (
        ("nocache", ["--disable-radix-cache"], "no_buffer"),
        ("sparse", ["--radix-cache-backend", "sparse"], "extra_buffer"),
    ):
        with server(model_dir, tmp, extra, strategy) as srv:
            out[name] = scenario(srv, model_dir)
            if name == "sparse":
                out[name]["stats"] = srv.sparse_stats()
    return out


def test_chat_boundary_resumes_the_second_conversation_at_the_system_prompt_end(runs: dict) -> None:
    sp = runs["sparse"]
    print("chat cached:", sp["chat_cached"], "generate cached:", sp["gen_cached"])
    assert sp["chat_cached"][0] == 0
    assert sp["chat_cached"][1] == SYSTEM, sp["chat_cached"]
    assert sp["chat_cached"][2] >= SYSTEM, sp["chat_cached"]
    assert sp["chat"] == runs["nocache"]["chat"]


def test_request_hint_resumes_the_second_question_at_the_document_end(runs: dict) -> None:
    sp = runs["sparse"]
    hinted, second, first, again = sp["gen_cached"]
    assert second == DOC, sp["gen_cached"]  # named by the first request
    assert again == 0, sp["gen_cached"]  # no hint, probation off, no prior yet: nothing was there
    assert sp["gen"] == runs["nocache"]["gen"]
    s = sp["stats"]
    assert s["invariant_violations"] == 0 and s["mirror_errors"] == 0, s

"""Real SGLang 0.5.23 serving tiny random-weight hybrid GDN models on the CPU.

Qwen3-Next (3 GDN + 1 attention layers, MoE MLP): starts the HTTP server and the offline
``sglang.Engine`` once each (class-scoped, so only one runs at a time) and checks greedy tokens
against HF transformers (torch path), prefix-cache reuse, and that bad requests get a clear 400 while
the server keeps serving. Qwen3.5 (``Qwen3_5ForCausalLM``, dense MLP, gated attention): one more
server, greedy tokens and prefix reuse. Skips when torch/sglang/transformers or an ``sgl_kernel``
(real or our CPU shim) are not importable.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack()

from sparse_testing.engine import HFReference, cpu_engine, engine_generate  # noqa: E402

from sglang_sparse.models.tiny import make_tiny_model  # noqa: E402
from sglang_sparse.testing.server import ServerError, SGLangServer  # noqa: E402

VOCAB = 4096
CONTEXT = 512
NEW_TOKENS = 8

# Deterministic prompts of assorted lengths (all ids in [4, VOCAB)).
PROMPTS: list[list[int]] = [
    [5, 6, 7],
    [(i * 37 + 11) % (VOCAB - 4) + 4 for i in range(13)],
    [(i * 101 + 7) % (VOCAB - 4) + 4 for i in range(64)],
    [(i * 997 + 3) % (VOCAB - 4) + 4 for i in range(150)],
]
SHARED_PREFIX = [(i * 53 + 29) % (VOCAB - 4) + 4 for i in range(96)]
PREFIX_A = SHARED_PREFIX + [17, 18, 19]
PREFIX_B = SHARED_PREFIX + [2000, 2001, 2002, 2003, 2004]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_next"), arch="qwen3_next", seed=0)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """HF transformers greedy continuations for every prompt used below."""
    ref = HFReference(model_dir)
    return {tuple(p): ref.greedy(p, NEW_TOKENS) for p in [*PROMPTS, SHARED_PREFIX, PREFIX_A, PREFIX_B]}


class TestHTTPServer:
    @pytest.fixture(scope="class")
    def server(self, model_dir: Path):
        srv = SGLangServer(model_dir, context_length=CONTEXT)
        try:
            srv.start(timeout=300)
        except ServerError as exc:
            pytest.fail(f"SGLang CPU server failed to start: {exc}")
        yield srv
        srv.stop()

    def test_greedy_matches_hf(self, server: SGLangServer, expected) -> None:
        for prompt in PROMPTS:
            out = server.generate(prompt, NEW_TOKENS)
            assert out.output_ids == expected[tuple(prompt)], f"prompt of {len(prompt)} tokens"
            assert out.prompt_tokens == len(prompt)

    def test_prefix_reuse_reports_cached_tokens(self, server: SGLangServer, expected) -> None:
        # With --mamba-radix-cache-strategy no_buffer, SGLang keeps the recurrent state only at the end
        # of each cached sequence, so reuse needs a new prompt that extends a whole earlier prompt.
        first = server.generate(SHARED_PREFIX, NEW_TOKENS)
        assert first.output_ids == expected[tuple(SHARED_PREFIX)]
        for prompt in (PREFIX_A, PREFIX_B):  # both extend SHARED_PREFIX, then diverge from each other
            out = server.generate(prompt, NEW_TOKENS)
            assert 0 < out.cached_tokens <= len(SHARED_PREFIX), out.meta
            assert out.output_ids == expected[tuple(prompt)]

    def test_streaming_reports_ttft_tokens_and_cache(self, server: SGLangServer, expected) -> None:
        """``generate_streaming`` (what ``benchmarks/ttft_paired.py`` times): the same greedy tokens
        and meta_info as ``generate`` (cached tokens included), a first-chunk time inside the
        request's wall time."""
        prompt = PROMPTS[3]
        t0 = time.perf_counter()
        ttft, out = server.generate_streaming(prompt, NEW_TOKENS)
        wall = time.perf_counter() - t0
        assert out.output_ids == expected[tuple(prompt)]
        assert out.prompt_tokens == len(prompt)
        assert 0 < ttft <= wall
        # a prompt extending the whole first sequence reuses it (no_buffer: a state at its end)
        longer = prompt + out.output_ids + [17, 18]
        _, ext = server.generate_streaming(longer, NEW_TOKENS)
        assert ext.prompt_tokens == len(longer)
        assert len(prompt) <= ext.cached_tokens < len(longer), ext.meta

    @pytest.mark.parametrize(
        "name,input_ids,message",
        [
            ("empty", [], "empty"),
            ("out_of_vocab", [5, VOCAB, 7], "out-of-vocabulary"),
            ("negative_id", [5, -1], "out-of-vocabulary"),
            ("over_context", [5] * (CONTEXT + 10), "context length"),
        ],
    )
    def test_bad_request_gets_clear_error(
        self, server: SGLangServer, expected, name, input_ids, message
    ) -> None:
        r = server.post(
            "/generate",
            {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}},
            timeout=60,
        )
        assert r.status_code == 400, (name, r.status_code, r.text[:500])
        assert message in r.json()["error"]["message"], r.text
        # ... and the server keeps serving, with correct results.
        assert server.alive(), server.log_tail()
        out = server.generate(PROMPTS[1], NEW_TOKENS)
        assert out.output_ids == expected[tuple(PROMPTS[1])]


class TestOfflineEngine:
    @pytest.fixture(scope="class")
    def engine(self, model_dir: Path):
        with cpu_engine(model_dir, context_length=CONTEXT) as eng:
            yield eng

    def test_greedy_matches_hf(self, engine, expected) -> None:
        for prompt in PROMPTS:
            out = engine_generate(engine, prompt, NEW_TOKENS)
            assert out.output_ids == expected[tuple(prompt)], f"prompt of {len(prompt)} tokens"

    def test_prefix_reuse_reports_cached_tokens(self, engine, expected) -> None:
        assert engine_generate(engine, SHARED_PREFIX, NEW_TOKENS).output_ids == expected[tuple(SHARED_PREFIX)]
        for prompt in (PREFIX_A, PREFIX_B):
            out = engine_generate(engine, prompt, NEW_TOKENS)
            assert 0 < out.cached_tokens <= len(SHARED_PREFIX), out.meta
            assert out.output_ids == expected[tuple(prompt)]


class TestQwen35Server:
    @pytest.fixture(scope="class")
    def q35_dir(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_5"), arch="qwen3_5", seed=0)

    @pytest.fixture(scope="class")
    def q35_expected(self, q35_dir: Path) -> dict[tuple[int, ...], list[int]]:
        ref = HFReference(q35_dir)
        return {tuple(p): ref.greedy(p, NEW_TOKENS) for p in [*PROMPTS[:3], SHARED_PREFIX, PREFIX_A]}

    @pytest.fixture(scope="class")
    def q35_server(self, q35_dir: Path):
        srv = SGLangServer(q35_dir, context_length=CONTEXT)
        try:
            srv.start(timeout=300)
        except ServerError as exc:
            pytest.fail(f"SGLang CPU server (Qwen3.5) failed to start: {exc}")
        yield srv
        srv.stop()

    def test_greedy_and_prefix_reuse_match_hf(self, q35_server: SGLangServer, q35_expected) -> None:
        for prompt in [*PROMPTS[:3], SHARED_PREFIX]:
            assert q35_server.generate(prompt, NEW_TOKENS).output_ids == q35_expected[tuple(prompt)]
        out = q35_server.generate(PREFIX_A, NEW_TOKENS)
        assert 0 < out.cached_tokens <= len(SHARED_PREFIX), out.meta
        assert out.output_ids == q35_expected[tuple(PREFIX_A)]

"""Two ``sparse`` workers (SGLang's default path: extra_buffer, overlap on) behind SGLang's router.

Real CPU servers and the real router (PyPI ``sglang-router``):

* tokens through the router (``cache_aware`` and ``round_robin``) equal a no-cache server's;
* the per-worker counters (SGLang's Prometheus ``/metrics``) add up to the requests and cached
  tokens the client sees; ``cache_aware`` keeps each document on one worker: three documents asked
  in turn hit more than ``round_robin``, which sends a document's next question to the other
  worker (with one request at a time, sglang-router 0.3.2's ``cache_aware`` sent all nine to one
  worker here: nothing is asserted about its balance);
* a worker killed mid-stream: every request either answers or fails with an HTTP error the client
  sees (none hangs), the survivor then serves everything with tokens unchanged; the worker
  restarted on its port rejoins (the router reports it healthy and routes requests to it).

About 4 minutes on 2 cores.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from sparse_testing.stack import SERVING_MODULES, require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack((*SERVING_MODULES, "sglang_router"), cpu_platform=True)

import requests  # noqa: E402

from sglang_sparse.models.tiny import make_tiny_model  # noqa: E402
from sglang_sparse.testing.router import Router, worker_counters  # noqa: E402
from sglang_sparse.testing.server import SGLangServer, strategy_setup  # noqa: E402

VOCAB = 4096
DOC = 320  # tokens, on the 64-token state grid
QUESTION = 40


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def text(ids: list[int]) -> str:
    """Word-level text the tiny tokenizer maps back to exactly ``ids`` (the router's
    ``cache_aware`` tree works on request text)."""
    return " ".join(f"w{i}" for i in ids)


#: three documents, three questions each, asked in turn (d0q0, d1q0, d2q0, d0q1, ...): with two
#: workers, round robin sends each document's next question to the other worker
PROMPTS = [text(words(DOC, d) + words(QUESTION, 100 + 10 * d + q)) for q in range(3) for d in range(3)]


def start(model_dir: Path, log: Path, strategy: str, extra: list[str]) -> SGLangServer:
    base, env = strategy_setup(strategy)
    return SGLangServer(
        model_dir,
        extra_args=["--chunked-prefill-size", "256", "--enable-metrics", *extra],
        env={**env, "SGLANG_SPARSE_LOG_EVERY": "0"},
        base_args=tuple(a for a in base if a != "--skip-tokenizer-init"),
        context_length=2048,
        max_total_tokens=8000,
        max_mamba_cache_size=32,
        log_path=log,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("router")
    model_dir = make_tiny_model(tmp / "model", arch="qwen3_next", seed=0)
    sparse = ["--radix-cache-backend", "sparse"]
    servers = [start(model_dir, tmp / f"w{i}.log", "extra_buffer", sparse) for i in range(2)]
    ref = start(model_dir, tmp / "nocache.log", "no_buffer", ["--disable-radix-cache"])
    import concurrent.futures

    try:
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            for f in [ex.submit(s.start, 600.0) for s in (*servers, ref)]:
                f.result()
        expected = [generate(ref.url, p)[0] for p in PROMPTS]
        yield {"workers": servers, "expected": expected, "tmp": tmp}
    finally:
        for s in (*servers, ref):
            s.stop()


def generate(url: str, prompt: str, timeout: float = 120.0) -> tuple[list[int], int]:
    r = requests.post(
        f"{url}/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}},
        timeout=timeout,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return list(body["output_ids"]), int(body["meta_info"].get("cached_tokens") or 0)


def routed_pass(cluster: dict, policy: str) -> dict:
    workers = cluster["workers"]
    for w in workers:
        assert w.flush_cache()
    before = [worker_counters(w.url) for w in workers]
    with Router([w.url for w in workers], policy, log_path=cluster["tmp"] / f"router_{policy}.log") as router:
        outs = [generate(router.url, p) for p in PROMPTS]
    after = [worker_counters(w.url) for w in workers]
    per_worker = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    return {"ids": [o for o, _ in outs], "cached": [c for _, c in outs], "per_worker": per_worker}


@pytest.fixture(scope="module")
def passes(cluster: dict) -> dict:
    return {p: routed_pass(cluster, p) for p in ("cache_aware", "round_robin")}


def test_tokens_through_the_router_equal_no_cache(cluster: dict, passes: dict) -> None:
    for policy, run in passes.items():
        assert run["ids"] == cluster["expected"], policy


def test_worker_counters_add_up_to_what_the_client_sees(passes: dict) -> None:
    for policy, run in passes.items():
        pw = run["per_worker"]
        assert sum(w["requests"] for w in pw) == len(PROMPTS), (policy, pw)
        assert sum(w["cached_tokens"] for w in pw) == sum(run["cached"]), (policy, pw, run["cached"])
    # round robin alternates (5 + 4); cache_aware may keep one-at-a-time traffic on one worker
    assert sorted(w["requests"] for w in passes["round_robin"]["per_worker"]) == [4, 5]


def test_cache_aware_keeps_a_document_on_its_worker(passes: dict) -> None:
    ca, rr = passes["cache_aware"], passes["round_robin"]
    print("cached per request: cache_aware", ca["cached"], "round_robin", rr["cached"])
    # every later question on a document finds the document's states on its worker
    assert all(c > 0 for c in ca["cached"][3:]), ca["cached"]
    # round robin sends the second question on each document to the other worker: a miss
    assert rr["cached"][3:6] == [0, 0, 0], rr["cached"]
    assert sum(ca["cached"]) > sum(rr["cached"])


def test_killed_worker_fails_visibly_and_rejoins_after_restart(cluster: dict, passes: dict) -> None:
    workers, expected = cluster["workers"], cluster["expected"]
    with Router(
        [w.url for w in workers], "round_robin", log_path=cluster["tmp"] / "router_fault.log"
    ) as router:
        victim = workers[1]
        victim.stop()  # SIGKILL of launcher, scheduler and detokenizer at once: a crash, not a drain
        statuses, outputs = [], []
        for i, p in enumerate(PROMPTS):
            # a hang would raise requests.Timeout here and fail the test
            r = requests.post(
                f"{router.url}/generate",
                json={
                    "text": p,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                },
                timeout=120,
            )
            statuses.append(r.status_code)
            if r.status_code == 200:
                outputs.append((i, r.json()["output_ids"]))
        print("statuses after the kill:", statuses)
        assert all(s == 200 or s >= 500 for s in statuses), statuses  # errors are visible HTTP errors
        assert statuses[-4:] == [200] * 4, statuses  # the survivor takes over
        assert all(ids == expected[i] for i, ids in outputs)

        victim.start(timeout=600)
        assert router.wait_healthy(2, timeout=120), router.workers()
        before = worker_counters(victim.url)
        for i, p in enumerate(PROMPTS[:6]):
            assert generate(router.url, p)[0] == expected[i]
        served = worker_counters(victim.url)["requests"] - before["requests"]
        assert served > 0, "the restarted worker got no request"

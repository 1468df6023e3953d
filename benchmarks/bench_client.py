"""Run SGLang's own serving benchmark client (``sglang.benchmark.serving``) against a local server.

A thin subprocess wrapper: Poisson arrivals (``--request-rate``), ``--max-concurrency``, TTFT/ITL
percentiles and throughputs all come from the client; this module only builds its command line and
reads the JSONL line it appends to ``--output-file``. The ``datasets`` (HF) package is only needed by
the client's MMMU loader; when it is not installed a stub module is put in its place so the client
imports (``custom`` and ``agentic-trace`` datasets do not use it).

Datasets come from ``python -m sglang_sparse.traces export`` (``sglang_sparse.traces.export``).

Server requirements (checked end to end against a CPU server, see ``benchmarks/serving_load.py``):

* the server must run **with its tokenizer** (no ``--skip-tokenizer-init``): the client sends text
  and times the first streamed chunk that carries ``text``; without a tokenizer every request
  "succeeds" with empty text and TTFT 0 (:func:`check_row` rejects such rows);
* the ``agentic-trace`` dataset goes through ``/v1/chat/completions``, so the model needs a chat
  template; the tiny test models have none, pass ``--chat-template`` with
  :func:`write_word_chat_template` (message contents joined by spaces: with the word-level
  tokenizer each turn's prompt is then exactly the previous prompt, the previous reply and the new
  message, token for token).

:class:`ClientWorker` runs many benchmarks in one client process (importing the client takes
~10 s on the 2-core machine, longer than a small run).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_STUB = (
    "import sys, types\n"
    "try:\n"
    "    import datasets  # noqa: F401\n"
    "except ImportError:\n"
    "    m = types.ModuleType('datasets'); m.load_dataset = None; sys.modules['datasets'] = m\n"
    "from sglang.benchmark.serving import cli_main\n"
)
_BOOT = _STUB + "sys.argv = ['sglang.benchmark.serving'] + sys.argv[1:]\ncli_main()\n"

#: marker line the persistent worker prints after each run (followed by a JSON status)
_DONE = "@@bench_client_done@@"
_LOOP = _STUB + (
    "import json, traceback\n"
    "for line in sys.stdin:\n"
    "    sys.argv = ['sglang.benchmark.serving'] + json.loads(line)\n"
    "    status = {'rc': 0, 'error': ''}\n"
    "    try:\n"
    "        cli_main()\n"
    "    except SystemExit as e:\n"
    "        status['rc'] = e.code if isinstance(e.code, int) else 1\n"
    "    except BaseException:\n"
    "        status = {'rc': 1, 'error': traceback.format_exc()[-3000:]}\n"
    "    sys.stderr.flush()\n"
    f"    print({_DONE!r} + json.dumps(status), flush=True)\n"
)

#: a chat template for the tiny word-level models: message contents joined by single spaces
WORD_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def client_command(
    *,
    base_url: str,
    dataset_name: str,
    dataset_path: str | Path,
    tokenizer: str | Path,
    num_prompts: int,
    request_rate: float,
    max_concurrency: int | None,
    output_file: str | Path,
    output_len: int | None = None,
    seed: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``python -c <boot> ARGS`` command running the client once (greedy, loopback only)."""
    if not base_url.startswith(("http://127.0.0.1", "http://localhost")):
        raise ValueError(f"refusing a non-local server: {base_url}")
    backend = "sglang-oai-chat" if dataset_name == "agentic-trace" else "sglang"
    cmd = [
        sys.executable, "-c", _BOOT,
        "--backend", backend,
        "--base-url", base_url,
        "--dataset-name", dataset_name,
        "--dataset-path", str(dataset_path),
        "--tokenizer", str(tokenizer),
        "--model", str(tokenizer),
        "--num-prompts", str(num_prompts),
        "--request-rate", str(request_rate),
        "--output-file", str(output_file),
        "--seed", str(seed),
        "--temperature", "0",
        "--disable-tqdm",
    ]  # fmt: skip
    if max_concurrency:
        cmd += ["--max-concurrency", str(max_concurrency)]
    if output_len:
        cmd += ["--sharegpt-output-len", str(output_len)]
    return cmd + list(extra)


def write_word_chat_template(path: str | Path) -> Path:
    """Write :data:`WORD_CHAT_TEMPLATE` to ``path`` (a ``.jinja`` file for ``--chat-template``)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(WORD_CHAT_TEMPLATE + "\n")
    return p


def check_row(row: dict[str, Any], allow_errors: bool = False) -> dict[str, Any]:
    """Raise ``RuntimeError`` when a client row cannot be a real measurement, else return it.

    Catches what the client reports as success: no completed request, failed requests (their
    ``errors`` when ``--output-details`` was given; accepted with ``allow_errors``, for runs that
    inject failures and count them), and TTFT 0 with empty generated texts (a server started with
    ``--skip-tokenizer-init`` streams ids but no ``text``, which is what the client times).
    """
    completed = int(row.get("completed") or 0)
    if completed == 0:
        raise RuntimeError(f"bench client completed no request: {str(row.get('errors'))[:2000]}")
    errors = [e for e in row.get("errors") or [] if e]
    if errors and not allow_errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, first: {errors[0][:2000]}")
    texts = row.get("generated_texts")
    if not row.get("median_ttft_ms") or (texts is not None and not any(texts)):
        raise RuntimeError(
            "bench client measured TTFT 0 / empty outputs: the server streams no text; start it "
            "with its tokenizer (without --skip-tokenizer-init)"
        )
    return row


def _read_row(out: Path) -> dict[str, Any]:
    return json.loads(out.read_text().strip().splitlines()[-1])


def _fresh(output_file: str | Path) -> Path:
    out = Path(output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()
    return out


class ClientWorker:
    """One long-lived client process running many benchmarks (arguments: :func:`client_command`).

    The process imports ``sglang.benchmark.serving`` once and then runs ``cli_main`` once per
    :meth:`run` (the client re-seeds ``random``/``numpy`` from ``--seed`` on every run, so the
    dataset order and the Poisson arrival times are the same as a fresh process's). Use as a
    context manager; :meth:`close` ends the process.
    """

    def __init__(self, python: str | None = None) -> None:
        self._cmd = [python or sys.executable, "-c", _LOOP]
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._tail: deque[str] = deque(maxlen=80)

    def start(self) -> ClientWorker:
        """Start the process now (its ~10 s import then overlaps with whatever the caller does
        next, e.g. starting servers); :meth:`run` starts it on demand otherwise."""
        self._start()
        return self

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                self._cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
            self._lines = queue.Queue()
            threading.Thread(target=self._pump, args=(self._proc, self._lines), daemon=True).start()
        return self._proc

    @staticmethod
    def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def run(
        self, output_file: str | Path, timeout: float = 1800.0, allow_errors: bool = False, **kwargs: Any
    ) -> dict[str, Any]:
        """Run one benchmark and return its checked result row (:func:`check_row`); ``timeout`` in
        seconds (on timeout the worker is killed and the next :meth:`run` starts a new one)."""
        out = _fresh(output_file)
        args = client_command(output_file=out, **kwargs)[3:]
        proc = self._start()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(args) + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + timeout
        self._tail.clear()
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise RuntimeError(f"bench client timed out after {timeout:.0f}s") from None
            if line is None:
                self._proc = None
                raise RuntimeError("bench client process exited:\n" + "".join(self._tail))
            if line.startswith(_DONE):
                status = json.loads(line[len(_DONE) :])
                break
            self._tail.append(line)
        if status["rc"] != 0 or not out.exists():
            tail = "".join(self._tail)[-3000:] + status.get("error", "")
            raise RuntimeError(f"bench client failed (rc={status['rc']}):\n{tail}")
        return check_row(_read_row(out), allow_errors)

    def close(self) -> None:
        """End the worker process (closing its stdin, then killing it if it lingers)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> ClientWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

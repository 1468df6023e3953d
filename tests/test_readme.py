"""The README is for users: at most 150 lines, the two set-up commands first (the second is what
``.ci/run`` runs), the options table generated from ``SparseConfig``, no commit hashes, and every
results file it names committed."""

from __future__ import annotations

import re
from pathlib import Path

from sglang_sparse.sglang_adapter.config import options_table

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
#: a git object name: 7-40 hex digits with at least one letter and one digit
COMMIT = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")


def test_at_most_150_lines() -> None:
    assert len(README.splitlines()) <= 150


def test_the_two_setup_commands_come_first_and_ci_runs_the_second() -> None:
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    cmds = [line.split("#")[0].strip() for line in block]
    assert cmds == [
        "bash tools/setup_env.sh && .venv/bin/python -m benchmarks",
        "bash tools/setup_env.sh && .venv/bin/python -m pytest",
    ]
    assert README.index("```bash") < README.index("\n## ")
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash tools/setup_env.sh" in ci and ".venv/bin/python -m pytest\n" in ci


def test_the_options_table_is_the_generated_one() -> None:
    start = README.index("<!-- options:")
    body = README[README.index("\n", start) + 1 : README.index("<!-- /options -->")]
    assert body.strip() == options_table(), "regenerate with sglang_adapter.config.options_table()"


def test_commit_pattern_finds_hashes_and_spares_numbers_and_words() -> None:
    assert COMMIT.findall("at a10dbc8 and 4edd7ea0; 1234567 tokens, facade, sim_compare_4a.json") == [
        "a10dbc8",
        "4edd7ea0",
    ]


def test_no_commit_hashes() -> None:
    assert COMMIT.findall(README) == []


def test_every_results_file_named_exists() -> None:
    names = set(re.findall(r"`((?:serving|sim|placement|scheduler|cache)[\w*<>-]*\.(?:json|png))`", README))
    assert len(names) >= 8, names
    results = REPO / "benchmarks" / "results"
    for name in names:
        pattern = name.replace("<trace>", "*")
        assert list(results.glob(pattern)), name

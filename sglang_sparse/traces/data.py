"""Readers for the real, read-only input data (never copied into the repo).

The data directory holds ``system_prompts.tar.gz``, ``swe_agent_trajectories.tar.gz`` and
``quality_example.jsonl``. It is found, in order, from an explicit argument, the environment
variable ``SGLANG_SPARSE_DATA``, or ``<repo>/../shared/data``. Tarballs are read directly with
:mod:`tarfile`. All loaders return items in a deterministic (sorted-by-name) order.
"""

from __future__ import annotations

import functools
import html
import json
import os
import re
import tarfile
import warnings
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

ENV_VAR = "SGLANG_SPARSE_DATA"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"

SYSTEM_PROMPTS_TAR = "system_prompts.tar.gz"
TRAJECTORIES_TAR = "swe_agent_trajectories.tar.gz"
QUALITY_JSONL = "quality_example.jsonl"
DATA_FILES = (SYSTEM_PROMPTS_TAR, TRAJECTORIES_TAR, QUALITY_JSONL)

_PROMPT_SUFFIXES = (".md", ".txt", ".json")


class DataNotFoundError(FileNotFoundError):
    """The data directory or one of its files is missing; the message says where we looked."""


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The data directory to use (argument > ``$SGLANG_SPARSE_DATA`` > ``<repo>/../shared/data``).
    Raises DataNotFoundError if it is not a directory."""
    if data_dir is not None:
        p, how = Path(data_dir), "--data-dir/data_dir argument"
    elif os.environ.get(ENV_VAR):
        p, how = Path(os.environ[ENV_VAR]), f"${ENV_VAR}"
    else:
        p, how = DEFAULT_DATA_DIR, "default location"
    if not p.is_dir():
        raise DataNotFoundError(
            f"trace data directory not found: {p} (from {how}); pass --data-dir DIR or set "
            f"{ENV_VAR}=DIR to a folder holding {', '.join(DATA_FILES)}"
        )
    return p.resolve()


def data_file(data_dir: str | os.PathLike[str] | None, name: str) -> Path:
    """Path of one data file; raises DataNotFoundError if it is absent."""
    d = resolve_data_dir(data_dir)
    p = d / name
    if not p.is_file():
        raise DataNotFoundError(
            f"missing data file {p}; pass --data-dir DIR or set {ENV_VAR}=DIR to a folder holding it"
        )
    return p


def _is_prompt_member(m: tarfile.TarInfo) -> bool:
    name = m.name
    base = name.rsplit("/", 1)[-1]
    return (
        m.isfile()
        and name.endswith(_PROMPT_SUFFIXES)
        and "/.github/" not in name
        and not base.upper().startswith("LICENSE")
    )


@functools.lru_cache(maxsize=4)
def _load_system_prompts(path: Path) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    with tarfile.open(path, "r:gz") as tar:
        for m in tar:
            if not _is_prompt_member(m):
                continue
            f = tar.extractfile(m)
            if f is None:
                continue
            text = f.read().decode("utf-8", errors="replace").strip()
            if text:
                out.append((m.name, text))
    out.sort()
    return tuple(out)


def load_system_prompts(data_dir: str | os.PathLike[str] | None = None) -> tuple[tuple[str, str], ...]:
    """``(member_name, text)`` of every non-empty .md/.txt/.json system prompt, sorted by name.
    Repository chrome (``.github/``, licence files) is skipped; READMEs are kept (some are prompts)."""
    return _load_system_prompts(data_file(data_dir, SYSTEM_PROMPTS_TAR))


@dataclass(frozen=True)
class Trajectory:
    """One SWE-agent run: ``messages`` are OpenAI-style dicts with role/content/tool_calls only."""

    instance_id: str
    messages: tuple[dict[str, Any], ...]


def _slim(msg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": str(msg.get("role", "")), "content": msg.get("content") or ""}
    if not isinstance(out["content"], str):
        out["content"] = json.dumps(out["content"], ensure_ascii=False, sort_keys=True)
    if msg.get("tool_calls"):
        out["tool_calls"] = [
            {"function": {k: c.get("function", {}).get(k) for k in ("name", "arguments")}}
            for c in msg["tool_calls"]
        ]
    return out


@functools.lru_cache(maxsize=4)
def _load_trajectories(path: Path) -> tuple[tuple[Trajectory, ...], tuple[str, ...]]:
    trajs: list[Trajectory] = []
    skipped: list[str] = []
    with tarfile.open(path, "r:gz") as tar:
        for m in tar:
            if not (m.isfile() and m.name.endswith(".traj.json")):
                continue
            f = tar.extractfile(m)
            raw = f.read() if f is not None else b""
            if not raw.strip():
                skipped.append(m.name)
                continue
            try:
                d = json.loads(raw)
                msgs = d["messages"]
            except (json.JSONDecodeError, KeyError, TypeError):
                skipped.append(m.name)
                continue
            iid = str(d.get("instance_id") or m.name.rsplit("/", 1)[-1].removesuffix(".traj.json"))
            trajs.append(Trajectory(iid, tuple(_slim(x) for x in msgs if isinstance(x, dict))))
    trajs.sort(key=lambda t: t.instance_id)
    return tuple(trajs), tuple(sorted(skipped))


def load_trajectories(data_dir: str | os.PathLike[str] | None = None) -> tuple[Trajectory, ...]:
    """All usable SWE-agent trajectories sorted by instance id.

    Empty or unparsable files (the data set has one empty placeholder) are skipped with a
    ``UserWarning`` naming them; the warning is issued on every call."""
    trajs, skipped = _load_trajectories(data_file(data_dir, TRAJECTORIES_TAR))
    if skipped:
        warnings.warn(
            f"skipped {len(skipped)} empty/unparsable trajectory file(s): {', '.join(skipped)}",
            UserWarning,
            stacklevel=2,
        )
    return trajs


class _TextExtractor(HTMLParser):
    _BLOCK = {"p", "br", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "div", "li", "tr"}
    _SKIP = {"script", "style", "head", "title"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self._skip += 1
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP:
            self._skip = max(0, self._skip - 1)
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def strip_html(markup: str) -> str:
    """Plain text of an HTML page: tags dropped, entities decoded, whitespace normalised. Paragraphs are
    separated by one blank line; runs of spaces inside a paragraph become one space."""
    p = _TextExtractor()
    p.feed(markup)
    p.close()
    text = html.unescape("".join(p.parts))
    paras = [re.sub(r"\s+", " ", block).strip() for block in re.split(r"\n\s*\n", text)]
    return "\n\n".join(x for x in paras if x)


@dataclass(frozen=True)
class QualityArticle:
    """A QuALITY article: plain ``text`` (HTML stripped) and its real multiple-choice questions."""

    article_id: str
    title: str
    text: str
    questions: tuple[str, ...]


@functools.lru_cache(maxsize=4)
def _load_quality(path: Path) -> tuple[QualityArticle, ...]:
    by_id: dict[str, tuple[str, str, list[str]]] = {}
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            art = d.get("article", "")
            markup = "".join(art) if isinstance(art, list) else str(art)
            aid = str(d.get("article_id", len(by_id)))
            qs: list[str] = []
            for i in range(1, 100):
                q = d.get(f"question{i}")
                if q is None:
                    break
                opts = [d.get(f"question{i}option{j}") for j in range(1, 5)]
                opts_text = "\n".join(f"({chr(65 + j)}) {o}" for j, o in enumerate(opts) if o)
                qs.append(f"{q}\n{opts_text}" if opts_text else str(q))
            if aid in by_id:
                by_id[aid][2].extend(q for q in qs if q not in by_id[aid][2])
            else:
                by_id[aid] = (str(d.get("title", "")), strip_html(markup), qs)
    return tuple(
        QualityArticle(aid, title, text, tuple(qs)) for aid, (title, text, qs) in sorted(by_id.items())
    )


def load_quality(data_dir: str | os.PathLike[str] | None = None) -> tuple[QualityArticle, ...]:
    """QuALITY articles (lines with the same ``article_id`` merged; questions de-duplicated)."""
    return _load_quality(data_file(data_dir, QUALITY_JSONL))

"""Command line: ``python -m sglang_sparse.traces {build,list,summary,export}``.

* ``build [NAMES...|all] --out traces/build --seed 0 [--data-dir DIR] [--param KEY=VALUE ...]``
  writes ``<out>/<name>.jsonl`` + ``<out>/<name>.meta.json`` and prints one line per trace.
* ``list`` prints trace names with a one-line description.
* ``summary PATH... [--plot out.png]`` prints stats (lengths and overlap depths in tokens).
* ``export PATH... --out DIR [--format custom|agentic] [--vocab V] [--limit N]`` writes
  ``python -m sglang.bench_serving`` datasets (see :mod:`sglang_sparse.traces.export`).

User errors (bad trace file, unknown name, missing data) print ``error: ...`` on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .builders import TRACE_NAMES, TRACES, build_trace_with_meta, get_spec, resolve_params
from .data import ENV_VAR, REPO_ROOT, resolve_data_dir
from .schema import TraceFormatError, read_trace, write_meta, write_trace

DEFAULT_OUT = REPO_ROOT / "traces" / "build"


class CLIError(Exception):
    """A user-facing error: printed without traceback, exit code 2."""


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_params(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CLIError(f"--param expects KEY=VALUE, got {item!r}")
        out[key.strip()] = _parse_value(value)
    return out


def _names(requested: Sequence[str]) -> list[str]:
    if not requested or list(requested) == ["all"]:
        return list(TRACE_NAMES)
    for n in requested:
        get_spec(n)  # raises ValueError listing the valid names
    return list(dict.fromkeys(requested))


def _split_params(names: Sequence[str], params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Route ``--param`` values: ``name.key=v`` to one trace, ``key=v`` to every trace accepting it."""
    per: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, value in params.items():
        if "." in key:
            tname, _, k = key.partition(".")
            if tname not in per:
                raise CLIError(f"--param {key}: trace {tname!r} is not being built")
            per[tname][k] = value
            continue
        takers = [n for n in names if key in TRACES[n].defaults()]
        if not takers:
            raise CLIError(f"--param {key}: no selected trace has this parameter")
        for n in takers:
            per[n][key] = value
    for n in names:
        resolve_params(n, per[n])  # validates names
    return per


class _NoBar(list[str]):
    """Stand-in for a tqdm bar when tqdm is missing or ``--quiet`` is given."""

    def set_postfix_str(self, _s: str) -> None:
        """Ignored."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _progress(names: list[str], quiet: bool) -> Any:
    """A tqdm bar over ``names`` on stderr, or a silent :class:`_NoBar`."""
    if quiet:
        return _NoBar(names)
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(names)
    from sglang_sparse.progress import bar_options

    return tqdm(names, desc="traces", unit="trace", **bar_options(sys.stderr))


def _cmd_build(args: argparse.Namespace) -> int:
    names = _names(args.names)
    per = _split_params(names, _parse_params(args.param))
    resolve_data_dir(args.data_dir)  # fail early (exit 2) before the progress bar starts
    out = Path(args.out)
    lines: list[str] = []
    t_all = time.perf_counter()
    with _progress(names, args.quiet) as bar:
        for name in bar:
            bar.set_postfix_str(f"{name}: building")
            t0 = time.perf_counter()  # progress display only; never written into a trace
            reqs, meta = build_trace_with_meta(name, args.seed, args.data_dir, **per[name])
            bar.set_postfix_str(f"{name}: writing")
            path = out / f"{name}.jsonl"
            size = write_trace(path, reqs)
            write_meta(path, meta)
            lines.append(
                f"{name}: {meta['num_requests']:,} requests, {meta['num_sessions']:,} sessions, "
                f"{meta['total_input_tokens']:,} input + {meta['total_output_tokens']:,} output tokens, "
                f"{size / 1e6:.1f} MB -> {path} ({time.perf_counter() - t0:.1f}s)"
            )
            if hasattr(bar, "write"):  # tqdm: print above the bar without garbling it
                bar.write(lines[-1], file=sys.stdout)
            else:
                print(lines[-1], flush=True)
    print(f"built {len(names)} trace(s) in {time.perf_counter() - t_all:.1f}s")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    width = max(len(n) for n in TRACE_NAMES)
    for name in TRACE_NAMES:
        print(f"{name:<{width}}  {TRACES[name].description}")
    return 0


def _cmd_summary(args: argparse.Namespace) -> int:
    from .overlap import overlap_depths
    from .summary import format_summary, plot_overlap_histograms, summarize

    series = []
    for p in args.paths:
        reqs = read_trace(p)
        depths = overlap_depths(reqs)
        print(format_summary(str(p), summarize(reqs, depths)))
        series.append((Path(p).name, depths))
    if args.plot:
        plot_overlap_histograms(series, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .export import default_format, export_trace

    out = Path(args.out)
    for path in args.paths:
        reqs = read_trace(path)
        if args.limit:
            reqs = reqs[: args.limit]
        fmt = args.format or default_format(reqs)
        stem = Path(path).name.removesuffix(".jsonl")
        dest = out / (f"{stem}.custom.jsonl" if fmt == "custom" else f"{stem}.agentic.json")
        decode = None
        if args.text == "qwen":  # the traces' own tokenizer: real text for a real Qwen3.5/3-Next checkpoint
            from .tokenizer import get_tokenizer

            decode = get_tokenizer().decode
        export_trace(reqs, dest, fmt, vocab=args.vocab, name=stem, decode=decode)
        print(f"wrote {dest} ({fmt}, {len(reqs)} requests)")
    return 0


def make_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    p = argparse.ArgumentParser(prog="python -m sglang_sparse.traces", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build traces into --out")
    b.add_argument("names", nargs="*", help=f"trace names or 'all' (default all): {', '.join(TRACE_NAMES)}")
    b.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default traces/build)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument(
        "--data-dir", default=None, help=f"input data folder (default ${ENV_VAR} or ../shared/data)"
    )
    b.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="[TRACE.]KEY=VALUE",
        help="override a builder parameter (JSON value), e.g. --param agent.num_sessions=8",
    )
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=_cmd_build)
    ls = sub.add_parser("list", help="list trace names")
    ls.set_defaults(func=_cmd_list)
    s = sub.add_parser("summary", help="print stats of trace files")
    s.add_argument("paths", nargs="+")
    s.add_argument("--plot", default=None, help="write a PNG histogram of overlap depth")
    s.set_defaults(func=_cmd_summary)
    e = sub.add_parser("export", help="write bench_serving datasets (custom JSONL / agentic JSON)")
    e.add_argument("paths", nargs="+", help="trace JSONL files")
    e.add_argument("--out", required=True, help="output folder")
    e.add_argument("--format", choices=("custom", "agentic"), default=None, help="default: by trace shape")
    e.add_argument("--vocab", type=int, default=None, help="remap ids into this model vocabulary")
    e.add_argument("--limit", type=int, default=0, help="first N requests only (0: all)")
    e.add_argument(
        "--text",
        choices=("word", "qwen"),
        default="word",
        help="word: w<id> words for the tiny test models' tokenizer (default); qwen: real text decoded "
        "with the traces' Qwen3.5 tokenizer, for a real checkpoint (do not combine with --vocab)",
    )
    e.set_defaults(func=_cmd_export)
    return p


def _show_warning(message: Warning | str, category: type[Warning], *_args: Any, **_kw: Any) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 2 user error)."""
    args = make_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return int(args.func(args))
    except (CLIError, TraceFormatError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

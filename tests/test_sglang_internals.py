"""The contract with SGLang's internals (``sglang_adapter/sglang_internals.py``): every hook target
and private SGLang name the adapter uses resolves in the installed SGLang, a moved one is named,
and the adapter's subclasses override no private SGLang method the list does not name."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sglang_sparse.sglang_adapter import plugin  # noqa: E402
from sglang_sparse.sglang_adapter.sglang_internals import (  # noqa: E402
    CAPTURE_HOOKS,
    HOOKS,
    PRIVATE,
    Internal,
    resolve,
    unresolved,
)

ADAPTER = Path(plugin.__file__).parent


def test_every_listed_name_resolves_in_the_installed_sglang() -> None:
    assert unresolved() == []


def test_a_renamed_hook_target_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    fn = ScheduleBatch.prepare_for_decode
    monkeypatch.delattr(ScheduleBatch, "prepare_for_decode")
    monkeypatch.setattr(ScheduleBatch, "prepare_for_decode_v2", fn, raising=False)
    missing = unresolved()
    assert len(missing) == 1 and missing[0].startswith(HOOKS["decode"].target), missing
    assert "has no attribute 'prepare_for_decode'" in missing[0], missing


def test_a_renamed_private_method_and_a_dropped_field_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    monkeypatch.delattr(UnifiedTreeCore, "_cascade_evict")
    missing = unresolved()
    assert [m.split()[0] for m in missing] == [f"{UnifiedTreeCore.__module__}.UnifiedTreeCore._cascade_evict"]
    ghost = Internal(f"{UnifiedTreeCore.__module__}.UnifiedTreeCore", "_no_such_field", "read", "cache", True)
    assert len(unresolved([ghost])) == 1 and "assigns self._no_such_field" in unresolved([ghost])[0]
    assert unresolved([Internal("sglang.srt.no_such_module", "f", "call", "x")]) != []


def test_resolve_imports_the_longest_module_prefix() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    assert resolve(HOOKS["adder"].target) is Scheduler.get_prefill_adder_class
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        resolve("sglang.srt.managers.scheduler.Scheduler.nope")


def test_the_plugin_registers_exactly_the_listed_hooks() -> None:
    handlers = plugin._hook_handlers()  # noqa: SLF001
    assert handlers.keys() == HOOKS.keys()
    assert all(callable(fn) for fn in handlers.values())
    assert {h.kind for h in HOOKS.values()} <= {"AROUND", "AFTER"}
    assert set(CAPTURE_HOOKS) <= HOOKS.keys()
    assert plugin._CAPTURE_TARGETS == tuple(HOOKS[r].target for r in CAPTURE_HOOKS)  # noqa: SLF001


def _sglang_subclasses() -> list[tuple[type, set[str]]]:
    """(class, names of the private methods its own body defines) for every adapter class with an
    SGLang base."""
    out = []
    for path in sorted(ADAPTER.glob("*.py")):
        module = importlib.import_module(f"sglang_sparse.sglang_adapter.{path.stem}")
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.ClassDef):
                continue
            cls = getattr(module, node.name)
            if any(b.__module__.startswith("sglang.") for b in cls.__mro__[1:]):
                defs = {
                    n.name
                    for n in node.body
                    if isinstance(n, ast.FunctionDef)
                    and n.name.startswith("_")
                    and not n.name.startswith("__")
                }
                out.append((cls, defs))
    return out


def test_every_private_override_is_listed() -> None:
    """A private method of an adapter subclass that an SGLang base also defines is an override and
    must be in PRIVATE (else an SGLang rename leaves it a dead method); a listed override must
    exist on an SGLang base of some adapter class."""
    listed = {(e.owner, e.name) for e in PRIVATE if e.use == "override"}
    found = set()
    subclasses = _sglang_subclasses()
    assert len(subclasses) >= 4, subclasses  # the tree core, two components, the cache
    for cls, defs in subclasses:
        for base in cls.__mro__[1:]:
            if not base.__module__.startswith("sglang."):
                continue
            for name in defs & set(vars(base)):
                found.add((f"{base.__module__}.{base.__qualname__}", name))
    # an override found on a base class above the listed owner counts for the listed one
    unlisted = {
        (owner, name)
        for owner, name in found
        if not any(n == name and issubclass(resolve(o), resolve(owner)) for o, n in listed)
    }
    assert unlisted == set(), (
        f"private SGLang methods overridden but not in sglang_internals.PRIVATE: {unlisted}"
    )
    assert {n for _, n in listed} <= {n for _, n in found}, (listed, found)

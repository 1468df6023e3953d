"""Workarounds that let FLA's Triton kernels run under ``TRITON_INTERPRET=1`` on a CPU-only machine.

Nothing here edits site-packages; every change is a monkey-patch applied (idempotently) at run time by
:func:`enable_interpreter_workarounds`, which must be called **after** ``TRITON_INTERPRET=1`` is set in
the environment and **before** any FLA kernel is launched.  The patches only matter when the interpreter
is active; on a real GPU do not call this function.

Obstacles and their fixes (verified with triton 3.9.0 / flash-linear-attention 0.6.0):

1. *Autotuner benchmarking.*  ``triton.runtime.autotuner.Autotuner.run`` benchmarks every candidate
   config via ``driver.active.get_benchmarker()``; with no GPU there is no active driver and it raises
   ``RuntimeError: 0 active drivers``.  Fix: wrap ``Autotuner.prune_configs`` so that it returns only the
   first surviving config; ``Autotuner.run`` then takes its "single config, no benchmark" path.  (FLA's
   ``CachedAutotuner`` subclasses ``Autotuner`` and goes through the same ``run``.)

2. *Loop induction variables are Python ints.*  The interpreter runs the kernel as Python, so in
   ``for i_t in range(NT): i_t.to(tl.int64)`` (e.g. ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``)
   ``i_t`` is an ``int`` and ``.to`` raises ``AttributeError``.  Fix: replace the interpreter's AST
   rewriter (``FunctionRewriter.ast_transformer``) by a subclass that, for loops over ``range(...)`` /
   ``tl.range(...)``, re-binds the loop variable at the top of the body as
   ``i_t = interpreter_semantic.to_tensor(i_t, False)`` (an int32 ``tl.tensor``).  ``tl.static_range``
   loops are left alone, since their variables are meant to stay compile-time constants.

3. *FLA device detection at import.*  Without a GPU, ``fla.utils`` only warns ("Triton is not supported on
   current platform, roll back to CPU") and selects device ``"cpu"``; importing and launching FLA kernels
   on CPU tensors then works under the interpreter, so no patch is needed.

Known interpreter limitation (not patched): bf16 inputs overflow to garbage in the interpreter's numeric
emulation, also in FLA's own ``chunk_gated_delta_rule``; use float32 (or float16) there.
"""

from __future__ import annotations

import ast
import os

_APPLIED = False


def interpreter_active() -> bool:
    """Return True iff ``TRITON_INTERPRET`` is set to a truthy value in this process's environment."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "yes", "on"}


def _is_dynamic_range(node: ast.expr) -> bool:
    """True for ``range(...)``, ``tl.range(...)`` and ``triton.language.range(...)`` calls."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "range"
    if isinstance(func, ast.Attribute):
        return func.attr == "range"
    return False


def enable_interpreter_workarounds() -> None:
    """Apply the autotuner and loop-variable patches described in the module docstring (idempotent).

    Raises:
        RuntimeError: if ``TRITON_INTERPRET`` is not enabled (the patches would silently disable
            autotuning on a real GPU).
    """
    global _APPLIED
    if _APPLIED:
        return
    if not interpreter_active():
        raise RuntimeError(
            "enable_interpreter_workarounds() requires TRITON_INTERPRET=1 to be set before import"
        )

    from triton.runtime import autotuner, interpreter

    # 1. Never benchmark: keep only the first config that survives the kernel's own pruning.
    original_prune = autotuner.Autotuner.prune_configs

    def _prune_to_first(self, kwargs):  # type: ignore[no-untyped-def]
        return original_prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = _prune_to_first  # type: ignore[method-assign]

    # 2. Turn ``for x in range(...)`` induction variables into interpreter tensors.
    base = interpreter.FunctionRewriter.ast_transformer.__class__

    class _LoopVarTensorizer(base):  # type: ignore[misc, valid-type]
        def visit_For(self, node: ast.For) -> ast.AST:
            if isinstance(node.target, ast.Name) and _is_dynamic_range(node.iter):
                name = node.target.id
                rebind = ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())],
                    value=ast.Name(id=name, ctx=ast.Load()),
                )
                # generic_visit below routes the new Assign through visit_Assign, which wraps the
                # value in ``interpreter_semantic.to_tensor(..., False)``.
                node.body.insert(0, ast.copy_location(rebind, node))
            return self.generic_visit(node)

    interpreter.FunctionRewriter.ast_transformer = _LoopVarTensorizer()
    interpreter.InterpretedFunction.rewritten_fn.clear()
    _APPLIED = True

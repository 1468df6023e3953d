"""Workarounds that let FLA's Triton kernels run under ``TRITON_INTERPRET=1`` on a CPU-only machine.

Nothing here edits site-packages; every change is a monkey-patch applied (idempotently) at run time by
:func:`enable_interpreter_workarounds`, which must be called **after** ``TRITON_INTERPRET=1`` is set in
the environment and **before** any FLA kernel is launched.  The patches only matter when the interpreter
is active; on a real GPU do not call this function.

Obstacles and their fixes (verified with triton 3.6.0 and 3.9.0 / flash-linear-attention 0.6.0):

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
import contextlib
import os
import sys

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

    # triton < 3.9 benchmarks even a single pruned config (only ``len(self.configs) == 1`` skips
    # it): every candidate "takes" zero time, so the first one wins without a benchmarker.
    def _no_bench(self, *args, config, **kwargs):  # type: ignore[no-untyped-def]
        return [0.0, 0.0, 0.0]

    autotuner.Autotuner._bench = _no_bench  # type: ignore[method-assign]

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

    # 3. triton < 3.9 holds interpreter scalars as 1-element arrays and converts them with
    # ``int(array)``, which NumPy >= 2.4 refuses for arrays that are not 0-dimensional
    # (``range(18, min(32, T - i_t * BT))`` in FLA's ``solve_tril``): convert through ``.item()``.
    original_patch = getattr(interpreter, "_patch_lang_tensor", None)
    if original_patch is not None:

        def _patch_lang_tensor(tensor, scope):  # type: ignore[no-untyped-def]
            original_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = _patch_lang_tensor

    # 4. Module-level aliases of builtins (``exp = tl.exp`` in SGLang's FLA fork, ``fla/ops/op.py``
    # style) are not patched by the interpreter, which patches only the ``tl`` modules' attributes:
    # calling one raises "_semantic argument must be provided". Patch the jit function's own module
    # too (same scope, restored with it).
    original_patch_lang = interpreter._patch_lang

    def _patch_lang(fn):  # type: ignore[no-untyped-def]
        scope = original_patch_lang(fn)
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        if module is not None:
            interpreter._patch_builtin(module, interpreter.interpreter_builder, scope)
        return scope

    interpreter._patch_lang = _patch_lang

    # 5. SGLang's FLA fork enters ``torch.<device>.device(index)`` around every op
    # (``sglang/kernels/ops/attention/fla/utils.py`` ``custom_device_ctx``); ``torch.cpu`` has no
    # ``device``: a null context there.
    import torch

    if not hasattr(torch.cpu, "device"):
        torch.cpu.device = lambda index=None: contextlib.nullcontext()  # type: ignore[attr-defined]
    interpreter.InterpretedFunction.rewritten_fn.clear()
    _APPLIED = True

"""Loading the launching script in a worker: its definitions, not its side effects.

A worker must find the classes and functions the script defines (actor
classes in ``__main__``), but a script written without an
``if __name__ == "__main__":`` guard would, if simply re-run, spawn
processes and call actors again in every worker. So the worker runs only
the script's definitions, top-level statement by statement:

- imports, ``def``, ``async def`` and ``class`` statements run;
- assignments run, and one that fails (because it starts processes, calls
  actors, or uses a name that was skipped) is skipped;
- ``if`` and ``try`` blocks run when everything inside them is one of the
  above; the ``__main__`` guard and every other statement (calls, loops,
  ``with``, ``await``, ``print``) are skipped.

While this runs, anything that needs the actors runtime raises
:class:`~actors.MainLoadingError`, so a skipped assignment never reaches the wire.
"""

from __future__ import annotations

import ast
import contextvars
import importlib.util
import logging
import os
import types
from typing import Any

__all__ = ["load_definitions", "loading_main"]

log = logging.getLogger("actors")

#: True while this worker loads the launching script's definitions.
loading_main: contextvars.ContextVar[bool] = contextvars.ContextVar("actors_loading_main", default=False)

_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_ASSIGNMENTS = (ast.Assign, ast.AnnAssign, ast.AugAssign) + ((ast.TypeAlias,) if hasattr(ast, "TypeAlias") else ())


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    names = [node.test.left, *node.test.comparators]
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in names)


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _definitions_only(node: ast.stmt) -> bool:
    """True for a statement that only defines names (recursively for ``if``/``try`` blocks)."""
    if isinstance(node, (*_DEFINITIONS, *_ASSIGNMENTS, ast.Pass)) or _is_docstring(node):
        return True
    if isinstance(node, ast.If):
        return not _is_main_guard(node) and all(_definitions_only(s) for s in [*node.body, *node.orelse])
    if isinstance(node, ast.Try):
        blocks = [*node.body, *node.orelse, *node.finalbody]
        blocks += [s for handler in node.handlers for s in handler.body]
        return all(_definitions_only(s) for s in blocks)
    return False


def _source(main: list[str]) -> tuple[str, str, str | None]:
    """``(source, filename, package)`` of the launching script."""
    kind, target = main
    if kind == "module":
        spec = importlib.util.find_spec(target)
        if spec is None or spec.origin is None or not os.path.exists(spec.origin):
            raise ImportError(f"cannot find the source of module {target!r}")
        path = spec.origin
        package = target.rpartition(".")[0] or None
    else:
        path, package = target, None
    with open(path, encoding="utf-8") as f:
        return f.read(), path, package


def load_definitions(main: list[str]) -> types.ModuleType:
    """The launching script as a module holding its definitions (see the module docstring)."""
    source, filename, package = _source(main)
    module = types.ModuleType("__mp_main__")
    namespace: dict[str, Any] = module.__dict__
    namespace.update(__file__=filename, __package__=package, __builtins__=__builtins__)
    tree = ast.parse(source, filename)
    token = loading_main.set(True)
    try:
        for node in tree.body:
            if not _definitions_only(node):
                continue
            code = compile(ast.Module(body=[node], type_ignores=[]), filename, "exec")
            if isinstance(node, _DEFINITIONS):
                exec(code, namespace)  # a failing import or class statement is a real error
                continue
            try:
                exec(code, namespace)
            except Exception as exc:  # it needed the runtime or a name that was skipped
                log.debug("skipped %s:%d in a worker: %s", filename, node.lineno, exc)
    finally:
        loading_main.reset(token)
    return module

"""Names for classes and functions that cross process boundaries.

A class travels as ``"module:qualname"``. The launching script's module runs as
``__mp_main__`` in worker processes, so both spellings map to ``__main__``.
Resolution never imports unless the caller explicitly allows it (spawning an
actor does; decoding a message never does).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_MAIN_ALIASES = ("__main__", "__mp_main__")
_MISSING = object()


def qualified_name(obj: Any) -> str:
    """Return ``"module:qualname"`` for a class or function."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname:
        raise TypeError(f"{obj!r} has no module-level name")
    if module in _MAIN_ALIASES:
        module = "__main__"
    return f"{module}:{qualname}"


def resolve(ref: str, *, allow_import: bool = False) -> Any:
    """Find the object named by ``ref``; import its module only if allowed."""
    module_name, sep, qualname = ref.partition(":")
    if not sep or not module_name or not qualname:
        raise LookupError(f"malformed name {ref!r}")
    if "<locals>" in qualname:
        raise LookupError(f"{ref!r} is defined inside a function; define it at module level")
    module = sys.modules.get(module_name)
    if module is None and module_name == "__main__":
        module = sys.modules.get("__mp_main__")
    if module is None:
        if not allow_import:
            raise LookupError(f"module {module_name!r} is not loaded in this process")
        module = importlib.import_module(module_name)
    obj: Any = module
    for part in qualname.split("."):
        # A module's own namespace only: a module-level __getattr__ (PEP 562) may import, as torch's does.
        found = vars(obj).get(part, _MISSING) if isinstance(obj, types.ModuleType) else getattr(obj, part, _MISSING)
        if found is _MISSING:
            raise LookupError(f"{ref!r} not found: {module_name!r} has no {part!r}")
        obj = found
    return obj

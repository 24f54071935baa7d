"""Inert stand-ins for Monarch's internals, so Monarch's own test files import against ``actors``.

Monarch's test modules import private modules (``monarch._rust_bindings...``,
``monarch._src...``, ``monarch.config``) at module level. Those are not part
of the actor API, so :func:`write_shim` writes a ``monarch`` package whose
every submodule is a stand-in: a name that ``actors`` also exports resolves to
``actors``' object (``monarch._src.actor.actor_mesh.context`` is
``actors.context``); any other name is an inert placeholder that can be
called, subclassed, used as a decorator or a context manager, and does
nothing. ``monarch.actor`` itself is ``actors``, so a test passes or fails on
the public API it uses. Nothing here is Monarch's code.
"""

from __future__ import annotations

import os
import re

SHIM = '''"""Stand-in for Monarch's package: monarch.actor is actors; every internal is inert."""

import importlib.abc
import importlib.machinery
import sys
import types

import actors


class _Inert:
    """Does nothing, whatever is asked of it."""

    def __init__(self, name="inert"):
        self._name = name

    def __repr__(self):
        return f"<inert {self._name}>"

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator: leave the function as it is
        return _Inert(self._name + "()")

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Inert(f"{self._name}.{name}")

    def __mro_entries__(self, bases):
        return (object,)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if hasattr(actors, name):
            return getattr(actors, name)
        return _Inert(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("monarch.") and fullname != "monarch.actor":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.modules["monarch.actor"] = actors
actor = actors
if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
'''


def rewrite_imports(source: str) -> str:
    """``source`` with its ``monarch.actor`` imports pointed at ``actors`` (the only change a user makes)."""
    out = re.sub(r"\bfrom monarch\.actor import\b", "from actors import", source)
    out = re.sub(r"\bimport monarch\.actor\b", "import actors", out)
    return re.sub(r"\bmonarch\.actor\.", "actors.", out)


def write_shim(directory: str) -> str:
    """Write the stand-in ``monarch`` package into ``directory``; returns its path."""
    package = os.path.join(directory, "monarch")
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(SHIM)
    return package

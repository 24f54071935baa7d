"""Which loaded modules are the program's own source, so that a stopping worker releases their globals.

A module is the program's when its file lies under the launching script's
folder (``sys.path[0]``) or the working directory and it was imported from
one of those two folders, or from another folder that is neither on
``PYTHONPATH`` nor an install location (one holding ``*.dist-info`` or
``*.egg-info``). Libraries put on ``PYTHONPATH`` (vendored or not),
installed with ``pip --target`` or baked into a container layer keep their
globals: their finalizers may still need them.

A worker is forked from a forkserver that already imported nearly all it
will hold (torch, this runtime, often the program's modules too). Looking
at those ~1,300 modules in the worker writes to each of them (reference
counts) and so copies ~1,800 pages it shared with the forkserver: 30 ms of
each worker's exit, with seven exiting on two cores. The forkserver
therefore classifies what it holds before it forks (:class:`ModuleScan`),
and the exiting worker looks only at the modules imported since
(:func:`exiting_program_modules`).
"""

from __future__ import annotations

import os
import site
import sys
from dataclasses import dataclass
from types import ModuleType

__all__ = ["Inherited", "ModuleScan", "ProgramPlaces", "exiting_program_modules", "program_modules"]

#: The names a program's own script runs under.
MAIN_NAMES = ("__main__", "__mp_main__")


class ProgramPlaces:
    """Where a process's program lives (its script's folder, its working directory), and what is a library's."""

    def __init__(self, path: list[str], cwd: str, pythonpath: str) -> None:
        self.roots = {os.path.realpath(os.path.join(cwd, p)) for p in (path[0] if path and path[0] else cwd, cwd)}
        installed = (sys.prefix, sys.base_prefix, *site.getsitepackages())
        self.excluded = {os.path.realpath(p) for p in installed}
        self.excluded.add(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # this runtime
        # most modules are a library's, named under an install folder: refused by their name alone (no file looked at)
        self.libraries = tuple(p.rstrip(os.sep) + os.sep for p in {*installed, *self.excluded})
        # (relative entries are the worker's: resolved against its working folder, not this process's)
        self.declared = {os.path.realpath(os.path.join(cwd, p)) for p in pythonpath.split(os.pathsep) if p} - self.roots
        self.entries = sorted({os.path.realpath(os.path.join(cwd, p)) for p in path}, key=len, reverse=True)
        self._installs: dict[str, bool] = {}
        self._folders: dict[str, str] = {}

    @classmethod
    def here(cls) -> ProgramPlaces:
        """This process's places."""
        return cls(sys.path, os.getcwd(), os.environ.get("PYTHONPATH", ""))

    def owns(self, name: str, module: object) -> bool:
        """Whether ``module`` (loaded as ``name``) is the program's own source (not when asking raises)."""
        try:
            file = getattr(module, "__file__", None)
        except Exception:  # an odd entry of sys.modules: never the program's, never a reason to fail
            return False
        if not isinstance(file, str) or not os.path.isabs(file) or file.startswith(self.libraries):
            return False  # built in, a library's stand-in named relatively (torch.ops' "_ops.py"), or a library's
        roots = self.roots
        path = _real_file(file, self._folders)
        if not any(path.startswith(root + os.sep) for root in roots):
            return False  # (a library's file linked into the program's folder stays a library's: never cleared)
        if os.path.islink(file):
            path = os.path.realpath(file)
            if not any(path.startswith(root + os.sep) for root in roots):
                return False
        if any(path.startswith(p + os.sep) for p in self.excluded):
            return False
        if name not in MAIN_NAMES:
            entry = next((e for e in self.entries if path.startswith(e + os.sep)), None)  # where it was found
            if entry is not None and entry not in roots:
                if entry in self.declared or _install_location(entry, self._installs):
                    return False
        return True


def program_modules() -> list[tuple[str, ModuleType]]:
    """Every loaded module that is this process's program's own source (a full scan)."""
    places = ProgramPlaces.here()
    return [(name, module) for name, module in list(sys.modules.items()) if places.owns(name, module)]


@dataclass(frozen=True)
class Inherited:
    """What a worker inherits from its forkserver: every module name, and which of them are the program's."""

    names: frozenset[str]
    program: tuple[str, ...]


class ModuleScan:
    """The forkserver's classification of its modules, for the workers it forks (made again once it imported more)."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._inherited = Inherited(frozenset(), ())

    def before_fork(self, path: list[str], cwd: str, pythonpath: str) -> Inherited | None:
        """What a worker running with ``path``, ``cwd`` and ``PYTHONPATH`` inherits (in the forkserver, before a
        fork); None if the modules could not be classified (the worker then scans them all at its exit)."""
        key = (tuple(path), cwd, pythonpath, len(sys.modules))
        if key != self._key:
            try:
                places = ProgramPlaces(path, cwd, pythonpath)
                modules = list(sys.modules.items())
                program = tuple(n for n, module in modules if n not in MAIN_NAMES and places.owns(n, module))
            except Exception:  # never a reason for the forkserver to stop forking
                return None
            self._key, self._inherited = key, Inherited(frozenset(name for name, _ in modules), program)
        return self._inherited


def exiting_program_modules(inherited: Inherited) -> list[tuple[str, ModuleType]]:
    """:func:`program_modules` in an exiting worker, touching only what it did not inherit classified.

    The modules imported since the fork are the newest entries of
    ``sys.modules`` (read backwards to the first inherited name: an inherited
    module deleted and imported again would end the reading early, and the
    modules imported before it would keep their globals); the script's own
    (``__main__``) is looked at in any case, since a worker loads the
    launching script's definitions under that inherited name.
    """
    places = ProgramPlaces.here()
    found = []
    for name in inherited.program:
        module = sys.modules.get(name)
        if module is not None:
            found.append((name, module))
    imported = []
    for name in reversed(sys.modules):  # names only: looking at a module may import (a lazy one), not while reading
        if name in inherited.names:
            break
        imported.append(name)
    for name in imported:
        module = sys.modules.get(name)
        if module is not None and places.owns(name, module):
            found.append((name, module))
    for name in MAIN_NAMES:
        module = sys.modules.get(name)
        if module is not None and places.owns(name, module):
            found.append((name, module))
    return found


def _real_file(path: str, folders: dict[str, str]) -> str:
    """``path`` in its folder's real location, each folder resolved once (``folders``): a scan looks at ~1,300
    modules' files in a few hundred folders, and resolving every file's every component took 40-190 ms of a
    worker's stop (seven workers exiting at once on two cores)."""
    folder, name = os.path.split(path)
    return os.path.join(_real_folder(folder, folders), name)


def _real_folder(folder: str, folders: dict[str, str]) -> str:
    """``os.path.realpath(folder)``, built from its parent's (one ``lstat`` per folder, not per component)."""
    real = folders.get(folder)
    if real is None:
        parent, name = os.path.split(folder)
        if not name or name in (".", "..") or parent == folder or os.path.islink(folder):
            real = os.path.realpath(folder)
        else:
            real = os.path.join(_real_folder(parent, folders), name)
        folders[folder] = real
    return real


def _install_location(folder: str, seen: dict[str, bool]) -> bool:
    """Whether ``folder`` is where packages were installed (it holds their metadata); remembered in ``seen``."""
    known = seen.get(folder)
    if known is None:
        try:
            with os.scandir(folder) as entries:
                known = any(e.name.endswith((".dist-info", ".egg-info")) for e in entries)
        except OSError:
            known = False
        seen[folder] = known
    return known

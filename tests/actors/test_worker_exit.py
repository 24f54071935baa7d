"""An orderly worker exit runs what a normal interpreter exit would for the program's code: atexit hooks, finalizers.

Each case is a program of its own; its actor class lives in the script, so
the worker holds its globals in the script's module.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import textwrap
import types

import pytest
from harness import ROOT, run_python

from actors._hosting._program_modules import ModuleScan, exiting_program_modules, program_modules

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), ROOT]))

PROGRAM = """
import atexit, os, sys
from actors import Actor, endpoint, this_host

OUT = sys.argv[1]


def mark(name, text):
    with open(os.path.join(OUT, name), "a") as f:
        f.write(text)


class Finalized:
    def __init__(self):
        self.path, self.line = os.path.join(OUT, "finalizer"), f"{os.getpid()}\\n"

    def __del__(self):  # uses no module global: by now they may be gone, as at any interpreter exit
        with open(self.path, "a") as f:
            f.write(self.line)


class Holder(Actor):
    def __init__(self):
        global held
        held = Finalized()  # a module global: released only when the process finalizes
        atexit.register(mark, "atexit", f"{os.getpid()}\\n")

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


if __name__ == "__main__":
    atexit.register(mark, "controller", f"{os.getpid()}\\n")  # before the spawn: a fork inherits it
    procs = this_host().spawn_procs({"procs": 2})
    holders = procs.spawn("holder", Holder)
    print(os.getpid())
    print(" ".join(str(pid) for _, pid in holders.pid.call().get()))
    procs.stop().get()
    print("stopped", flush=True)
"""


def test_a_stopped_worker_runs_its_atexit_hooks_and_finalizers_but_not_the_controllers(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    out = run_python(str(script), str(tmp_path), timeout=120, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    controller, workers, stopped = out.stdout.splitlines()[:3]
    workers = sorted(workers.split())
    assert len(workers) == 2 and stopped == "stopped"
    # by the time stop() returned, each worker had run its own hook and released its module's globals
    assert sorted((tmp_path / "finalizer").read_text().split()) == workers
    assert sorted((tmp_path / "atexit").read_text().split()) == workers
    # the controller's hook ran once, in the controller: never in the workers that inherited it by fork
    assert (tmp_path / "controller").read_text().split() == [controller]


STUBBORN = """
import asyncio, atexit, os, sys
from actors import Actor, endpoint, this_host

OUT = sys.argv[1]


def mark(text):
    with open(os.path.join(OUT, "atexit"), "a") as f:
        f.write(text)


class Stubborn(Actor):
    def __init__(self):
        atexit.register(mark, f"{os.getpid()}\\n")

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    async def __cleanup__(self, exc):
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # swallows every cancel


if __name__ == "__main__":
    procs = this_host().spawn_procs({"procs": 1})
    print(procs.spawn("stubborn", Stubborn).pid.call_one().get())
    procs.stop(timeout=0.3).get()
    print("stopped", flush=True)
"""


def test_a_worker_whose_cleanup_swallows_its_cancel_still_ends_in_order(tmp_path):
    """The stop gives up on a ``__cleanup__`` that swallows its cancel; asyncio's runner then cancelled it again
    and waited for it without end as the loop closed, so the worker never exited by itself: its owner killed it
    (after SIGTERM, with the owner alive, nothing did). What is left gets a bounded wait: the worker exits in
    order, its ``atexit`` hooks run."""
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(STUBBORN))
    out = run_python(str(script), str(tmp_path), timeout=120, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    worker, stopped = out.stdout.splitlines()[:2]
    assert stopped == "stopped"
    assert (tmp_path / "atexit").read_text().split() == [worker], "it exited in order (before: SIGKILLed)"


LIBRARY = """
import os
from os import getpid


class Handle:
    def __init__(self):
        self.mark = os.environ["FARLIB_MARK"]

    def __del__(self):  # as pyzmq's garbage collector does: a module global, read at finalization
        try:
            getpid()
        except NameError:
            with open(self.mark, "a") as f:
                f.write("the library's globals were wiped under it\\n")


handle = Handle()
"""

USES_LIBRARY = """
import os, sys
IMPORT_LIBRARY
from actors import Actor, endpoint, this_host


class User(Actor):
    @endpoint
    async def pid(self) -> int:
        return farlib.getpid()


if __name__ == "__main__":
    procs = this_host().spawn_procs({"procs": 2})
    print(sorted(pid for _, pid in procs.spawn("user", User).pid.call().get()))
    procs.stop().get()
    print("stopped", flush=True)
"""


@pytest.mark.parametrize(
    "where", ["elsewhere", "target-in-program", "vendored-in-program", "namespace-in-program", "installed-on-a-pth"]
)
def test_a_library_on_pythonpath_keeps_its_globals_when_a_worker_exits(tmp_path, where):
    """A library installed outside site-packages (PYTHONPATH, pip --target, a container layer) is not the program's."""
    program = tmp_path / "program"
    program.mkdir()
    library, package, on_pythonpath = program / "deps", "", True
    if where == "elsewhere":  # PYTHONPATH=/somewhere/else
        library = tmp_path / "libs"
    elif where in ("target-in-program", "installed-on-a-pth"):  # pip install --target program/deps
        (library / "farlib-1.0.dist-info").mkdir(parents=True)
        on_pythonpath = where == "target-in-program"  # else found through sys.path only (a .pth, site.addsitedir)
    elif where == "namespace-in-program":  # a namespace package (no __init__.py, no __file__ of its own)
        package = "nsfar"
    library = library / package if package else library
    library.mkdir(parents=True, exist_ok=True)
    (library / "farlib.py").write_text(textwrap.dedent(LIBRARY))
    root = library.parent if package else library
    importing = f"import {package}.farlib as farlib" if package else "import farlib"
    if not on_pythonpath:
        importing = f"sys.path.append({str(root)!r})\n{importing}"
    script = program / "program.py"
    script.write_text(textwrap.dedent(USES_LIBRARY).replace("IMPORT_LIBRARY", importing))
    mark = tmp_path / "wiped"
    paths = [str(root)] if on_pythonpath else []
    env = dict(ENV, PYTHONPATH=os.pathsep.join([*paths, ENV["PYTHONPATH"]]), FARLIB_MARK=str(mark))
    out = run_python(str(script), timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "stopped"
    assert not mark.exists(), mark.read_text()


def test_the_programs_modules_are_found_by_their_real_folders_and_a_relative_name_is_never_one(tmp_path, monkeypatch):
    """What a stopping worker clears: files under the program's folders, their folders resolved (a link to one
    counts); a module named relatively (torch's ``torch.ops`` is ``_ops.py``) or under an install folder never."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "linked").symlink_to(real, target_is_directory=True)
    for name in ("mine.py", "_ops.py"):
        (real / name).write_text("")
    monkeypatch.chdir(real)
    monkeypatch.setattr(sys, "path", [str(real), *sys.path[1:]])
    modules = {
        "program_mine": str(tmp_path / "linked" / "mine.py"),  # the program's, reached through a link
        "library_ops": "_ops.py",  # relative: would resolve under the working folder
        "library_site": os.path.join(sysconfig.get_paths()["purelib"], "somelib.py"),
    }
    for name, file in modules.items():
        module = types.ModuleType(name)
        module.__file__ = file
        monkeypatch.setitem(sys.modules, name, module)
    found = {name for name, _ in program_modules()}
    assert "program_mine" in found and not found & {"library_ops", "library_site"}


def test_an_exiting_worker_finds_the_same_modules_from_its_forkservers_classification(tmp_path, monkeypatch):
    """The forkserver classifies the modules a worker inherits; the worker classifies only those it imported
    since (and its script's): the same modules as a full scan, without touching the ~1,300 it shares."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path[1:]])
    pythonpath = os.environ.get("PYTHONPATH", "")

    def program_module(name: str) -> None:
        module = types.ModuleType(name)
        module.__file__ = str(tmp_path / f"{name}.py")
        monkeypatch.setitem(sys.modules, name, module)

    program_module("inherited_mine")  # imported before the fork
    scan = ModuleScan()
    inherited = scan.before_fork(sys.path, str(tmp_path), pythonpath)
    assert "inherited_mine" in inherited.program and "torch" in inherited.names
    assert scan.before_fork(sys.path, str(tmp_path), pythonpath) is inherited, "classified once while nothing changes"
    program_module("imported_since")  # imported by the worker
    found = {name for name, _ in exiting_program_modules(inherited)}
    assert found == {name for name, _ in program_modules()}
    assert {"inherited_mine", "imported_since"} <= found


def test_an_odd_module_never_stops_the_classification(tmp_path, monkeypatch):
    """An entry of ``sys.modules`` whose ``__file__`` raises is not the program's; the forkserver keeps forking."""

    class Odd(types.ModuleType):
        @property
        def __file__(self) -> str:  # type: ignore[override]
            raise RuntimeError("a lazily loaded module that fails to load")

    monkeypatch.setitem(sys.modules, "odd_module", Odd("odd_module"))
    inherited = ModuleScan().before_fork(sys.path, str(tmp_path), "")
    assert inherited is not None and "odd_module" not in inherited.program
    assert "odd_module" not in {name for name, _ in program_modules()}


def test_closing_a_loop_gives_a_task_that_swallows_its_cancel_a_bounded_wait():
    """How a worker's loop, and the runtime's background loop, are closed: as ``asyncio.run`` closes one, but a
    task that swallows its cancel gets ``wait`` seconds (the background loop's close waited for it for good)."""
    import asyncio

    from actors._shared._loops import close_loop

    loop = asyncio.new_event_loop()
    ended: list[str] = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    async def polite() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("polite")

    async def start() -> list[asyncio.Task[None]]:
        tasks = [asyncio.ensure_future(stubborn()), asyncio.ensure_future(polite())]
        await asyncio.sleep(0)
        return tasks

    tasks = loop.run_until_complete(start())
    close_loop(loop, wait=0.2)  # (before: the background loop's gather waited for stubborn() without end)
    assert loop.is_closed() and ended == ["polite"] and not tasks[0].done()

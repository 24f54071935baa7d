"""How the forkserver starts: forked from the program where nothing forbids it, else a fresh interpreter and a
log line naming why (each of its workers then imports torch and the program's modules itself)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading

import pytest
from harness import run_python

from actors import forkserver_preload, set_forkserver_preload
from actors._processes._forkserver import fork_refusal, prefork


def test_a_thread_running_in_the_program_is_named_as_the_reason_not_to_fork(caplog):
    stop = threading.Event()
    stray = threading.Thread(target=stop.wait, name="stray-monitor", daemon=True)
    stray.start()
    try:
        refusal = fork_refusal()
        assert refusal is not None and refusal.startswith("other Python threads run in this process (")
        assert "stray-monitor" in refusal and "MainThread" not in refusal
        with caplog.at_level(logging.INFO, logger="actors"):
            prefork()  # refused: nothing forked, the reason logged
        assert f"the forkserver starts as a fresh interpreter, not a fork of this program: {refusal}" in caplog.text
    finally:
        stop.set()
        stray.join(timeout=10)


def test_preload_takes_module_names_only():
    before = forkserver_preload()
    with pytest.raises(TypeError, match=r"module names, not one string: \['json'\]\?"):
        set_forkserver_preload("json")
    with pytest.raises(ValueError, match=r"'json tool' is not a module name"):
        set_forkserver_preload(["json", "json tool"])
    with pytest.raises(ValueError, match=r"3 is not a module name"):
        set_forkserver_preload([3])  # type: ignore[list-item]
    assert forkserver_preload() == before, "a refused list changes nothing"


PRELOADING = """
import asyncio, sys
from actors import Actor, endpoint, set_forkserver_preload, this_host

class Modules(Actor):
    @endpoint
    async def has(self, name: str) -> bool:
        return name in sys.modules

async def main():
    set_forkserver_preload(["xml.dom.minidom", "no_such_module_here", "starts_a_thread"])
    procs = this_host().spawn_procs(per_host={"procs": 2})
    answers = await procs.spawn("modules", Modules).has.call("xml.dom.minidom")
    print("PRELOADED", sorted(answers.values()), "xml.dom.minidom" in sys.modules, flush=True)
    await procs.stop()

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["exec", "auto"])
def test_workers_start_with_the_preloaded_modules_and_a_failed_one_is_named(tmp_path, mode):
    """From a fresh interpreter (``exec``) or a fork of the program (``auto``): the program never imported the module,
    its workers have it; a module that cannot be imported, and one that starts a thread in the forkserver (whose
    forks could inherit a lock it holds), are named on stderr, and the workers still start."""
    script = tmp_path / "program.py"
    script.write_text(PRELOADING)
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, name='lingering', daemon=True).start()\n"
    )
    env = dict(os.environ, ACTORS_FORKSERVER=mode, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PRELOADED [True, True] False" in out.stdout
    assert "actors forkserver: preloading no_such_module_here failed (ModuleNotFoundError" in out.stderr
    assert "starts_a_thread started threads (lingering); a worker forked while one holds a lock" in out.stderr


@pytest.fixture
def fake_driver(tmp_path):
    """An empty shared library named like the CUDA driver, and a module whose import loads it."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build a stand-in for libcuda.so")
    (tmp_path / "empty.c").write_text("int actors_stand_in;\n")
    library = tmp_path / "libcuda.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(tmp_path / "empty.c")], check=True)
    (tmp_path / "loads_a_driver.py").write_text(f"import ctypes\nctypes.CDLL({str(library)!r})\n")
    return tmp_path


DRIVER_PRELOADED = """
import asyncio, sys
from actors import Actor, endpoint, set_forkserver_preload, this_host
from actors._processes._forkserver import fork_refusal

class Alive(Actor):
    @endpoint
    async def pid(self) -> int:
        import os
        return os.getpid()

async def main():
    print("REFUSAL", fork_refusal(), flush=True)
    set_forkserver_preload(["loads_a_driver"])
    procs = this_host().spawn_procs(per_host={"procs": 1})
    print("PID", await procs.spawn("alive", Alive).pid.call_one() > 0, flush=True)
    await procs.stop()
    import loads_a_driver
    print("REFUSAL", fork_refusal(), flush=True)

asyncio.run(main())
"""


def test_a_loaded_cuda_driver_stops_the_fork_and_a_preload_that_loads_it_is_named(fake_driver):
    """Once ``libcuda`` is mapped a fork could not use CUDA: the program is not forked, and a forkserver whose
    preloaded module loaded it says so on stderr (its workers still start)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake_driver), *sys.path]))
    env.pop("ACTORS_FORKSERVER", None)
    program = [sys.executable, "-c", DRIVER_PRELOADED]
    out = subprocess.run(program, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == [
        "REFUSAL None",
        "PID True",
        "REFUSAL the CUDA driver is loaded in this process",
    ]
    assert "actors forkserver: preloading loads_a_driver loaded the CUDA driver; workers forked from here" in out.stderr


LATER_ENVIRONMENT = """
import asyncio, os
from actors import Actor, allow_code, endpoint, this_host

class Env(Actor):
    @endpoint
    async def get(self, name: str) -> str | None:
        return os.environ.get(name)

    @endpoint
    async def apply(self, function, value: int) -> int:
        return function(value)

async def main():
    first = this_host().spawn_procs(per_host={"procs": 1})
    before = await first.spawn("env", Env).get.call_one("ACTORS_TEST_LATER")
    os.environ["ACTORS_TEST_LATER"] = "set after the first spawn"
    del os.environ["ACTORS_TEST_GONE"]
    allow_code()
    second = this_host().spawn_procs(per_host={"procs": 1})
    env = second.spawn("env", Env)
    print("LATER", before, "|", await env.get.call_one("ACTORS_TEST_LATER"), "|",
          await env.get.call_one("ACTORS_TEST_GONE"), "|", await env.apply.call_one(lambda x: x + 1, 41), flush=True)
    await first.stop()
    await second.stop()

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["exec", "auto"])
def test_workers_spawned_later_see_the_programs_environment_as_it_is_then(tmp_path, mode):
    """The forkserver starts with the program's environment at its first spawn; a variable set or removed after
    that (``allow_code()`` among them, which asks to be called before spawning) reaches the workers spawned later
    (they had the forkserver's: the code was refused, the variable missing, the removed one still there)."""
    pytest.importorskip("cloudpickle", reason="sending code needs the code extra")
    script = tmp_path / "program.py"
    script.write_text(LATER_ENVIRONMENT)
    env = dict(os.environ, ACTORS_FORKSERVER=mode, ACTORS_TEST_GONE="there at the start")
    env.pop("ACTORS_TEST_LATER", None)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LATER None | set after the first spawn | None | 42" in out.stdout, out.stdout + out.stderr[-2000:]


INTERRUPTIBLE = """
import asyncio, signal, subprocess, sys
from actors import Actor, endpoint, this_host

class Signals(Actor):
    @endpoint
    async def sigint(self) -> list[str]:
        child = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"],
                               capture_output=True, text=True, timeout=60)
        return [repr(signal.getsignal(signal.SIGINT)), child.stdout.strip()]

async def main():
    procs = this_host().spawn_procs(per_host={"procs": 1})
    print("SIGINT", await procs.spawn("signals", Signals).sigint.call_one(), flush=True)
    await procs.stop()

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_worker_and_the_programs_it_runs_are_interruptible(tmp_path):
    """The forkserver ignores SIGINT (Ctrl-C is the controller's); its workers took that over, and so did every
    program an actor started (``send_signal(SIGINT)`` to a ``torchrun`` or a server it ran did nothing)."""
    script = tmp_path / "program.py"
    script.write_text(INTERRUPTIBLE)
    out = run_python(str(script), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("SIGINT"))
    assert "SIG_IGN" not in line, line


def test_a_forkserver_that_cannot_start_leaves_no_pipe_open(tmp_path, monkeypatch):
    """Exec (or fork) failing: the four pipe ends made for it are closed, not leaked, and the error is the caller's."""
    from actors._processes._forkserver import _ServerProcess

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(24, "Too many open files")

    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(subprocess, "Popen", refuse)
    with pytest.raises(OSError, match="Too many open files"):
        _ServerProcess.start(str(tmp_path), "actors-test", False, fork=False)
    assert set(os.listdir("/proc/self/fd")) == before

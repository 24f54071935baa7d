"""The controller's side of the forkserver: starting it, asking it for workers, hearing their pids.

The forkserver (``_forkserver_process``) is a pre-warmed process that forks
actor processes in milliseconds. The first ``spawn_procs`` of a program
forks it from the program itself when that is safe (:func:`fork_refusal`),
so it starts at once with everything already imported; otherwise it is a
fresh interpreter (``python -c``) that imports torch and the runtime once.
The two talk over two pipes of length-prefixed msgpack: spawn requests one
way (``["spawn", index, config]``, a :class:`WorkerConfig` as a dict), pid
reports the other (``["spawned", index, pid]`` or ``["failed", index,
why]``). Its ``["exited", ...]`` reports are ignored here: every process on
this host watches its peers' pidfds (a host placed by Ray relays them,
see :mod:`actors.ray`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterable
from typing import Any

from .._runtime._core import Runtime, at_runtime_exit, prepare_session, process_state
from .._runtime._parts import Part
from .._shared._config import WorkerConfig
from .._shared._liveness import ProcRef
from .._shared._readiness import fd_ready
from .._shared._session import SESSION_ENV, session_keys
from ._devices import cuda_driver_loaded
from ._forkserver_protocol import PR_SET_PDEATHSIG, TERM_GRACE, Spawned, SpawnFailed, SpawnRequest, frame, read_reports

log = logging.getLogger("actors")

#: How long a caller without an event loop waits for the forkserver to take a request.
SPAWN_WRITE_TIMEOUT = 30.0
_BOOT = "from actors._processes._forkserver_process import main; main()"


# ---------------------------------------------------------------------- controller side

#: ``auto`` (default: a fork of the controller when :func:`fork_refusal` allows) or ``exec``.
FORKSERVER_ENV = "ACTORS_FORKSERVER"


def fork_refusal() -> str | None:
    """Why this process cannot safely fork a forkserver of itself right now (None if it can).

    The forkserver then starts in milliseconds with everything the program
    has imported, instead of a fresh interpreter importing torch again. It
    cannot while other Python threads run (they may hold locks a child
    would inherit held) or once the CUDA driver is loaded. Native thread
    pools are fine as long as workers use one torch thread: a worker that
    wants more is forked from a freshly started forkserver instead (GNU
    OpenMP hangs in a child whose parent had started its pool).
    """
    mode = os.environ.get(FORKSERVER_ENV, "auto")
    if mode == "exec":
        return f"{FORKSERVER_ENV}=exec"
    others = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    if others:
        return f"other Python threads run in this process ({', '.join(others)})"
    try:
        if cuda_driver_loaded():
            return "the CUDA driver is loaded in this process"
    except OSError as exc:
        return f"cannot inspect this process: {exc}"
    return None


class _ServerProcess:
    """The forkserver process: its pid, the pipe its requests go into, the pipe its reports come from."""

    def __init__(
        self, pid: int, requests: int, status: int, popen: subprocess.Popen[bytes] | None, env: dict[str, str]
    ) -> None:
        self.pid = pid
        self.requests = requests
        self.status = status
        self._popen = popen
        self.returncode: int | None = None
        #: The program's environment when this process started: its workers inherit it, and what changed since
        #: goes with each spawn request.
        self.env = env

    @classmethod
    def start(cls, session_dir: str, session: str, owns_dir: bool, *, fork: bool) -> _ServerProcess:
        """Fork or exec the forkserver; either way it imports :func:`forkserver_preload`'s modules first."""
        preload = forkserver_preload()
        started_with = dict(os.environ)
        request_r, request_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            pid, popen = cls._launch(request_r, status_w, session_dir, session, owns_dir, preload, fork)
        except BaseException:  # no process: none of its pipes' ends may stay open here
            for fd in (request_r, request_w, status_r, status_w):
                os.close(fd)
            raise
        os.close(request_r)
        os.close(status_w)
        os.set_blocking(status_r, False)
        os.set_blocking(request_w, False)
        return cls(pid, request_w, status_r, popen, started_with)

    @staticmethod
    def _launch(
        request_r: int,
        status_w: int,
        session_dir: str,
        session: str,
        owns_dir: bool,
        preload: tuple[str, ...],
        fork: bool,
    ) -> tuple[int, subprocess.Popen[bytes] | None]:
        """Fork or exec the forkserver on the pipes' far ends: its pid, and its Popen when exec'd."""
        if fork:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _forked_main(request_r, status_w, session_dir, session, owns_dir, preload)
            return pid, None
        env = dict(os.environ)
        env[SESSION_ENV] = session_dir
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        popen = subprocess.Popen(
            [
                *(sys.executable, "-c", _BOOT, str(status_w), session_dir, session),
                *("1" if owns_dir else "0", ",".join(preload)),
            ],
            stdin=request_r,
            pass_fds=(status_w,),
            env=env,
            start_new_session=True,  # Ctrl-C at the terminal reaches only the controller
        )
        return popen.pid, popen

    def wait(self, timeout: float) -> bool:
        """Reap the process; False if it is still running after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                break
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        if self._popen is not None:
            self._popen.returncode = self.returncode  # so Popen never reaps it again
        return True

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _forked_main(
    request_fd: int, status_fd: int, session_dir: str, session: str, owns_dir: bool, preload: tuple[str, ...]
) -> None:
    """The forkserver, as a fork of the controller: shed the controller's state, then serve."""
    code = 1
    try:
        os.setsid()  # Ctrl-C at the terminal reaches only the controller
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(request_fd, 0)
        keep = {0, 1, 2, status_fd}
        for entry in os.listdir("/proc/self/fd"):
            fd = int(entry)
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.environ[SESSION_ENV] = session_dir
        from .._runtime import _core as _runtime

        _runtime.forget_in_child()
        from ._forkserver_process import serve

        serve(status_fd, session_dir, session, owns_dir, preload)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


#: How often a lost forkserver is looked for as a zombie to reap, 10 ms apart, before close() waits for it.
REAP_TRIES = 500


class Forkserver:
    """The controller's handle on its forkserver process."""

    def __init__(self, rt: Runtime, process: _ServerProcess) -> None:
        self.rt = rt
        self.process = process
        self.status_fd = process.status
        #: Workers forked from a fork of this process already hold its ``__main__``.
        self.inherits_main = process._popen is None
        self._buffer = bytearray()
        self._unsent = bytearray()  # requests the pipe has not taken yet
        self._retry: Any = None
        self._refs: dict[int, ProcRef] = {}
        self.closed = False
        self._open_fds = {process.requests, process.status}  # closed once each (``_close_once``)
        rt.driver.add_reader(self.status_fd, self._on_status)
        at_runtime_exit(self.close)
        os.register_at_fork(after_in_child=functools.partial(_close_in_fork, weakref.ref(self), os.getpid()))

    def spawn(self, index: int, config: WorkerConfig, ref: ProcRef) -> None:
        if self.closed:
            raise RuntimeError("the forkserver has exited")
        self._refs[index] = ref
        self._unsent += frame(SpawnRequest(index, self._as_now(config).to_wire()))
        self._write()

    def _as_now(self, config: WorkerConfig) -> WorkerConfig:
        """``config`` with the program's environment as it is now: what was set or removed since this forkserver
        started (``allow_code()``, a variable for the workers) reaches the workers spawned from now on."""
        started, now = self.process.env, os.environ
        changed = {name: value for name, value in now.items() if started.get(name) != value}
        unset = [name for name in started if name not in now and name not in config.env]
        return dataclasses.replace(config, env={**changed, **config.env}, env_unset=unset)

    def _write(self) -> None:
        """Hand queued requests to the pipe without waiting; a full pipe is retried later, by one timer (each
        request's write armed one of its own and dropped the last one's handle: every chain ran on, every 5 ms)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self.closed:  # (lost: its descriptor is closed, maybe reused since)
            return
        deadline = time.monotonic() + SPAWN_WRITE_TIMEOUT
        while self._unsent:
            try:
                written = os.write(self.process.requests, self._unsent)
            except BlockingIOError:
                loop = self.rt.driver.loop
                if loop is not None and loop.is_running():
                    self._retry = loop.call_later(0.005, self._write)
                    return
                if time.monotonic() > deadline:  # no loop: the caller waited, with a deadline
                    raise RuntimeError("the forkserver stopped taking requests") from None
                fd_ready(self.process.requests, write=True, timeout=0.1)
                continue
            except BrokenPipeError:
                self._lost()
                raise RuntimeError("the forkserver has exited") from None
            del self._unsent[:written]

    def _on_status(self) -> None:
        ended = False
        while True:
            try:
                data = os.read(self.status_fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                ended = True  # the reports it sent before it ended still count (a SpawnFailed's reason)
                break
            self._buffer += data
        self._take_reports()
        if ended:
            self._lost()

    def _take_reports(self) -> None:
        """Act on the complete reports read so far: a spawned worker's pid, a failed one's reason."""
        for report in read_reports(self._buffer):  # (``Exited``: every process here watches its peers' pidfds)
            if isinstance(report, Spawned):
                ref = self._refs.pop(report.worker, None)
                if ref is not None and ref.pid != report.pid:
                    self.rt.registry.set_pid(ref, report.pid)
            elif isinstance(report, SpawnFailed):
                ref = self._refs.pop(report.worker, None)
                if ref is not None:
                    self.rt.registry.mark_dead(ref, f"could not start: {report.why}")

    def _lost(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._retry is not None:  # a write still to retry would go to a descriptor closed from now on
            self._retry.cancel()
            self._retry = None
        self._unsent.clear()
        self.rt.driver.remove_reader(self.status_fd)
        for ref in self._refs.values():
            self.rt.registry.mark_dead(ref, "the forkserver exited before starting it")
        self._refs.clear()
        self._close_pipes()
        self._reap(REAP_TRIES)

    def _reap(self, tries: int) -> None:
        """Reap the lost forkserver without waiting: its pipe closes a moment before it becomes a zombie, so an
        attempt that comes too early is tried again on the loop (every 10 ms, ``tries`` more times)."""
        if self.process.wait(0) or not tries:
            return
        loop = self.rt.driver.loop
        if loop is not None and loop.is_running():
            loop.call_later(0.01, self._reap, tries - 1)

    def _close_pipes(self) -> None:
        for fd in (self.process.requests, self.status_fd):
            self._close_once(fd)

    def _close_once(self, fd: int) -> None:
        """Close one of the pipes unless it was: a second close could hit a descriptor the program has since
        reused."""
        if fd in self._open_fds:
            self._open_fds.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Shut the forkserver down; it terminates every worker it forked."""
        # The program is exiting: a process it asked for and never got is no failure to report.
        self._refs.clear()
        self._close_once(self.process.requests)  # its end of input: the forkserver stops its workers
        if not self.process.wait(TERM_GRACE + 3):
            self.process.kill()
            self.process.wait(5)
        self._lost()
        self._close_pipes()


class Preforked:
    """A forkserver forked from this process before it had a runtime, until the runtime adopts it."""

    __slots__ = ("process",)

    def __init__(self) -> None:
        self.process: _ServerProcess | None = None


class Forkservers:
    """This runtime's forkservers: the one for single-threaded workers, and one for multi-threaded workers."""

    __slots__ = ("plain", "threaded")

    def __init__(self) -> None:
        self.plain: Forkserver | None = None
        self.threaded: Forkserver | None = None


class Preload:
    """The modules every forkserver started from now on imports before it forks a worker."""

    __slots__ = ("modules",)

    def __init__(self) -> None:
        self.modules: tuple[str, ...] = ()


#: Kept on the process (``process_state().parts``): what :func:`set_forkserver_preload` asked for.
PRELOAD: Part[Preload] = Part("forkserver preload", Preload)
#: Kept on the process (``process_state().parts``): the forkserver ``prefork`` started.
PREFORKED: Part[Preforked] = Part("preforked forkserver", Preforked)
#: Kept on the runtime (``rt.parts``): the forkservers it spawns workers from.
FORKSERVERS: Part[Forkservers] = Part("forkservers", Forkservers)


def set_forkserver_preload(modules: Iterable[str]) -> None:
    """Have every forkserver this process starts from now on import ``modules`` before it forks a worker.

    As ``multiprocessing.set_forkserver_preload``: the workers then start
    with them imported instead of each importing them itself (seconds for a
    library such as transformers). It matters where the forkserver is a
    fresh interpreter — the program had a runtime or a thread already, the
    CUDA driver was loaded, or the workers want several torch threads — as
    a fork of the program has its imports anyway. A forkserver already
    running keeps what it has. A module that fails to import is reported on
    the forkserver's stderr, and its workers import it themselves.
    """
    if isinstance(modules, str):
        raise TypeError(f"set_forkserver_preload takes module names, not one string: [{modules!r}]?")
    names = tuple(modules)
    for name in names:
        if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"set_forkserver_preload: {name!r} is not a module name (dotted identifiers)")
    process_state().parts.get(PRELOAD).modules = names


def forkserver_preload() -> tuple[str, ...]:
    """The modules :func:`set_forkserver_preload` last asked for (none by default)."""
    return process_state().parts.get(PRELOAD).modules


def prefork() -> None:
    """Start the forkserver now, by forking this process if that is safe, before it has a runtime.

    Called by the first ``spawn_procs`` of a process without a runtime: its
    ZeroMQ context (and I/O thread) does not exist yet, so the process may
    still be single-threaded. The runtime created next adopts the forkserver.
    Where it cannot fork, an INFO line says why: each worker of a fresh
    interpreter imports torch and the program's modules itself (seconds).
    """
    preforked = process_state().parts.get(PREFORKED)
    if preforked.process is not None:
        return
    refusal = fork_refusal()
    if refusal is not None:
        log.info("the forkserver starts as a fresh interpreter, not a fork of this program: %s", refusal)
        return
    session_dir, owns_dir = prepare_session()
    session_keys()  # a tcp session's CURVE keys exist before the fork, so workers inherit them
    preforked.process = _ServerProcess.start(session_dir, os.path.basename(session_dir), owns_dir, fork=True)


def _close_in_fork(held: weakref.ref[Forkserver], program: int) -> None:
    """In a plain fork of the program (multiprocessing's fork start, a library's ``os.fork``): close the
    forkserver's pipe ends it inherited. A forkserver ends when its request pipe's last writer closes; a fork
    holding it kept the forkserver (a fresh interpreter's: it has no death signal) alive past a ``kill -9`` of the
    program. Only in the program's own children, whose descriptors are the program's at the fork: a worker
    forked by the forkserver inherited this hook, but not those descriptors."""
    server = held()
    if server is None or os.getppid() != program:
        return
    for fd in list(server._open_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    server._open_fds.clear()


def forkserver(rt: Runtime, threads: int = 1) -> Forkserver:
    """The forkserver for workers with ``threads`` torch threads, started on first use.

    Workers with one thread come from this process's forkserver (forked from
    it when ``prefork`` could). Workers with more come from one started as a
    fresh interpreter, whose thread pools are untouched.
    """
    servers = rt.parts.get(FORKSERVERS)
    server = servers.plain
    if server is None or server.closed:
        preforked = process_state().parts.get(PREFORKED)
        process, preforked.process = preforked.process, None
        if process is None:
            process = _ServerProcess.start(rt.dir, rt.session, rt.owns_dir, fork=False)
        server = servers.plain = Forkserver(rt, process)
    if threads > 1 and server.inherits_main:
        fresh = servers.threaded
        if fresh is None or fresh.closed:
            process = _ServerProcess.start(rt.dir, rt.session, rt.owns_dir, fork=False)
            fresh = servers.threaded = Forkserver(rt, process)
        return fresh
    return server

"""The forkserver process itself: fork a worker per request, report pids, tear everything down at the end.

It reads ``["spawn", index, config]`` requests (length-prefixed msgpack) on
its stdin, forks one worker per request, records the new pid under the
worker's address in the session directory and reports ``["spawned", index,
pid]`` (or ``["failed", index, why]``) on its status pipe, and ``["exited",
index, pid, code]`` once it has reaped that worker. When its stdin
closes (the controller exited, cleanly or by ``kill -9``) or it gets SIGTERM,
it terminates every worker, removes the session's socket directory and its
``actors-`` shared-memory segments, and exits. It never starts a thread or a
ZeroMQ context, so forking it stays safe.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import importlib
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any

from .._hosting._program_modules import Inherited, ModuleScan
from .._shared._config import WorkerConfig
from .._shared._readiness import fd_ready
from .._shared._segments import remove_process_segments, remove_session_segments
from .._shared._session import forget_incarnation, remove_socket_file, write_incarnation
from .._shared._stale_sessions import hold_session
from ._devices import cuda_driver_loaded
from ._forkserver_protocol import (
    PR_SET_PDEATHSIG,
    TERM_GRACE,
    Exited,
    Report,
    Spawned,
    SpawnFailed,
    frame,
    read_requests,
)

__all__ = ["main", "read_worker_config", "serve"]


def serve(status_fd: int, session_dir: str, session: str, owns_session: bool, preload: tuple[str, ...] = ()) -> None:
    # No automatic collection while importing: the one below is the only full pass (an automatic one triggered
    # mid-import cost a second ~80 ms pass over the controller's inherited heap before the first worker forked).
    gc.disable()
    # First of all, so that a SIGTERM while torch and the preload import (seconds) still tears the session down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    if owns_session:
        hold_session(session_dir)  # for this process's life: the session lives while its forkserver does
    # Import everything a worker needs once, before any fork.
    import torch  # noqa: F401
    import uvloop  # noqa: F401
    import zmq  # noqa: F401

    from .._hosting import _worker  # noqa: F401

    _preload(preload)
    # Collect once here, not in every worker: children inherit a frozen heap
    # (cheap collections for them, and pages that stay shared after fork).
    gc.collect()
    gc.freeze()
    gc.enable()
    children: dict[int, int] = {}  # pid -> index
    modules = ModuleScan()  # which of the modules the workers inherit are the program's, classified here once
    addresses: dict[int, str] = {}  # pid -> inbox address
    buffer = bytearray()

    def report(message: Report) -> None:
        with contextlib.suppress(OSError):
            os.write(status_fd, frame(message))

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                return
            if pid == 0:
                return
            index = children.pop(pid, None)
            if pid in addresses:
                with contextlib.suppress(OSError):
                    forget_incarnation(session_dir, addresses[pid], pid)
            if index is not None:  # for a host placed by Ray, whose controller cannot watch this pid
                report(Exited(index, pid, os.waitstatus_to_exitcode(status)))

    try:
        while not stopping:
            try:
                readable = fd_ready(0, timeout=0.2)
            except InterruptedError:
                continue
            reap()
            if not readable:
                continue
            data = os.read(0, 65536)
            if not data:
                break  # the controller is gone
            buffer += data
            for request in read_requests(buffer):
                index = request.worker
                config, why = read_worker_config(request.config)
                if config is None:
                    report(SpawnFailed(index, why))
                    continue
                pythonpath = config.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
                inherited = modules.before_fork(config.sys_path, config.cwd, pythonpath)
                server = os.getpid()  # the child's parent, read before the fork: after it, it may already be gone
                try:
                    pid = os.fork()
                except OSError as exc:
                    report(SpawnFailed(index, str(exc)))
                    continue
                if pid == 0:
                    _child(config, status_fd, inherited, server)
                children[pid] = index
                addresses[pid] = config.address
                with contextlib.suppress(OSError):
                    write_incarnation(session_dir, config.address, pid)
                report(Spawned(index, pid))
    finally:  # a request it cannot serve ends it: its workers and files still go with it
        _teardown(children, session_dir, session, addresses if not owns_session else None)


def read_worker_config(fields: dict[str, Any]) -> tuple[WorkerConfig | None, str]:
    """The worker's config a request carries, or None and why it does not fit (a field this version lacks, say)."""
    try:
        return WorkerConfig.from_wire(fields), ""
    except TypeError as exc:
        return None, f"a worker config this forkserver cannot read: {exc}"


def _child(config: WorkerConfig, status_fd: int, inherited: Inherited | None, server: int) -> None:
    """The forked worker: it ends with the forkserver ``server`` (its parent), then runs its actors."""
    code = 1
    try:
        os.close(status_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # The forkserver ignores SIGINT (Ctrl-C is the controller's); a worker, and what it runs, can be interrupted.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != server:  # the forkserver died before the death signal was armed: nothing would send it
            os._exit(0)
        from .._hosting import _worker

        code = _worker.run(config, inherited)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _teardown(children: dict[int, int], session_dir: str, session: str, only: dict[int, str] | None) -> None:
    """End every child; remove the session's files (``only``: just those of these children).

    A forkserver started by an actor (a nested mesh) shares its session with
    the controller, so it must not remove the session directory.
    """
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE
    while children and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            children.pop(pid, None)
        else:
            time.sleep(0.01)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # The files go before the last waits: a killed process can take seconds to be reaped (a large CUDA context),
    # and whoever stops this forkserver kills it after a few (its files would stay).
    if only is not None:
        for pid, address in only.items():
            remove_socket_file(address)
            remove_process_segments(session, pid)
    else:
        shutil.rmtree(session_dir, ignore_errors=True)
        remove_session_segments(session)
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _preload(modules: tuple[str, ...]) -> None:
    """Import what the program asked every worker to start with (``set_forkserver_preload``); say what failed."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the workers import it themselves and meet the error there
            print(
                f"actors forkserver: preloading {name} failed ({type(exc).__name__}: {exc}); "
                "its workers import it themselves",
                file=sys.stderr,
                flush=True,
            )
    if modules and _driver_loaded():  # its workers inherit a driver that cannot work after a fork
        print(
            f"actors forkserver: preloading {', '.join(modules)} loaded the CUDA driver; "
            "workers forked from here cannot use CUDA (preload modules that touch no GPU at import)",
            file=sys.stderr,
            flush=True,
        )
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if modules and others:  # a fork copies a lock such a thread holds, held, into the worker
        print(
            f"actors forkserver: preloading {', '.join(modules)} started threads ({', '.join(others)}); "
            "a worker forked while one holds a lock inherits it held",
            file=sys.stderr,
            flush=True,
        )


def _driver_loaded() -> bool:
    try:
        return cuda_driver_loaded()
    except OSError:
        return False  # nothing to say where the process cannot be inspected


def main() -> None:
    status_fd, session_dir, session, owns = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    preload = tuple(name for name in sys.argv[5].split(",") if name) if len(sys.argv) > 5 else ()
    try:
        serve(status_fd, session_dir, session, owns == "1", preload)
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise


if __name__ == "__main__":
    main()

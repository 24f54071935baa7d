"""The forkserver: a pre-warmed process that forks actor processes in milliseconds.

The controller starts one forkserver (a ``python -c`` running :func:`main`) the
first time it spawns processes. It imports torch and the runtime once, never
starts a thread or a ZeroMQ context, and forks a worker for each request.
It talks to the controller over two pipes (length-prefixed msgpack):

* requests on its stdin: ``["spawn", index, config]`` (a :class:`WorkerConfig` as a dict);
* reports on a status pipe: ``["spawned", index, pid]`` or ``["failed", index, why]``.

It also records each new process's pid under its address in the session
directory, so any process can resolve it at once. Deaths are not reported
here: every process watches its peers' pidfds.

When its stdin closes (the controller exited, cleanly or by ``kill -9``) it
terminates every worker, removes the session's socket directory and its
``actors-`` shared-memory segments, and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import glob
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
from typing import Any

import msgpack

from ._config import WorkerConfig
from ._liveness import ProcRef
from ._runtime import Runtime, at_runtime_exit
from ._session import SESSION_ENV, remove_socket_file, write_incarnation

#: Grace period between SIGTERM and SIGKILL when tearing workers down.
TERM_GRACE = 1.0
_PR_SET_PDEATHSIG = 1
_BOOT = "from actors._forkserver import main; main()"


def _frame(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj)
    return struct.pack(">I", len(data)) + data


def _frames(buffer: bytearray) -> list[Any]:
    """Pop every complete frame from ``buffer``."""
    out = []
    while len(buffer) >= 4:
        (size,) = struct.unpack(">I", buffer[:4])
        if len(buffer) < 4 + size:
            break
        out.append(msgpack.unpackb(bytes(buffer[4 : 4 + size]), raw=False))
        del buffer[: 4 + size]
    return out


# ---------------------------------------------------------------------- controller side


class Forkserver:
    """The controller's handle on its forkserver process."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        env[SESSION_ENV] = rt.dir
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(write_fd), rt.dir, rt.session, "1" if rt.owns_dir else "0"],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            env=env,
            start_new_session=True,  # Ctrl-C at the terminal reaches only the controller
        )
        os.close(write_fd)
        self.status_fd = read_fd
        os.set_blocking(read_fd, False)
        self._buffer = bytearray()
        self._refs: dict[int, ProcRef] = {}
        self.closed = False
        rt.driver.add_reader(read_fd, self._on_status)
        at_runtime_exit(self.close)

    def spawn(self, index: int, config: WorkerConfig, ref: ProcRef) -> None:
        if self.closed or self.proc.stdin is None:
            raise RuntimeError("the forkserver has exited")
        self._refs[index] = ref
        try:
            self.proc.stdin.write(_frame(["spawn", index, config.to_wire()]))
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._lost()
            raise RuntimeError("the forkserver has exited") from None

    def _on_status(self) -> None:
        while True:
            try:
                data = os.read(self.status_fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            self._buffer += data
        for report in _frames(self._buffer):
            kind = report[0]
            if kind == "spawned":
                ref = self._refs.pop(report[1], None)
                if ref is not None and ref.pid != report[2]:
                    self.rt.registry.set_pid(ref, report[2])
            elif kind == "failed":
                ref = self._refs.pop(report[1], None)
                if ref is not None:
                    self.rt.registry.mark_dead(ref, f"could not start: {report[2]}")

    def _lost(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.rt.driver.remove_reader(self.status_fd)
        for ref in self._refs.values():
            self.rt.registry.mark_dead(ref, "the forkserver exited before starting it")
        self._refs.clear()

    def close(self) -> None:
        """Shut the forkserver down; it terminates every worker it forked."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=TERM_GRACE + 3)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._lost()
        with contextlib.suppress(OSError):
            os.close(self.status_fd)


def forkserver(rt: Runtime) -> Forkserver:
    """This process's forkserver, started on first use."""
    server: Forkserver | None = rt.forkserver
    if server is None or server.closed:
        server = rt.forkserver = Forkserver(rt)
    return server


# ---------------------------------------------------------------------- forkserver side


def _serve(status_fd: int, session_dir: str, session: str, owns_session: bool) -> None:
    # Import everything a worker needs once, before any fork.
    import torch  # noqa: F401
    import uvloop  # noqa: F401
    import zmq  # noqa: F401

    from . import _worker  # noqa: F401

    # Collect once here, not in every worker: children inherit a frozen heap
    # (cheap collections for them, and pages that stay shared after fork).
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    children: dict[int, int] = {}  # pid -> index
    addresses: dict[int, str] = {}  # pid -> inbox address
    buffer = bytearray()

    def report(obj: Any) -> None:
        with contextlib.suppress(OSError):
            os.write(status_fd, _frame(obj))

    def reap() -> None:
        while children:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                return
            if pid == 0:
                return
            children.pop(pid, None)

    while not stopping:
        try:
            readable, _, _ = select.select([0], [], [], 0.2)
        except InterruptedError:
            continue
        reap()
        if not readable:
            continue
        data = os.read(0, 65536)
        if not data:
            break  # the controller is gone
        buffer += data
        for request in _frames(buffer):
            if request[0] != "spawn":
                continue
            index, config = request[1], WorkerConfig.from_wire(request[2])
            try:
                pid = os.fork()
            except OSError as exc:
                report(["failed", index, str(exc)])
                continue
            if pid == 0:
                _child(config, status_fd)
            children[pid] = index
            addresses[pid] = config.address
            with contextlib.suppress(OSError):
                write_incarnation(session_dir, config.address, pid)
            report(["spawned", index, pid])
    _teardown(children, session_dir, session, addresses if not owns_session else None)


def _child(config: WorkerConfig, status_fd: int) -> None:
    code = 1
    try:
        os.close(status_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(0)
        from . import _worker

        code = _worker.run(config)
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
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    if only is not None:
        from .tensors._slots import remove_segments

        for pid, address in only.items():
            remove_socket_file(address)
            remove_segments(session, pid)
        return
    shutil.rmtree(session_dir, ignore_errors=True)
    for path in glob.glob(f"/dev/shm/{session}-*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def main() -> None:
    status_fd, session_dir, session, owns = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    try:
        _serve(status_fd, session_dir, session, owns == "1")
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise


if __name__ == "__main__":
    main()

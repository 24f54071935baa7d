"""The forkserver: a pre-warmed process that forks actor processes in milliseconds.

The controller starts one forkserver (a ``python -c`` running :func:`main`) the
first time it spawns processes. It imports torch and the runtime once, never
starts a thread or a ZeroMQ context, and forks a worker for each request.
It talks to the controller over two pipes (length-prefixed msgpack):

* requests on its stdin: ``["spawn", index, config]``;
* reports on a status pipe: ``["spawned", index, pid]`` or ``["failed", index, why]``.

Deaths are not reported here: every process watches its peers' pidfds.

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

from ._liveness import ProcRef
from ._runtime import SESSION_ENV, Runtime, at_runtime_exit

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
        rt.add_reader(read_fd, self._on_status)
        at_runtime_exit(self.close)

    def spawn(self, index: int, config: dict[str, Any], ref: ProcRef) -> None:
        if self.closed or self.proc.stdin is None:
            raise RuntimeError("the forkserver has exited")
        self._refs[index] = ref
        try:
            self.proc.stdin.write(_frame(["spawn", index, config]))
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._lost()
            raise RuntimeError("the forkserver has exited") from None

    def resolve(self, ref: ProcRef, timeout: float = 60.0) -> None:
        """Block until the forkserver reports ``ref``'s pid (or its failure)."""
        deadline = time.monotonic() + timeout
        while ref.pid is None and not ref.dead and not self.closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the forkserver did not report a new process in time")
            select.select([self.status_fd], [], [], remaining)
            self._on_status()

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
                if ref is not None:
                    self.rt.set_pid(ref, report[2])
            elif kind == "failed":
                ref = self._refs.pop(report[1], None)
                if ref is not None:
                    self.rt.mark_dead(ref, f"could not start: {report[2]}")

    def _lost(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.rt.remove_reader(self.status_fd)
        for ref in self._refs.values():
            self.rt.mark_dead(ref, "the forkserver exited before starting it")
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


_forkserver: Forkserver | None = None


def forkserver(rt: Runtime) -> Forkserver:
    """This process's forkserver, started on first use."""
    global _forkserver
    if _forkserver is None or _forkserver.rt is not rt or _forkserver.closed:
        _forkserver = Forkserver(rt)
        rt.pid_resolvers.append(_forkserver.resolve)
    return _forkserver


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
            index, config = request[1], request[2]
            try:
                pid = os.fork()
            except OSError as exc:
                report(["failed", index, str(exc)])
                continue
            if pid == 0:
                _child(config, status_fd)
            children[pid] = index
            addresses[pid] = config["address"]
            report(["spawned", index, pid])
    _teardown(children, session_dir, session, addresses if not owns_session else None)


def _child(config: dict[str, Any], status_fd: int) -> None:
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
        from ._transport import remove_socket_file
        from .tensors.shm import remove_segments

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

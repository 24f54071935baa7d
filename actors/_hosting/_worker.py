"""The actor process's entry point: its view of the launching program, then its event loop.

A worker is forked by the forkserver. It takes the environment, argv, path
and working directory of the program that spawned it, names itself for
``ps``, prefixes its output with its actors' names, loads the launching
script's definitions (so actor classes defined in ``__main__`` resolve,
without re-running the script), then
serves its inbox on a uvloop event loop until it is stopped, terminated,
or its owner dies.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import random
import signal
import sys
import threading
import traceback
from typing import TextIO

from .._runtime._core import Runtime, install_runtime
from .._shared._config import WorkerConfig
from .._shared._main_loader import load_definitions
from .._shared._session import write_incarnation
from .._wire import _refs
from ._bounded_runner import run_bounded
from ._breakpoint import WorkerBreakpoints
from ._output import ProcessOutput, WorkerStream
from ._program_modules import Inherited, exiting_program_modules, program_modules
from ._server import ActorServer

__all__ = ["run"]

#: Allocations between young-generation collections in worker processes.
GC_THRESHOLD = 20_000
#: How long a stopping worker waits for its port messages held back for credit to leave (s).
BACKLOG_FLUSH = 2.0


def _load_main(main: list[str] | None) -> None:
    """Give this worker the launching script's definitions as ``__main__`` (see :mod:`actors._shared._main_loader`)."""
    if not main:
        return
    module = load_definitions(main)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def run(config: WorkerConfig, inherited: Inherited | None = None) -> int:
    """Entry point of a freshly forked worker; returns the exit code (after :func:`finalize` when it stopped in order).

    ``inherited``: the forkserver's classification of the modules this worker inherited (see
    :mod:`._program_modules`).
    """
    atexit._clear()  # the hooks a fork inherited are the controller's, not this worker's
    code = _run(config)
    if code == 0:
        finalize(inherited)
    return code


def finalize(inherited: Inherited | None = None) -> None:
    """What a normal interpreter exit does that the program's own code can see: its ``atexit`` hooks, its finalizers.

    A worker ends with ``os._exit`` (a full finalization in a process forked
    from a forkserver could wait on thread pools it inherited), so after an
    orderly stop this runs the ``atexit`` hooks registered in this worker,
    then, unless another thread still runs, drops the globals of the program's own modules
    (:mod:`._program_modules`) so that the finalizers of what they held run, as Monarch's processes do at exit.
    """
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    if threading.active_count() > 1:
        return  # code of the program's still runs on another thread: its globals stay
    for name, module in program_modules() if inherited is None else exiting_program_modules(inherited):
        with contextlib.suppress(Exception):
            sys.modules.pop(name, None)
            module.__dict__.clear()
    gc.collect()


def _run(config: WorkerConfig) -> int:
    for name in config.env_unset:
        os.environ.pop(name, None)
    os.environ.update(config.env)  # before anything here touches CUDA
    _set_title(config, [])
    sys.argv[:] = config.argv or sys.argv[:1]
    sys.path[:] = config.sys_path
    os.chdir(config.cwd)
    random.seed()
    import torch

    torch.seed()
    torch.set_num_threads(int(config.threads or 1))
    raw: dict[str, TextIO] = {"stdout": sys.__stdout__, "stderr": sys.__stderr__}  # type: ignore[dict-item]
    output = ProcessOutput(config.name, config.rank, raw)
    streams = [WorkerStream(raw[name], name, output) for name in ("stdout", "stderr")]
    sys.stdout, sys.stderr = streams  # type: ignore[assignment]
    # The handlers inherited from the spawning program write to its streams (pytest's capture files,
    # say), whose descriptors a worker does not have: drop them unclosed, then log to this stderr.
    logging.root.handlers.clear()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        _load_main(config.main)
    except BaseException:
        print(f"could not load the launching script's module:\n{traceback.format_exc()}", file=sys.stderr)
    sys.breakpointhook = WorkerBreakpoints(config.name)
    if config.bootstrap:
        _refs.resolve(config.bootstrap, allow_import=True)()
    _tune_gc()
    import uvloop

    try:
        return run_bounded(_serve(config, output), uvloop.new_event_loop)
    finally:
        for stream in streams:
            stream.end()  # a last line left unfinished


def _tune_gc() -> None:
    """Keep the cyclic collector off the hot path of a message-heavy process.

    Everything loaded so far (torch, the script) is moved out of the
    collector's view, and young collections run less often: messages queued
    in ports otherwise make every collection walk a large, long-lived heap.
    """
    gc.freeze()  # the forkserver already collected and froze torch's heap before forking
    gc.set_threshold(GC_THRESHOLD, 20, 50)


def _set_title(config: WorkerConfig, actors: list[str]) -> None:
    try:
        import setproctitle
    except ImportError:  # pragma: no cover - optional at runtime
        return
    names = " ".join(actors)
    setproctitle.setproctitle(f"actors[{config.name}] {names}".rstrip())


async def _serve(config: WorkerConfig, output: ProcessOutput) -> int:
    rt = Runtime(address=config.address)
    install_runtime(rt)
    loop = rt.driver.ensure_loop()
    write_incarnation(rt.dir, rt.address, rt.pid)

    def retitle(actors: list[tuple[str, int]]) -> None:
        output.rename(actors)
        _set_title(config, [f"{name}[{rank}]" for name, rank in actors])

    server = ActorServer(rt, config, retitle, output)
    loop.add_signal_handler(signal.SIGTERM, server.shutdown, "terminated")
    await server.finished.wait()
    lost = await rt.windows.drain_all(BACKLOG_FLUSH)  # port messages held back for their receivers' credit
    if lost:
        logging.getLogger("actors").warning(
            "%d port messages held back for receivers that consumed nothing for %gs are lost with this process",
            lost,
            BACKLOG_FLUSH,
        )
    output.finish()  # queued lines leave before the links close; what is printed later is written here
    rt.close()
    return 0

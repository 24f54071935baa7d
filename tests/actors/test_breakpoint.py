"""``breakpoint()`` in an actor: no terminal there, so it warns once per line and returns instead of failing the call."""

from __future__ import annotations

import logging
import os
import textwrap

from harness import ROOT, run_python

from actors import Actor, ProcMesh, endpoint


class Debuggee(Actor):
    @endpoint
    def stop_here(self, times: int) -> list[str]:
        """Hits one ``breakpoint()`` line ``times`` times; the warnings logged meanwhile."""
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("actors.debug").addHandler(handler)
        try:
            for _ in range(times):
                breakpoint()
        finally:
            logging.getLogger("actors.debug").removeHandler(handler)
        return seen

    @endpoint
    def with_hook(self, hook: str) -> object:
        """``breakpoint()`` under ``PYTHONBREAKPOINT=hook``: Python's own hook's result."""
        os.environ["PYTHONBREAKPOINT"] = hook
        try:
            return breakpoint()
        finally:
            del os.environ["PYTHONBREAKPOINT"]


async def test_a_breakpoint_in_an_actor_warns_once_per_line_and_the_call_returns(spawn):
    procs: ProcMesh = spawn(procs=1)
    debuggee = procs.spawn("debuggee", Debuggee)
    warnings = await debuggee.stop_here.call_one(3)
    assert len(warnings) == 1, warnings
    assert "test_breakpoint.py" in warnings[0] and "no terminal for pdb" in warnings[0]
    assert "PYTHONBREAKPOINT" in warnings[0]


async def test_pythonbreakpoint_still_chooses_the_hook_in_an_actor(spawn):
    procs: ProcMesh = spawn(procs=1)
    debuggee = procs.spawn("debuggee", Debuggee)
    assert await debuggee.with_hook.call_one("0") is None  # disabled
    pid = await debuggee.with_hook.call_one("os.getpid")  # any importable callable, as in Python
    assert pid == procs.pids[0]


def test_processes_the_exiting_program_never_started_are_not_reported_as_failures(tmp_path):
    """A program that ends (here by an error) while its mesh still starts: no failure lines about those processes."""
    script = tmp_path / "early_exit.py"
    script.write_text(
        textwrap.dedent(
            """
            from actors import this_host
            procs = this_host().spawn_procs(per_host={"procs": 8})
            raise SystemExit("ending before the processes started")
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = run_python(str(script), timeout=120, env=env)
    assert out.returncode == 1 and "ending before the processes started" in out.stderr
    assert "MeshFailure" not in out.stderr and "ActorDied" not in out.stderr, out.stderr

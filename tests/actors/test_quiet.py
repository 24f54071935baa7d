"""Quiet, correct edges: importing changes nothing, a normal run prints no warning, workers share argv."""

from __future__ import annotations

import os
import subprocess
import textwrap

from harness import ROOT, actor_pids, run_python, wait_for

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), ROOT]))


def run_script(tmp_path, body: str, *args: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(body))
    return run_python(*flags, str(script), *args, timeout=120, env=ENV)


def test_importing_actors_changes_no_global_state(tmp_path):
    out = run_script(
        tmp_path,
        """
        import signal, sys, threading, warnings
        import torch  # the user's own imports come first
        filters = list(warnings.filters)
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
        threads = threading.active_count()
        import actors, actors.weights
        assert warnings.filters == filters, "warning filters changed"
        assert {s: signal.getsignal(s) for s in handlers} == handlers, "signal handlers changed"
        assert threading.active_count() == threads, "a thread started"
        assert "matplotlib" not in sys.modules and "pipeline" not in sys.modules
        print("unchanged")
        """,
    )
    assert out.returncode == 0 and out.stdout.strip() == "unchanged", out.stdout + out.stderr


def test_meshes_left_running_at_exit_stop_quietly(tmp_path):
    before = actor_pids()
    out = run_script(
        tmp_path,
        """
        import asyncio
        from support import Echo
        from actors import this_host

        async def main():
            procs = this_host().spawn_procs(per_host={"procs": 2})
            print(sorted((await procs.spawn("echo", Echo).add.call(1)).values()))

        if __name__ == "__main__":
            asyncio.run(main())  # ends without procs.stop()
        """,
    )
    assert out.returncode == 0 and out.stdout.strip() == "[1, 1]", out.stdout + out.stderr
    assert out.stderr == "", f"stderr: {out.stderr}"
    assert wait_for(lambda: not (actor_pids() - before), timeout=5), "workers outlived their controller"


def test_workers_see_the_controllers_argv(tmp_path):
    out = run_script(
        tmp_path,
        """
        import asyncio, sys
        from actors import Actor, endpoint, this_host

        MODE = sys.argv[1]  # read at import, as example scripts do

        class Reporter(Actor):
            @endpoint
            async def mode(self) -> tuple:
                return MODE, sys.argv[1:]

        async def main():
            procs = this_host().spawn_procs(per_host={"procs": 1})
            print(await procs.spawn("r", Reporter).mode.call_one())
            await procs.stop()

        if __name__ == "__main__":
            asyncio.run(main())
        """,
        "fast",
        "--extra",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('fast', ['fast', '--extra'])"

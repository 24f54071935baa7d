"""A proc mesh pickled to another program (multiprocessing): it joins the session, spawns there, and owns what it spawned."""

from __future__ import annotations

import os
import pickle
import textwrap

import pytest
from harness import last_json, run_python

import actors
from actors import ProcMesh
from actors._runtime import _core
from actors._runtime._core import join_session, process_state

PROGRAM = textwrap.dedent(
    """
    import json, multiprocessing, os, time
    from actors import Actor, endpoint, this_host

    class Who(Actor):
        @endpoint
        async def pid(self) -> int:
            return os.getpid()

    def child(queue, handed):
        procs = this_host().spawn_procs(per_host={"procs": 1})
        mine = procs.spawn("mine", Who)
        theirs = handed.spawn("theirs", Who)
        queue.put([v for _, v in mine.pid.call().get(timeout=30)])
        queue.put([v for _, v in theirs.pid.call().get(timeout=30)])
        time.sleep(120)

    def alive(pid):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False

    if __name__ == "__main__":
        procs = this_host().spawn_procs(per_host={"procs": 1})
        queue = multiprocessing.get_context("spawn").Queue()
        other = multiprocessing.get_context("spawn").Process(target=child, args=(queue, procs))
        other.start()
        mine, theirs = queue.get(timeout=60), queue.get(timeout=60)
        other.terminate()  # abruptly: no cleanup of its own runs
        other.join(30)
        def hosts_theirs(pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"theirs" in f.read()

        deadline = time.monotonic() + 30
        while (any(alive(pid) for pid in mine) or any(hosts_theirs(pid) for pid in theirs)) and time.monotonic() < deadline:
            time.sleep(0.05)
        who = procs.spawn("who", Who)
        out = {
            "same_process": theirs == [v for _, v in who.pid.call().get(timeout=30)],
            "its_own_gone": not any(alive(pid) for pid in mine),
            "handed_alive": all(alive(pid) for pid in theirs),
            "its_actors_stopped": not any(hosts_theirs(pid) for pid in theirs),
        }
        procs.stop().get(timeout=30)
        print(json.dumps(out), flush=True)
    """
)


def test_a_pickled_proc_mesh_serves_another_program_and_outlives_it(tmp_path):
    script = tmp_path / "handover.py"
    script.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORS_")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(actors.__file__)), env.get("PYTHONPATH", "")])
    proc = run_python(str(script), timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    # the other program spawned on the handed mesh's process; its own processes ended with it; the mesh lives on
    # (its actors there stopped with it: the process title lists the actors a worker hosts)
    assert out == {"same_process": True, "its_own_gone": True, "handed_alive": True, "its_actors_stopped": True}


async def test_a_proc_mesh_of_another_session_is_refused_in_a_process_already_in_one(procs: ProcMesh, tmp_path):
    copy = pickle.loads(pickle.dumps(procs))  # the same session: a handle to the same processes
    assert isinstance(copy, ProcMesh) and copy._procs == procs._procs
    rebuild, (_session, state) = procs.__reduce__()
    other = tmp_path / "other-session"
    other.mkdir()
    with pytest.raises(RuntimeError, match=r"belongs to the session in .*other-session, but this process already runs"):
        rebuild(str(other), state)


def test_joining_a_session_that_ended_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(process_state(), "session", None)
    monkeypatch.setattr(_core, "current_runtime", lambda: None)  # as in a program that has not used actors yet
    with pytest.raises(RuntimeError, match="a pickled proc mesh belongs to a session that has ended"):
        join_session(str(tmp_path / "gone"), "a pickled proc mesh")
    assert process_state().session is None

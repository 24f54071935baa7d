"""A synchronous program is served in the background: hooks, supervision and ports work while it does other things.

Each case is a program of its own (a fresh process: which thread drives the
runtime is process-wide state), run to completion; it prints what it saw.
"""

from __future__ import annotations

import os
import textwrap

import pytest
from harness import ROOT, actor_pids, run_python

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), ROOT]))

ACTORS = """
import asyncio, os, threading, time
import actors
from actors import Actor, CallTimeout, Channel, Port, endpoint, this_host


class Failing(Actor):
    def __init__(self):
        raise ValueError("broken on purpose")

    @endpoint
    async def never(self) -> None: ...


class Talker(Actor):
    @endpoint
    async def tell(self, port: Port[int], n: int) -> None:
        for i in range(n):
            port.send(i)
        raise RuntimeError("told")  # a fire-and-forget call that raises: a failure for the fault hook

    @endpoint
    async def echo(self, x: int) -> int:
        return x

    @endpoint
    async def slow(self, x: int, release: Port[int]) -> int:
        await asyncio.sleep(0.2)
        return x

    @endpoint
    async def freeze(self, seconds: float) -> None:
        time.sleep(seconds)  # (the classic mistake: its loop answers nothing, a stop included)

    @endpoint
    async def when_exists(self, path: str) -> str:
        while not os.path.exists(path):  # (the test's signal: no port travels back to a test program's thread)
            await asyncio.sleep(0.005)
        return "answered"


def runtime_threads():
    return sorted(t.name for t in threading.enumerate() if t.name == "actors-runtime")


def served_talker():
    # one process with a Talker, called once: the runtime's background loop serves from then on
    procs = this_host().spawn_procs({"procs": 1})
    talker = procs.spawn("talker", Talker)
    talker.echo.call_one(0).get(timeout=30)
    return procs, talker


def served_with_driver():
    # served_talker(), and the driver of this program's runtime
    from actors._runtime._core import current_runtime

    procs, talker = served_talker()
    return procs, talker, current_runtime().driver


def waiting_for_the_flag(driver, flag, got):
    # a helper thread waits (driver.wait, no deadline) until flag holds; got then has "held"
    return in_a_thread(lambda: driver.wait(lambda: bool(flag), timeout=None, what="the flag") or "held", got)


async def waiting_on_this_loop(talker, driver, flag, got):
    # the runtime moves to the running loop, and a helper thread waits there for the flag
    assert await talker.echo.call_one(1) == 1
    thread = waiting_for_the_flag(driver, flag, got)
    while not driver._progress:  # (the helper's wait is on this loop)
        await asyncio.sleep(0.001)
    return thread


def in_a_thread(fn, got):
    # fn runs on a helper thread (started); its result, or its exception's name, goes to got

    def run():
        try:
            got.append(fn())
        except BaseException as exc:
            got.append(type(exc).__name__)

    thread = threading.Thread(target=run)
    thread.start()
    return thread
"""


def run_program(tmp_path, body: str) -> list[str]:
    script = tmp_path / "program.py"
    script.write_text(ACTORS + textwrap.dedent(body))
    out = run_python(str(script), timeout=120, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.split()


def test_fault_hook_runs_while_the_program_waits_on_something_else(tmp_path):
    before = actor_pids()
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            seen, done = [], threading.Event()
            def hook(failure):
                seen.append((failure.actor, failure.message, threading.current_thread().name))
                if len(seen) == 2:
                    done.set()
            actors.unhandled_fault_hook = hook
            procs = this_host().spawn_procs({"procs": 2})
            procs.spawn("failing", Failing)
            assert done.wait(30), "the fault hook never ran"  # a threading.Event: no future is waited on
            print(sorted({s[:2] for s in seen}) == [("failing", "broken on purpose")], seen[0][2])
            procs.stop().get()
        """,
    )
    assert lines == ["True", "actors-runtime"]
    assert actor_pids() <= before


def test_port_messages_are_taken_in_without_a_get(tmp_path):
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            failed = threading.Event()
            actors.unhandled_fault_hook = lambda failure: failed.set()
            procs = this_host().spawn_procs({"procs": 1})
            talker = procs.spawn("talker", Talker)
            port, receiver = Channel.open(int)
            talker.tell.broadcast(port, 5)
            assert failed.wait(30)  # the failure follows the five messages on the same link
            print(len(receiver._state.queue), [receiver.recv().get(timeout=10) for _ in range(5)] == list(range(5)))
            procs.stop().get()
        """,
    )
    assert lines == ["5", "True"]


def test_an_await_of_a_queued_message_on_the_programs_loop_takes_the_runtime_there_first(tmp_path):
    """Messages queued by the background loop, then ``asyncio.run`` awaits one: the queued message was taken on
    the program's thread while the background loop still drove the runtime (the receiver's queue, and the credit
    it sends back through the shared encoder and ZeroMQ sockets, touched from two threads). The await takes the
    runtime over first, as an await with nothing queued does."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            from actors._runtime._core import runtime
            actors.unhandled_fault_hook = lambda failure: None  # (tell raises once it has sent)
            procs = this_host().spawn_procs({"procs": 1})
            talker = procs.spawn("talker", Talker)
            port, receiver = Channel.open(int)
            talker.tell.broadcast(port, 3)
            deadline = time.monotonic() + 30
            while receiver.qsize() < 3:  # queued by the background loop
                assert time.monotonic() < deadline
                time.sleep(0.005)
            driver = runtime().driver  # (looked at without asking for the runtime, which would take it over)
            async def take():
                value = await receiver.recv()
                return value, driver.thread == threading.get_ident()
            print(*asyncio.run(take()))
            procs.stop().get()
        """,
    )
    assert lines == ["0", "True"]


def test_the_runtime_moves_to_the_programs_loop_and_back(tmp_path):
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs = this_host().spawn_procs({"procs": 1})
            talker = procs.spawn("talker", Talker)
            print(talker.echo.call_one(1).get(), runtime_threads())

            async def main():
                # the background loop handed the runtime to this loop and ended
                return await talker.echo.call_one(2), runtime_threads()

            value, threads = asyncio.run(main())
            print(value, threads)
            print(talker.echo.call_one(3).get(), runtime_threads())
            procs.stop().get()
        """,
    )
    assert lines == ["1", "['actors-runtime']", "2", "[]", "3", "['actors-runtime']"]


def test_a_get_that_times_out_leaves_the_call_to_finish(tmp_path):
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs = this_host().spawn_procs({"procs": 1})
            talker = procs.spawn("talker", Talker)
            port, _receiver = Channel.open(int)
            future = talker.slow.call_one(7, port)
            try:
                future.get(timeout=0.01)
                print("no-timeout")
            except CallTimeout as exc:
                print("timeout")
            print(future.get(timeout=30))
            procs.stop().get()
        """,
    )
    assert lines == ["timeout", "7"]


def test_the_background_thread_ends_with_the_program(tmp_path):
    before = actor_pids()
    lines = run_program(
        tmp_path,
        """
        import atexit
        if __name__ == "__main__":
            atexit.register(lambda: print("exit", runtime_threads()))  # registered first: runs after the runtime's
            procs = this_host().spawn_procs({"procs": 2})
            talker = procs.spawn("talker", Talker)
            talker.echo.call(1).get()
            print("running", runtime_threads())
        """,
    )
    assert lines == ["running", "['actors-runtime']", "exit", "[]"]
    assert actor_pids() <= before


def test_a_fault_hook_that_exits_interrupts_the_main_thread(tmp_path):
    lines = run_program(
        tmp_path,
        """
        import sys
        if __name__ == "__main__":
            actors.unhandled_fault_hook = lambda failure: sys.exit(3)
            procs = this_host().spawn_procs({"procs": 1})
            procs.spawn("failing", Failing)
            try:
                threading.Event().wait(60)  # only the hook's interrupt ends this
                print("not-interrupted")
            except KeyboardInterrupt:
                print("interrupted")
            procs.stop().get()
        """,
    )
    assert lines == ["interrupted"]


def test_a_hand_over_blocked_by_a_running_hook_fails_clearly_and_recovers(tmp_path):
    lines = run_program(
        tmp_path,
        """
        from actors._transport import _background
        if __name__ == "__main__":
            _background.HANDOVER_TIMEOUT = 0.5
            entered, release = threading.Event(), threading.Event()
            def hook(failure):
                entered.set()
                release.wait(60)  # a hook that keeps the runtime's thread busy
            actors.unhandled_fault_hook = hook
            procs = this_host().spawn_procs({"procs": 1})
            talker = procs.spawn("talker", Talker)
            procs.spawn("failing", Failing)
            assert entered.wait(30)

            async def main():
                return await talker.echo.call_one(5)

            try:
                asyncio.run(main())
                print("handed-over")
            except RuntimeError as exc:
                print("refused" if "did not hand over" in str(exc) else repr(exc))
            _background.HANDOVER_TIMEOUT = 10.0  # (the short bound was for the refused hand-over only)
            release.set()
            print(asyncio.run(main()))  # once the hook returned, the hand-over goes through
            procs.stop().get()
        """,
    )
    assert lines == ["refused", "5"]


def test_a_receive_that_times_out_leaves_the_message_for_the_next(tmp_path):
    """A message that arrives as ``recv().get(timeout)`` gives up stays queued; it is not taken and dropped."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            from actors._runtime._core import runtime

            procs = this_host().spawn_procs({"procs": 1})  # the runtime's background loop serves from here on
            port, receiver = Channel.open(int)
            loop, state = runtime().driver.loop, receiver._state
            release = threading.Event()

            def deliver_then_stall():
                port.send(41)  # wakes the waiting receive, which runs only after this callback returns
                release.wait(30)  # the loop is busy until the caller has given up

            def once_waiting():
                while not state.waiters:  # the receive below has registered on the loop
                    time.sleep(0.001)
                loop.call_soon_threadsafe(deliver_then_stall)

            threading.Thread(target=once_waiting, daemon=True).start()
            try:
                receiver.recv().get(timeout=1.0)
                print("no-timeout")
            except CallTimeout:
                print("timeout")
            release.set()
            print(receiver.recv().get(timeout=10))
            procs.stop().get()
        """,
    )
    assert lines == ["timeout", "41"]


def test_a_receive_waiting_through_the_background_loop_follows_the_runtime_when_the_loop_hands_over(tmp_path):
    """A helper thread receives through the background loop; the program's main thread then starts its own loop,
    which takes the runtime over and ends the background one. The receive was cancelled with it (a bare
    ``CancelledError``); now it goes on on the loop that drives the runtime."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs, talker = served_talker()
            port, receiver = Channel.open(int)
            got = []
            thread = in_a_thread(lambda: receiver.recv().get(timeout=30), got)
            while not receiver._state.waiters:  # the receive waits on the background loop
                time.sleep(0.001)

            async def main():
                assert await talker.echo.call_one(1) == 1  # the runtime moved to this loop
                port.send(7)
                await asyncio.to_thread(thread.join, 30)

            asyncio.run(main())
            print(got)
            procs.stop().get()
        """,
    )
    assert lines == ["[7]"]


def test_a_wait_through_the_background_loop_follows_the_runtime_when_the_loop_hands_over(tmp_path):
    """A helper thread waits (as a port's full window or a stop from a thread does) through the background loop
    when the program's own loop takes the runtime over: the wait was cancelled with the background loop (a bare
    ``CancelledError``); now the new loop checks its condition, and it returns when the condition holds."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs, talker, driver = served_with_driver()
            flag, got = [], []
            thread = in_a_thread(lambda: driver.wait(lambda: bool(flag), timeout=60, what="the flag") or "held", got)
            while not driver._progress:  # the wait is on the background loop
                time.sleep(0.001)

            async def main():
                assert await talker.echo.call_one(1) == 1  # the runtime moved to this loop
                flag.append(1)
                await talker.echo.call_one(2)  # (progress: the loop looks at the condition again)
                await asyncio.to_thread(thread.join, 30)

            asyncio.run(main())
            print(got)
            procs.stop().get()
        """,
    )
    assert lines == ["['held']"]


def test_a_thread_using_the_runtime_mid_hand_over_waits_for_the_loop_that_takes_it(tmp_path):
    """While the program's loop takes the runtime over from the background loop, a helper thread uses the runtime
    at the moment it is unbound: it used to start a second background loop, which then contested the runtime with
    the program's loop (whose bind failed: 'already driven by an event loop in another thread'). It now waits
    for the hand-over and is served by the program's loop."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            from actors._runtime._core import current_runtime
            procs, talker = served_talker()
            background = current_runtime().driver._background
            unbind = background._unbind
            got, helpers = [], []

            def unbind_then_start_the_helper():
                unbind()  # the hand-over's midpoint: the runtime is bound to no loop
                helpers.append(thread := in_a_thread(lambda: talker.echo.call_one(2).get(timeout=30), got))
                thread.join(0.5)  # (it used to be served by a loop of its own at once; now it waits for the lock)

            background._unbind = unbind_then_start_the_helper

            async def main():
                try:
                    assert await talker.echo.call_one(1) == 1
                except BaseException as exc:
                    return repr(exc)
                await asyncio.to_thread(helpers[0].join, 30)
                return "bound"

            print(asyncio.run(main()), got, runtime_threads())
            procs.stop().get()
        """,
    )
    assert lines == ["bound", "[2]", "[]"]


def test_a_wait_through_the_programs_loop_goes_on_when_that_loop_stops(tmp_path):
    """A helper thread waits through the program's loop, and that loop stops (``run_until_complete`` returned; the
    loop is not closed). The wait used to sit on the stopped loop, re-sent to it every minute, forever; now the
    helper sees the loop stopped and waits through the loop that drives the runtime next (the background one)."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs, talker, driver = served_with_driver()
            flag, got = [], []
            loop = asyncio.new_event_loop()
            # the loop stops, not closed, with the wait on it
            thread = loop.run_until_complete(waiting_on_this_loop(talker, driver, flag, got))
            flag.append(1)
            thread.join(30)
            print(got, runtime_threads())
            procs.stop().get()
            loop.close()
        """,
    )
    assert lines == ["['held']", "['actors-runtime']"]


def test_work_handed_to_a_loop_that_stops_before_running_it_runs_once_on_the_next(tmp_path):
    """A helper thread hands work to the program's loop (``on_thread``), which stops before running it. The helper
    used to wait for the stopped loop until its minute ran out; now the work runs on the loop that drives the
    runtime next, and when the stopped loop runs again it does not run the work a second time."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs, talker, driver = served_with_driver()
            ran, got, threads = [], [], []
            loop = asyncio.new_event_loop()
            handed = threading.Event()
            schedule = loop.call_soon_threadsafe

            def noting_the_hand_off(callback, *args, **kwargs):
                handle = schedule(callback, *args, **kwargs)
                if getattr(callback, "__name__", "") == "run":
                    handed.set()
                return handle

            loop.call_soon_threadsafe = noting_the_hand_off

            async def stop_with_work_handed_over():
                assert await talker.echo.call_one(1) == 1  # the runtime moved to this loop
                work = lambda: ran.append(threading.current_thread().name) or "ran"
                threads.append(in_a_thread(lambda: driver.on_thread(work), got))
                handed.wait(30)  # (this loop's thread held on purpose: the work waits in its queue)
                asyncio.get_running_loop().stop()  # the loop stops before its next turn would run the work
                await asyncio.sleep(0)

            try:
                loop.run_until_complete(stop_with_work_handed_over())
            except RuntimeError:
                pass  # (stopped before the coroutine finished)
            threads[0].join(30)
            print(got, ran)
            loop.run_until_complete(asyncio.sleep(0))  # the stopped loop runs again: its queue holds the work
            print(ran)
            procs.stop().get()
            loop.close()
        """,
    )
    assert lines == ["['ran']", "['actors-runtime']", "['actors-runtime']"]


def test_a_loop_that_no_longer_drives_the_runtime_does_not_read_its_inbox(tmp_path):
    """The program's loop binds the runtime and stops before its first look at the inbox; the background loop
    takes the runtime back. When the program runs that loop again, for something else, its queued look used to
    read the inbox on the program's thread while the background loop read it on its own."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs, talker, driver = served_with_driver()
            readers = []
            pump = driver._inbox.pump

            def noting_the_reader(*args, **kwargs):
                readers.append(threading.current_thread().name)
                return pump(*args, **kwargs)

            driver._inbox.pump = noting_the_reader
            loop = asyncio.new_event_loop()

            async def bind_then_stop():
                driver.ensure_loop()  # the runtime moves to this loop; its first look at the inbox is queued
                asyncio.get_running_loop().stop()  # and the loop stops before that look
                await asyncio.sleep(0)

            try:
                loop.run_until_complete(bind_then_stop())
            except RuntimeError:
                pass  # (stopped before the coroutine finished)
            assert talker.echo.call_one(2).get(timeout=30) == 2  # the background loop takes the runtime back
            readers.clear()
            loop.run_until_complete(asyncio.sleep(0))  # the program's loop runs again, for something else
            print("MainThread" in readers)
            procs.stop().get()
            loop.close()
        """,
    )
    assert lines == ["False"]


def test_a_wait_through_a_loop_that_stops_and_runs_again_goes_on_there(tmp_path):
    """A helper thread waits through the program's loop, which stops (``run_until_complete`` returned) and runs
    again for the program's next coroutine before the helper found another loop: the helper goes on through it
    (before, it took only a loop other than the one it had waited through, and waited out the 10 s hand-over
    bound for one)."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs, talker, driver = served_with_driver()
            flag, got = [], []
            observed, restarted = threading.Event(), threading.Event()
            next_loop = driver.next_loop

            def next_loop_once_restarted(old, until=None):
                observed.set()  # the helper saw the loop stop
                restarted.wait(30)
                return next_loop(old, until)

            driver.next_loop = next_loop_once_restarted
            loop = asyncio.new_event_loop()

            async def run_again(thread):
                restarted.set()
                flag.append(1)
                started = time.monotonic()
                await asyncio.to_thread(thread.join, 30)
                return time.monotonic() - started

            thread = loop.run_until_complete(waiting_on_this_loop(talker, driver, flag, got))  # it stops
            observed.wait(30)
            took = loop.run_until_complete(run_again(thread))  # and runs again
            print(got, took < 5, runtime_threads())
            procs.stop().get()
            loop.close()
        """,
    )
    assert lines == ["['held']", "True", "[]"]


def test_a_get_whose_loop_ended_waits_only_what_is_left_of_its_timeout(tmp_path):
    """``get(timeout=2)`` waits 0.4 s through a loop that then stops driving the runtime, and 0.4 s more for a
    hand-over that brings none: it waits on as a program without a loop does, for the 1.2 s left (before: for
    the whole 2 s again, so a get could take its timeout twice over, and the hand-over's 10 s bound besides)."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            from actors._runtime._future import Future
            procs, talker, driver = served_with_driver()
            given, hand_over_until = [], []

            def wait_sync(timeout):
                given.append(timeout)
                return 7

            async def never():
                await asyncio.sleep(3600)

            def loop_stops_driving(loop, ready, timeout):
                time.sleep(0.4)  # (what the wait took before its loop stopped driving the runtime)
                return None

            def no_loop_comes(old, until=None):
                hand_over_until.append(until)
                time.sleep(0.4)  # (the wait for a hand-over that brought none)
                return None

            driver.wait_while_driven, driver.next_loop = loop_stops_driving, no_loop_comes
            started = time.monotonic()
            got = Future(never, wait_sync).get(timeout=2.0)
            print(got, 0.5 < given[0] < 1.25, hand_over_until[0] is not None and hand_over_until[0] < started + 2.1)
            del driver.wait_while_driven, driver.next_loop
            procs.stop().get()
        """,
    )
    assert lines == ["7", "True", "True"]


def test_an_actor_spawned_as_its_process_dies_is_built_again_by_the_restart(tmp_path):
    """A synchronous program spawns ``b`` on a restartable mesh: the background loop sends the spawn, and the
    process dies and is restarted before the program's thread records ``b`` among the mesh's actors. The
    restart used to construct only the actors recorded, so ``b`` was missing from the new process; the spawn is
    now recorded with its send, on the runtime's thread."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            import signal
            from actors._runtime._core import current_runtime
            procs = this_host().spawn_procs({"procs": 1}, restart="on-failure")
            a = procs.spawn("a", Talker)
            a.echo.call_one(0).get(timeout=30)
            pid = procs.pids[0]
            driver = current_runtime().driver
            on_thread = driver.on_thread

            def then_the_process_dies(fn, timeout=60.0):
                driver.on_thread = on_thread  # (once)
                result = on_thread(fn, timeout)  # the spawn is sent
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while procs.restarts != [1] and time.monotonic() < deadline:  # restarted, before spawn() goes on
                    time.sleep(0.001)
                return result

            driver.on_thread = then_the_process_dies
            b = procs.spawn("b", Talker)
            print(procs.restarts, b.echo.call_one(5).get(timeout=30))
            procs.stop().get()
        """,
    )
    assert lines == ["[1]", "5"]


def test_a_stop_left_on_a_loop_that_closed_goes_on_with_the_next_waiter(tmp_path):
    """``wait_for(procs.stop(), t)`` gave up on a loop the program then closed (``run_until_complete``, then
    ``close``): the stop's task was left there, pending for good, and the next ``stop()`` on another loop raised
    (a task of another loop) while the frozen process lived on. The next waiter takes the run over."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs, talker = served_talker()
            pid = procs.pids[0]
            loop = asyncio.new_event_loop()

            async def give_up_on_the_stop():
                talker.freeze.broadcast(3600.0)  # its loop never answers the stop: only SIGKILL ends it
                try:
                    await asyncio.wait_for(procs.stop(timeout=0.1), 0.3)
                except asyncio.TimeoutError:
                    return "gave-up"

            print(loop.run_until_complete(give_up_on_the_stop()))
            loop.close()  # the stop's task is left on a closed loop
            asyncio.run(asyncio.wait_for(procs.stop(), 30))
            print(os.path.exists(f"/proc/{pid}"))
        """,
    )
    assert lines == ["gave-up", "False"]


def test_a_stop_given_up_on_goes_on_when_the_program_moves_to_another_loop(tmp_path):
    """``stop().get(timeout=...)`` gave up on a frozen worker; the run of its stop went on on the background loop,
    until the program ran a loop of its own with actors: the hand-over cancelled it there, and nothing took it up
    again, so the frozen process lived until the next ``stop()`` or the program's exit. The run goes on on each
    loop the runtime moves to."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs, talker = served_talker()
            pid = procs.pids[0]
            talker.freeze.broadcast(3600.0)  # its loop never answers the stop: only SIGKILL ends it
            try:
                procs.stop(timeout=0.1).get(timeout=0.3)
            except actors.CallTimeout:
                print("gave-up")
            others, other = served_talker()

            async def go_on_elsewhere():  # the runtime moves to this loop, then back to the background one
                return await other.echo.call_one(5)

            print(asyncio.run(go_on_elsewhere()))
            print(other.echo.call_one(6).get(timeout=30))  # the background loop drives the runtime again
            deadline = time.monotonic() + 30
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.05)  # (another process's exit, watched: no stop() is waited on here)
            print(os.path.exists(f"/proc/{pid}"))
            others.stop().get(timeout=30)
        """,
    )
    assert lines == ["gave-up", "5", "6", "False"]


@pytest.mark.parametrize("work, ending", [("reply", "closed"), ("then", "closed"), ("then", "stopped")])
def test_a_get_waiting_on_the_programs_loop_goes_on_when_that_loop_ends(tmp_path, work, ending):
    """A helper thread waits (``get()``, no deadline) for a reply that the program's loop would read, or for a
    future whose work runs on that loop (``then``, a stop); that loop then ends: ``asyncio.run`` returned (the
    loop closed, its tasks cancelled), or ``run_until_complete`` did (the work left pending on a stopped loop).
    The helper waited for good (nothing read the reply), or raised ``CancelledError``; it now follows the runtime
    to the loop that drives it next, where the work starts again."""
    lines = run_program(
        tmp_path,
        f"""
        if __name__ == "__main__":
            from actors._runtime._core import current_runtime
            procs, talker = served_talker()
            calls = current_runtime().calls._pending
            path = os.path.join({str(tmp_path)!r}, "go")
            got = []

            def wait():
                answer = talker.when_exists.call_one(path)
                return (answer.then(str.upper) if {work!r} == "then" else answer).get()

            async def main():
                assert await talker.echo.call_one(1) == 1  # the runtime moved to this loop
                thread = in_a_thread(wait, got)
                while not any(call.method == "when_exists" for call in calls.values()):
                    await asyncio.sleep(0.001)  # (the helper's call is out: its reply comes to this loop)
                while {work!r} == "then" and not any(
                    task.get_coro().__qualname__ == "Future._shared_body" for task in asyncio.all_tasks()
                ):
                    await asyncio.sleep(0.001)  # (and its get() runs the work on this loop)
                return thread

            if {ending!r} == "closed":
                thread = asyncio.run(main())  # the loop ends with the helper waiting
            else:
                thread = asyncio.new_event_loop().run_until_complete(main())
            open(path, "w").close()
            thread.join(30)
            print(got)
            procs.stop().get()
        """,
    )
    assert lines == (["['ANSWERED']"] if work == "then" else ["['answered']"])


@pytest.mark.parametrize("then", ["get", "await"])
def test_a_wait_after_a_get_gave_up_on_a_loop_that_stopped_runs_the_work_where_the_runtime_is(tmp_path, then):
    """A helper's ``get(timeout)`` gives up while the work runs on the program's loop, which then stops with it
    pending; the program's next ``asyncio.run`` drives the runtime. The helper's next ``get()``, or an ``await``
    there, waited for the run stranded on the stopped loop, for good; that run is cancelled and the work runs
    where the runtime is."""
    lines = run_program(
        tmp_path,
        f"""
        if __name__ == "__main__":
            procs, talker = served_talker()
            path = os.path.join({str(tmp_path)!r}, "go")
            got, gave_up, go_on = [], threading.Event(), threading.Event()

            def helper():
                answer = talker.when_exists.call_one(path).then(str.upper)
                try:
                    answer.get(timeout=0.2)
                except CallTimeout:
                    gave_up.set()
                if {then!r} == "await":
                    return answer
                assert go_on.wait(30)
                return answer.get()

            async def first():
                assert await talker.echo.call_one(1) == 1  # the runtime moved to this loop
                thread = in_a_thread(helper, got)
                while not gave_up.is_set():
                    await asyncio.sleep(0.005)  # (the helper's run is on this loop, which stops with it pending)
                return thread

            thread = asyncio.new_event_loop().run_until_complete(first())

            async def second():
                assert await talker.echo.call_one(2) == 2  # the runtime moved to this loop
                go_on.set()
                open(path, "w").close()
                while not got:
                    await asyncio.sleep(0.005)
                if {then!r} == "await":
                    got[0] = await got[0]

            asyncio.run(asyncio.wait_for(second(), 15))
            thread.join(30)
            print(got)
            procs.stop().get()
        """,
    )
    assert lines == ["['ANSWERED']"]


def test_a_receive_through_the_programs_loop_goes_on_when_that_loop_stops(tmp_path):
    """A helper thread receives (``recv().get()``) through the program's loop, which stops
    (``run_until_complete`` returned; not closed, so its waiting task is not cancelled): the receive used to wait
    for good; it now goes on through the loop that drives the runtime next."""
    lines = run_program(
        tmp_path,
        """
        if __name__ == "__main__":
            procs, talker = served_talker()
            port, receiver = Channel.open(int)
            got = []
            loop = asyncio.new_event_loop()

            async def receive_in_a_thread():
                assert await talker.echo.call_one(1) == 1  # the runtime moved to this loop
                thread = in_a_thread(lambda: receiver.recv().get(), got)
                while not receiver._state.waiters:  # the helper's receive waits on this loop
                    await asyncio.sleep(0.001)
                return thread

            thread = loop.run_until_complete(receive_in_a_thread())
            port.send(7)
            thread.join(30)
            print(got)
            procs.stop().get()
            loop.close()
        """,
    )
    assert lines == ["[7]"]

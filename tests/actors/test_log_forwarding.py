"""ProcMesh.logging_option: workers' output streamed to the controller's own streams, aggregated over a window."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
from harness import last_json, run_python

from actors import Actor, ProcMesh, endpoint, this_host
from actors._meshes._line_aggregator import LineAggregator
from actors._shared._output_line import OutputLine


class Printer(Actor):
    @endpoint
    async def say(self, text: str, times: int = 1) -> None:
        for i in range(times):
            print(text.format(i=i))

    @endpoint
    async def warn(self, text: str) -> None:
        logging.getLogger("printer").error(text)


def line(text: str, rank: int = 0, stream: str = "stdout") -> OutputLine:
    return OutputLine(stream, "printer", rank, text)


def test_without_a_window_each_line_is_passed_on_with_its_name_and_rank():
    lines = LineAggregator(None)
    assert lines.add(line("hello", rank=1), now=0.0) == [("stdout", "[printer] [1] hello")]
    assert lines.deadline is None


def test_similar_lines_are_counted_once_per_stream_until_the_window_ends():
    lines = LineAggregator(5.0)
    for rank in range(2):
        for step in range(3):
            assert lines.add(line(f"step {step} loss 0.{rank}", rank=rank), now=10.0 + step) == []
    assert lines.add(line("boom", stream="stderr"), now=12.0) == []
    assert lines.add(line("something else"), now=12.5) == []
    assert lines.deadline == 15.0  # from the first line held
    assert lines.flush() == [
        ("stdout", "[6 similar log lines] [printer] step 0 loss 0.0"),
        ("stderr", "[1 similar log lines] [printer] boom"),
        ("stdout", "[1 similar log lines] [printer] something else"),
    ]
    assert lines.deadline is None and lines.flush() == []


def test_a_new_window_moves_the_deadline_and_no_window_gives_back_what_is_held():
    lines = LineAggregator(100.0)
    lines.add(line("first"), now=1.0)
    assert lines.set_window(2.0) == [] and lines.deadline == 3.0
    assert lines.set_window(None) == [("stdout", "[1 similar log lines] [printer] first")]
    assert lines.add(line("now"), now=4.0) == [("stdout", "[printer] [0] now")]


class Captured:
    """What this test process printed so far, read through ``capsys`` as it arrives."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self._capsys = capsys
        self.out = ""
        self.err = ""

    def read(self) -> Captured:
        captured = self._capsys.readouterr()
        self.out += captured.out
        self.err += captured.err
        return self


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for ``condition()`` (a guard against hangs, not a synchronisation by sleeping)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_streamed_lines_reach_the_controllers_python_streams(procs: ProcMesh, capsys):
    printer = procs.spawn("printer", Printer)
    await procs.logging_option(stream_to_client=True, aggregate_window_sec=None)
    await printer.say.call("line {i}", times=2)
    await printer.warn.call("a warning")
    seen = Captured(capsys)
    await until(lambda: seen.read().out.count("line 1") == 2 and seen.err.count("a warning") == 2, "the lines")
    for rank in (0, 1):
        assert f"[printer] [{rank}] line 0\n" in seen.out
        assert f"[printer] [{rank}] line 1\n" in seen.out
    assert "a warning" not in seen.out  # stderr lines stay on stderr


async def test_a_window_prints_similar_lines_once_with_their_count_and_ending_it_flushes(procs: ProcMesh, capsys):
    printer = procs.spawn("printer", Printer)
    await procs.logging_option(stream_to_client=True, aggregate_window_sec=60)
    await printer.say.call("step {i}", times=5)  # 10 similar lines, held for a minute
    await procs.logging_option(stream_to_client=True, aggregate_window_sec=None)  # ends the window: printed now
    out = capsys.readouterr().out
    assert "[10 similar log lines] [printer] step 0" in out
    assert "step 1" not in out


async def test_a_shorter_window_prints_held_lines_at_its_end(procs: ProcMesh, capsys):
    printer = procs.spawn("printer", Printer)
    await procs.logging_option(aggregate_window_sec=100)
    await printer.say.call("batch {i}", times=3)
    await procs.logging_option(aggregate_window_sec=0.2)
    seen = Captured(capsys)
    await until(lambda: "similar log lines" in seen.read().out, "the end of the shorter window")
    assert "[6 similar log lines] [printer] batch 0" in seen.out


async def test_without_streaming_lines_are_not_sent_to_the_controller(procs: ProcMesh, capsys):
    printer = procs.spawn("printer", Printer)
    await procs.logging_option(stream_to_client=True, aggregate_window_sec=None)
    await procs.logging_option(stream_to_client=False)
    await printer.say.call("direct {i}")  # written to the workers' own descriptors
    await procs.logging_option(stream_to_client=True, aggregate_window_sec=None)
    await printer.say.call("marker {i}")  # sent after "direct" on the same link: it cannot overtake it
    seen = Captured(capsys)
    await until(lambda: seen.read().out.count("marker 0") == 2, "the marker lines")
    assert "direct" not in seen.out


async def test_a_mesh_that_stops_prints_what_it_held(spawn, capsys):
    procs = spawn(procs=2)
    printer = procs.spawn("printer", Printer)
    await procs.logging_option(aggregate_window_sec=60)
    await printer.say.call("bye")
    await procs.stop()
    assert "[2 similar log lines] [printer] bye" in capsys.readouterr().out


async def test_bad_options_are_refused_before_anything_is_sent(procs: ProcMesh):
    with pytest.raises(TypeError, match="stream_to_client must be a bool"):
        procs.logging_option(stream_to_client="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="aggregate_window_sec must be a positive number"):
        procs.logging_option(aggregate_window_sec=0)
    with pytest.raises(TypeError, match="level must be a logging level"):
        procs.logging_option(level="INFO")  # type: ignore[arg-type]
    assert procs._logs is None


def test_stdout_is_the_controllers_at_print_time(monkeypatch):
    """The collector looks sys.stdout up at each print: a redirection made after it opened is honoured."""
    from actors._meshes import _log_collector

    written: list[str] = []

    class Sink:
        def write(self, text: str) -> int:
            written.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Sink())
    _log_collector._print([("stdout", "hello")])
    assert "".join(written) == "hello\n"


async def test_a_restarted_process_streams_again(sockets_dir, capsys):
    procs = this_host().spawn_procs(per_host={"procs": 1}, restart="on-failure")
    try:
        printer = procs.spawn("printer", Printer)
        await procs.logging_option(stream_to_client=True, aggregate_window_sec=None, level=logging.ERROR)
        os.kill(procs.pids[0], signal.SIGKILL)
        await until(lambda: procs.restarts == [1], "the restart")
        await printer.say.call_one("after the restart")
        await printer.warn.call_one("an error")
        seen = Captured(capsys)
        await until(
            lambda: "[printer] [0] after the restart" in seen.read().out and "an error" in seen.err,
            "lines from the restarted process",
        )
    finally:
        await procs.stop()


MOVES_TO_A_LOOP = textwrap.dedent(
    """
    import asyncio, io, json, sys, time
    from actors import Actor, endpoint, this_host

    class Printer(Actor):
        @endpoint
        async def say(self, text: str) -> None:
            print(text, flush=True)

    def main():
        procs = this_host().spawn_procs(per_host={"procs": 1})
        printer = procs.spawn("printer", Printer)
        procs.logging_option(stream_to_client=True, aggregate_window_sec=None).get()  # (on the background loop)
        printer.say.call("before the move").get()
        captured, real = io.StringIO(), sys.stdout
        sys.stdout = captured  # (the collector prints on sys.stdout as it is at print time)

        async def on_a_loop():
            await printer.say.call("after the move")
            deadline = time.monotonic() + 20  # (a guard: the line comes at once, or never)
            while "after the move" not in captured.getvalue() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return "after the move" in captured.getvalue()

        try:
            seen = asyncio.run(on_a_loop())
        finally:
            sys.stdout = real
        procs.stop().get()
        print(json.dumps({"seen_on_the_loop": seen}), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def test_streamed_lines_are_printed_after_the_program_moves_to_another_event_loop(tmp_path):
    """``logging_option`` in synchronous code, then ``asyncio.run``: the collector's receiving task lived on the
    background loop the runtime left, so nothing was printed until the mesh stopped (and once the port filled, the
    workers gave up streaming). It follows the runtime to the loop that drives it now."""
    script = tmp_path / "moves.py"
    script.write_text(MOVES_TO_A_LOOP)
    proc = run_python(str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout) == {"seen_on_the_loop": True}

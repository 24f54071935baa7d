"""A worker's stdout/stderr streams: writing never waits or deadlocks, and nothing written is lost or reordered."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Callable

from actors._hosting._output import MAX_PARTIAL, ProcessOutput, WorkerStream
from actors._shared._output_line import OutputLine


class FakePort:
    """Records what is sent; ``on_send`` runs inside each send (a warning logged while sending, say)."""

    def __init__(self, on_send: Callable[[OutputLine], None] | None = None, fail_after: int | None = None) -> None:
        self.sent: list[OutputLine] = []
        self.on_send = on_send
        self.fail_after = fail_after

    def send(self, line: OutputLine) -> None:
        if self.fail_after is not None and len(self.sent) >= self.fail_after:
            raise RuntimeError("the controller's port is gone")
        self.sent.append(line)
        if self.on_send is not None:
            self.on_send(line)


def streams() -> tuple[ProcessOutput, WorkerStream, WorkerStream, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    output = ProcessOutput("procs.0", 0, {"stdout": out, "stderr": err})
    output.rename([("printer", 3)])
    return output, WorkerStream(out, "stdout", output), WorkerStream(err, "stderr", output), out, err


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def test_before_forwarding_lines_are_written_here_prefixed():
    _, stdout, _, out, _ = streams()
    stdout.write("a\nb")
    stdout.write("c\n")
    assert out.getvalue() == "[printer[3]] a\n[printer[3]] bc\n"


async def test_a_line_written_while_one_is_sent_neither_deadlocks_nor_reorders():
    output, _, stderr, _, _ = streams()
    port = FakePort(on_send=lambda line: line.text == "first" and stderr.write("logged while sending\n"))
    output.forward_to(port)  # type: ignore[arg-type]
    stderr.write("first\nsecond\n")
    await until(lambda: len(port.sent) == 3, "three lines")
    assert [line.text for line in port.sent] == ["first", "second", "logged while sending"]
    assert {(line.name, line.rank, line.stream) for line in port.sent} == {("printer", 0, "stderr")}


async def test_a_thread_printing_while_the_loop_is_busy_never_waits():
    output, stdout, _, _, _ = streams()
    port = FakePort()
    output.forward_to(port)  # type: ignore[arg-type]
    writer = threading.Thread(target=lambda: [stdout.write(f"line {i}\n") for i in range(2000)])
    writer.start()
    writer.join(10)  # the loop runs no callback meanwhile: a write that waited for it would never return
    assert not writer.is_alive()
    await until(lambda: len(port.sent) == 2000, "every line")
    assert [line.text for line in port.sent] == [f"line {i}" for i in range(2000)]


async def test_when_sending_fails_the_rest_is_written_here_in_order_with_a_notice():
    output, stdout, _, out, err = streams()
    port = FakePort(fail_after=1)
    output.forward_to(port)  # type: ignore[arg-type]
    stdout.write("one\ntwo\nthr")
    await until(lambda: "two" in out.getvalue(), "the fallback")
    stdout.write("ee\n")
    assert [line.text for line in port.sent] == ["one"]
    assert out.getvalue() == "[printer[3]] two\n[printer[3]] three\n"
    assert "no longer streamed to the controller: the controller's port is gone" in err.getvalue()
    assert not output.forwarding


async def test_an_endless_unfinished_line_is_sent_in_pieces_and_a_last_one_is_written_at_the_end():
    output, stdout, _, out, _ = streams()
    port = FakePort()
    output.forward_to(port)  # type: ignore[arg-type]
    for _ in range(MAX_PARTIAL // 1000 + 1):
        stdout.write("\r" + "#" * 999)  # a progress bar that never ends its line
    await until(lambda: len(port.sent) == 1, "the capped piece")
    assert len(port.sent[0].text) > MAX_PARTIAL
    stdout.write("tail")
    output.finish()
    stdout.end()
    assert out.getvalue() == "[printer[3]] tail"

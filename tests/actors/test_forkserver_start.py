"""How the forkserver starts: forked from the program where nothing forbids it, else a fresh interpreter and a
log line naming why (each of its workers then imports torch and the program's modules itself)."""

from __future__ import annotations

import logging
import threading

from actors._processes._forkserver import fork_refusal, prefork


def test_a_thread_running_in_the_program_is_named_as_the_reason_not_to_fork(caplog):
    stop = threading.Event()
    stray = threading.Thread(target=stop.wait, name="stray-monitor", daemon=True)
    stray.start()
    try:
        refusal = fork_refusal()
        assert refusal is not None and refusal.startswith("other Python threads run in this process (")
        assert "stray-monitor" in refusal and "MainThread" not in refusal
        with caplog.at_level(logging.INFO, logger="actors"):
            prefork()  # refused: nothing forked, the reason logged
        assert f"the forkserver starts as a fresh interpreter, not a fork of this program: {refusal}" in caplog.text
    finally:
        stop.set()
        stray.join(timeout=10)

"""A generator waiting for the weights its ticket needs: a cancel or a drain that comes as the wait ends wins."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from actors import CallTimeout
from pipeline.config import Config, SettingsError, check_settings
from pipeline.roles._generator import Generator
from pipeline.run import parse_args


def _waiting(inbox_wait: object, stopped: object) -> types.SimpleNamespace:
    """What ``Generator.reach_version`` uses of a generator: its version, installs, inbox and drain flag."""
    state = types.SimpleNamespace(
        version=0, stopping=False, _stopped=stopped, config=Config(weights_timeout=900.0), id=1
    )

    async def install_weights() -> None:
        state.installs = getattr(state, "installs", 0) + 1
        if state.installs > 2:  # (an update arrived at last: the version is reached)
            state.version = 5

    state.install_weights = install_weights
    state.weight_inbox = types.SimpleNamespace(wait=inbox_wait)
    return state


async def test_a_cancel_that_comes_while_the_wait_unwinds_is_not_swallowed():
    """The update arrives; as the drain's wait is cancelled and unwinds, the run is cancelled (Ctrl-C): the cancel
    stands (before, it was suppressed with the wait's own, and the generator ran on)."""
    outer: list[asyncio.Task[None]] = []

    async def arrives(timeout: float) -> None:
        return None

    class Stopped:
        async def wait(self) -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                outer[0].cancel()  # the run is cancelled just as this wait unwinds
                raise

    state = _waiting(arrives, Stopped())
    outer.append(asyncio.ensure_future(Generator.reach_version(state, 5)))  # type: ignore[arg-type]
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(outer[0], 30)
    assert state.version == 0, "it stopped at the cancel, installing nothing more"


async def test_a_drain_that_comes_with_a_timeout_ends_the_wait_without_raising_it():
    """The weights' deadline and a drain in the same pass: the generator is stopping, so it ends cleanly (before,
    the timeout was raised from the wait's cleanup and the drain's end of stream never sent)."""
    stopped = asyncio.Event()

    async def times_out(timeout: float) -> None:
        stopped.set()  # a drain comes at the same moment
        state.stopping = True
        raise CallTimeout("no weights arrived within 600s")

    state = _waiting(times_out, stopped)
    await asyncio.wait_for(Generator.reach_version(state, 5), 30)  # type: ignore[arg-type]


async def test_a_timeout_without_a_drain_says_what_waited_for_what_and_the_setting_that_bounds_it():
    """The wait lasts ``--weights-timeout`` (a trainer paused longer than 600 s, by a peer's slow restart or a long
    evaluation, failed a healthy generator, and nothing could raise the bound); its error says which generator
    waited for which version, and the flag."""
    waited: list[float] = []

    async def times_out(timeout: float) -> None:
        waited.append(timeout)
        raise CallTimeout(f"no weight update arrived within {timeout:g}s")

    state = _waiting(times_out, asyncio.Event())
    with pytest.raises(
        CallTimeout, match=r"generator 1 waited 900s for policy version 5 \(it has 0\).*--weights-timeout"
    ):
        await asyncio.wait_for(Generator.reach_version(state, 5), 30)  # type: ignore[arg-type]
    assert waited == [900.0]


def test_the_weights_timeout_is_a_positive_run_time_setting(tmp_path):
    assert parse_args(["--weights-timeout", "1800"])[0].weights_timeout == 1800
    (tmp_path / "config.json").write_text(json.dumps(Config(steps=10, device="cpu").to_dict()))
    resumed = parse_args(["--resume", str(tmp_path), "--weights-timeout", "1800"])[0]
    assert resumed.weights_timeout == 1800, "a run-time setting: it may change on --resume"
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(SettingsError, match="--weights-timeout"):
            check_settings(Config(weights_timeout=bad))

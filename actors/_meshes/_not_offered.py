"""Names of Monarch's ``monarch.actor`` that this runtime does not offer: each raises at use, saying why.

Importing them always works, so a program written for Monarch loads with
only its imports changed and fails, if at all, where it uses one.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["ProcId", "Uid", "as_endpoint", "attach", "config", "debug_controller", "default_bootstrap_cmd"]


def _refuse(name: str, why: str) -> NoReturn:
    raise NotImplementedError(f"{name} is not offered by actors: {why} (docs/monarch.md lists every name)")


def as_endpoint(not_an_endpoint: Any, **options: Any) -> NoReturn:
    """Monarch's call of an actor method that is not an ``@endpoint``: not offered."""
    _refuse("as_endpoint()", "only methods declared with @endpoint can be called; decorate the method")


def attach(addr: str) -> NoReturn:
    """Monarch's client attached through a remote gateway: not offered."""
    _refuse("attach()", "a controller here reaches its processes directly over tcp; use attach_to_workers()")


def debug_controller() -> NoReturn:
    """Monarch's distributed debugger: not offered."""
    _refuse("debug_controller()", "there is no distributed debugger; debug an actor's process with py-spy or pdb")


def default_bootstrap_cmd(*args: Any, **kwargs: Any) -> NoReturn:
    """Monarch's command that starts a host's Rust bootstrap: not offered."""
    _refuse(
        "default_bootstrap_cmd()",
        "hosts start with run_worker_loop_forever(address=...) in a Python process of their own",
    )


class _Internal:
    """One of Monarch's runtime-internal types: constructing it raises."""

    _why = "it is an identifier of Monarch's Rust runtime"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse(type(self).__name__, self._why)


class ProcId(_Internal):
    """Monarch's process identifier: not offered (processes here are known by their inbox address)."""


class Uid(_Internal):
    """Monarch's unique identifier type: not offered."""


class _Config:
    """Monarch's runtime settings (``monarch.config``): every attribute raises, naming actors' own settings."""

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        _refuse(
            f"config.{name}",
            "actors is configured with ACTORS_* environment variables (ACTORS_TRANSPORT, ACTORS_TCP_HOST, "
            "ACTORS_SEND_CODE, ...) and per-call options",
        )


#: Monarch's ``monarch.actor.config``: every use raises ``NotImplementedError``.
config = _Config()

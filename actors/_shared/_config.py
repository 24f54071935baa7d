"""What a new actor process needs to know, handed from its spawner through the forkserver."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkerConfig"]


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process: where it listens, who owns it, and the launching program's context.

    ``argv``, ``sys_path``, ``cwd`` and ``main`` reproduce the launching
    program's view (workers see the controller's ``sys.argv``, as
    multiprocessing children do); ``env`` is set before anything in the
    worker touches CUDA.
    """

    name: str  # "<mesh>.<rank>": the process title and the log prefix until actors arrive
    address: str  # its inbox
    owner_address: str  # the process that spawned it (its supervisor)
    owner_pid: int
    rank: int
    argv: list[str] = field(default_factory=list)
    sys_path: list[str] = field(default_factory=list)
    cwd: str = "."
    main: list[str] | None = None  # how to load the launching script: ["module", name] or ["path", file]
    bootstrap: str | None = None  # "module:function" run before serving
    threads: int = 1  # torch intra-op threads
    env: dict[str, str] = field(default_factory=dict)
    #: Variables the worker removes from the environment it inherits (the program removed them since).
    env_unset: list[str] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, fields: dict[str, Any]) -> WorkerConfig:
        return cls(**fields)

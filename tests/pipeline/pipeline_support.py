"""Pipeline roles and tasks the pipeline tests spawn or name (``pipeline_support:WideBandit``)."""

from __future__ import annotations

import os

from pipeline import BanditTask, Generator, RefModel, Scorer


class WideBandit(BanditTask):
    """A custom task by subclassing: six actions."""

    action_dim = 6


class FailingScorer(Scorer):
    """Raises on its 20th rollout: the run must stop with an error naming the scorer."""

    def score(self, rollout):  # type: ignore[no-untyped-def]
        self.seen = getattr(self, "seen", 0) + 1
        if self.seen == 20:
            raise RuntimeError("scorer exploded on purpose")
        return super().score(rollout)


class ForbiddenRefModel(RefModel):
    """A reference model that fails the run if it is ever built (a run with β = 0 must not build one)."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a run without a KL term built a reference model")


class HookedGenerator(Generator):
    """Counts rollouts with hooks; the post hook raises once ``limit`` is reached."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.seen_pre = 0
        self.register_pre_collect_hook(self._pre)
        self.register_post_collect_hook(self._post)

    def _pre(self, generator):  # type: ignore[no-untyped-def]
        self.seen_pre += 1

    def _post(self, generator, rollout):  # type: ignore[no-untyped-def]
        assert rollout.generator == self.id and rollout.version == self.version
        if self.seen_pre >= self.config.extra.get("hook_limit", 10**9):
            raise ValueError(f"hook stopped generator {self.id} after {self.seen_pre} rollouts")


class ProbeGenerator(Generator):
    """Appends ``rank pid version`` to ``<run_dir>/first_rollouts`` before its first rollout."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.register_pre_collect_hook(self._first)
        self.first = True

    def _first(self, generator) -> None:  # type: ignore[no-untyped-def]
        if self.first:
            self.first = False
            with open(os.path.join(self.config.run_dir, "first_rollouts"), "a") as f:
                f.write(f"{self.id} {os.getpid()} {self.version}\n")


def _note(run_dir: str, line: str) -> None:
    with open(os.path.join(run_dir, "dtypes"), "a") as f:
        f.write(line + "\n")


class DtypeGenerator(Generator):
    """Notes ``generator <dtypes of its weights>`` in ``<run_dir>/dtypes`` before each rollout."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.register_pre_collect_hook(self._note)

    def _note(self, generator) -> None:  # type: ignore[no-untyped-def]
        dtypes = sorted({str(p.dtype) for p in self.policy.state_dict().values() if p.is_floating_point()})
        _note(self.config.run_dir, f"generator {' '.join(dtypes)}")


class DtypeRefModel(RefModel):
    """Notes ``ref <dtypes of its weights>`` in ``<run_dir>/dtypes`` once built."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        dtypes = sorted({str(p.dtype) for p in self.model.state_dict().values() if p.is_floating_point()})
        _note(self.config.run_dir, f"ref {' '.join(dtypes)}")

"""The actors of the pipeline and what passes between them.

::

    Generator xN --Rollout--> Scorer --ScoredRollout--> RefModel --ScoredRollout (+ ref_logps)--> Trainer
         ^   ^                   (β = 0: no RefModel; the scorer feeds the trainer)                |
         |   +------------ Grant: a ticket for one rollout, with its oldest allowed version -----+
         +---------- update_weights(manifest), fire-and-forget ------------------------------------+

Each role asks the run's :class:`~pipeline.tasks.Task` what to do, so the
roles know only messages, timing, devices and weights. Every role is an
ordinary subclassable actor: override ``collect`` (Generator), ``score``
(Scorer), ``reference_logps`` (RefModel) or ``train_step`` (Trainer).
May import :mod:`pipeline.learning` and below, and the ``actors`` runtime.
"""

from ._deaths import first_death
from ._devices import (
    ALLOCATOR_VARIABLES,
    CPU,
    compact_gpu_allocator,
    peak_gpu_gb,
    reserved_gpu_gb,
    role_device,
    sampling_seed,
    trainer_rank_device,
    uses_reference,
)
from ._generator import Generator
from ._messages import WAKE, GeneratorTimes, Grant, Rollout, ScoredRollout, StepReport
from ._scorers import RefModel, Scorer
from ._tickets import Tickets
from ._trainer import Trainer
from ._trainer_rank import TrainerRank
from ._weight_routes import Route, WeightRoutes, choose_transport

__all__ = [
    "ALLOCATOR_VARIABLES",
    "CPU",
    "WAKE",
    "Generator",
    "GeneratorTimes",
    "Grant",
    "RefModel",
    "Rollout",
    "Route",
    "ScoredRollout",
    "Scorer",
    "StepReport",
    "Tickets",
    "Trainer",
    "TrainerRank",
    "WeightRoutes",
    "choose_transport",
    "compact_gpu_allocator",
    "first_death",
    "peak_gpu_gb",
    "reserved_gpu_gb",
    "role_device",
    "sampling_seed",
    "trainer_rank_device",
    "uses_reference",
]

"""The trainer's half of GRPO without any actor: the :class:`Learner`, its checkpoint, the one-process baseline.

:func:`train_one_process` trains the same task on-policy in one process,
the yardstick the pipeline is measured against. May import
:mod:`pipeline.tasks` and below.
"""

from . import checkpoint
from ._data_parallel import COLLECTIVE_TIMEOUT, DataParallel, GroupAddress, RankShare, Rendezvous
from ._fully_sharded import FullySharded, group_kind
from ._learner import Learner, Update, lr_factor
from ._one_process import ReferenceResult, train_one_process

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "DataParallel",
    "FullySharded",
    "GroupAddress",
    "Learner",
    "RankShare",
    "ReferenceResult",
    "Rendezvous",
    "Update",
    "checkpoint",
    "group_kind",
    "lr_factor",
    "train_one_process",
]

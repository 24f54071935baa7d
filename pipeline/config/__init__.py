"""The run's configuration: :class:`Config`, which every role receives, and the settings a run refuses.

May import :mod:`pipeline.algorithm` (the loss kinds its fields name).
"""

from ._config import (
    DECODE_PATHS,
    ENGINES,
    REPORT_TO,
    Aggregation,
    Config,
    DecodePath,
    EngineKind,
    InstallMode,
    IsCorrection,
    LrSchedule,
    Mode,
    ReportTo,
    TrainDtype,
    TrainerShard,
)
from ._settings import SettingsError, check_settings, forget_unused_settings, setting_defaults, unused_settings

__all__ = [
    "DECODE_PATHS",
    "ENGINES",
    "REPORT_TO",
    "Aggregation",
    "Config",
    "DecodePath",
    "EngineKind",
    "InstallMode",
    "IsCorrection",
    "LrSchedule",
    "Mode",
    "ReportTo",
    "SettingsError",
    "TrainDtype",
    "TrainerShard",
    "check_settings",
    "forget_unused_settings",
    "setting_defaults",
    "unused_settings",
]

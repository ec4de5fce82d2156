"""The zombie reaper: finds processes that hold GPU memory for a job that is gone, and may end
them, but only on evidence the agent gathered itself (see :mod:`.evidence`)."""

from exporter.actions.reaper.action import ZombieReaper
from exporter.actions.reaper.config import (
    CLASSES,
    SIGNALLABLE_CLASSES,
    ReaperConfig,
    parse_reaper,
)

__all__ = ["CLASSES", "SIGNALLABLE_CLASSES", "ReaperConfig", "ZombieReaper", "parse_reaper"]

"""The trajectory builder: recorded calls and rewards become training rows (``docs/trajectory.md``).

:func:`build_trajectory` turns one rollout's calls into rows, :func:`trajectories_from_store`
does it for a run, :func:`collate` pads rows into the :class:`TrainingBatch` that LocalRL, SFT
and VERL consume; :class:`TrajectoryConfig` holds every option.
"""

from voltrl.trajectory.batch import TrainingBatch, collate
from voltrl.trajectory.build import build_trajectory, trajectories_from_store
from voltrl.trajectory.config import Retokenizer, TrajectoryConfig, default_tool_error
from voltrl.trajectory.credit import assistant_message

__all__ = [
    "Retokenizer",
    "TrainingBatch",
    "TrajectoryConfig",
    "assistant_message",
    "build_trajectory",
    "collate",
    "default_tool_error",
    "trajectories_from_store",
]

"""The trajectory builder: recorded calls and rewards become training rows (``docs/trajectory.md``).

:func:`build_trajectory` turns one rollout's calls into rows, :func:`trajectories_from_store`
does it for a run, :func:`collate` pads rows into the :class:`TrainingBatch` that LocalRL, SFT
and VERL consume; :class:`TrajectoryConfig` holds every option.
"""

from voltrl.trajectory.builder import (
    TrainingBatch,
    TrajectoryConfig,
    build_trajectory,
    collate,
    trajectories_from_store,
)

__all__ = [
    "TrainingBatch",
    "TrajectoryConfig",
    "build_trajectory",
    "collate",
    "trajectories_from_store",
]

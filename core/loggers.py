"""The experiment trackers' import path before the package layout: they live in
:mod:`voltrl.observability.trackers` (this path stays because docs named it for ``Logger``)."""

from voltrl.observability.trackers import (
    Logger,
    MlflowLogger,
    RolloutRow,
    TensorBoardLogger,
    WandbLogger,
)

__all__ = ["Logger", "MlflowLogger", "RolloutRow", "TensorBoardLogger", "WandbLogger"]

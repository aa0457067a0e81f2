"""The runtime: the trainer that runs a run, the runner workers that run the agent, and what
connects them (datasets, the algorithm's view of the run)."""

from voltrl.runtime.trainer import RunResult, TrainContext, Trainer

__all__ = ["RunResult", "TrainContext", "Trainer"]

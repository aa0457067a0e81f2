"""The runtime: the trainer that runs a run, the runner workers that run the agent, and what
connects them (datasets, the algorithm's view of the run)."""

from voltrl.runtime.interrupt import Terminated
from voltrl.runtime.ray_runners import RayRunners
from voltrl.runtime.run_dir import free_run_name
from voltrl.runtime.trainer import RunResult, TrainContext, Trainer

__all__ = ["RayRunners", "RunResult", "Terminated", "TrainContext", "Trainer", "free_run_name"]

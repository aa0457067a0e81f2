"""The algorithm interface: what the trainer calls, in order.

``setup`` starts whatever serves the model (an inference engine, a gateway backend) and
publishes the first resources; ``train`` enqueues rollouts through the context, waits for
them and learns; ``teardown`` stops what ``setup`` started. ``dev`` runs ``setup``, one round
of rollouts and ``teardown`` with no training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from voltrl.types import Task

if TYPE_CHECKING:
    from voltrl.runtime import TrainContext


class Algorithm:
    """Base class of algorithms. Subclasses implement :meth:`train`."""

    name: str = "algorithm"
    publishes: tuple[str, ...] = ()
    """The resource names the algorithm publishes itself (LocalRL and VERL: ``main_llm``, the
    model they train); the trainer refuses its own resources under these names."""
    needs_token_ids: bool = True
    """Whether the trainer's gateways ask backends for token ids (an algorithm that trains no
    weights, APO, says no: hosted APIs reject the field)."""
    resumable: bool = False
    """Whether the algorithm can continue a stopped run (:attr:`resume`): an interrupted
    run's message says so only then."""
    resume: bool = False
    """Whether ``fit`` continues the run of the same name (its directory, store record,
    metrics and checkpoints) instead of starting a new run under a fresh name."""
    resume_setting: str = "resume"
    """Where :meth:`config` records :attr:`resume` (a dotted path): a run's ``train.yaml``
    sets it false, so running the file again starts a new run."""
    resumable_settings: tuple[str, ...] = ()
    """The settings (dotted paths in :meth:`config`) a resumed run may change: those that alter
    neither the data nor the model (more steps, where to compute)."""

    async def setup(self, ctx: TrainContext) -> None:
        """Prepare serving and publish initial resources (the trainer's own are published
        before this is called, if any were given, and stay in every version published)."""

    async def train(self, ctx: TrainContext, train: list[Task], val: list[Task] | None) -> None:
        """Run the training loop."""
        raise NotImplementedError(f"{type(self).__name__} must implement train()")

    async def teardown(self, ctx: TrainContext) -> None:
        """Stop what :meth:`setup` started."""

    def config(self) -> dict[str, object]:
        """The settings to record with the run."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def ray_init_kwargs(self) -> dict[str, Any]:
        """What ``ray.init`` needs for this algorithm when the run starts or joins Ray (Ray
        runners, VERL): none but VERL's (its ``runtime_env`` and ``ray_init`` settings)."""
        return {}

    def upgraded_config(self, recorded: dict[str, Any]) -> dict[str, Any]:
        """A config this algorithm recorded, perhaps in an earlier VoltRL's shape, in today's
        (what a resume compares with :meth:`config`)."""
        return recorded

"""VERL: distributed RL training on verl + Ray + vLLM, with agents running through VoltRL.

``vl.VERL(config)`` trains with verl's own PPO/GRPO trainer (FSDP workers on Ray, vLLM rollout
replicas) while agents keep running through VoltRL's runners, store and gateway, exactly as with
``vl.LocalRL``. verl is optional: ``import voltrl`` never imports it; the modules here import it
when they are used and fail with :class:`VerlUnavailableError` (naming ``voltrl[verl]`` and the
supported versions) when it is missing or of another version. See ``docs/verl.md``.

Parts: :mod:`.version` (the supported range and the check), :mod:`.config` (verl's Hydra config
plus our ``voltrl`` section, presets), :mod:`.batch` (a :class:`~voltrl.trajectory.TrainingBatch`
as verl's ``DataProto`` and as TransferQueue rows; batch rounding), :mod:`.driver` (verl's
extension points: the agent-loop manager, the dataset class and the trainer subclass) and
:mod:`.algorithm` (the :class:`VERL` algorithm).
"""

from voltrl.algorithms.verl.algorithm import VERL
from voltrl.algorithms.verl.version import (
    SUPPORTED_VERL,
    VerlUnavailableError,
    require_verl,
)

__all__ = ["SUPPORTED_VERL", "VERL", "VerlUnavailableError", "require_verl"]

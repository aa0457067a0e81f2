"""The policy update's settings: :class:`PolicyUpdateConfig` (``LocalRL(update=...)``).

Each field is one knob of :class:`~voltrl.algorithms.local.update.PolicyTrainer`'s step: the
optimizer, the loss (:mod:`~voltrl.algorithms.local.loss`), the advantages, how rows are
batched, LoRA. The run's ``train.yaml`` records them as ``algorithm.update``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from voltrl.algorithms.local.loss import Correction, KLKind, LossAgg
from voltrl.types import Model


class PolicyUpdateConfig(Model):
    """Settings of the policy update. Defaults are a plain GRPO step: one epoch, one
    optimizer step per batch, PPO-clip against the sampling logprobs, no KL term.

    There is no temperature setting: the engine records raw temperature-1 logprobs, which
    are PPO's old logprobs, so the update scores at temperature 1 too (the sampling
    temperature is ``LocalRL(sampling={"temperature": ...})`` and changes neither).
    """

    # optimizer
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    # loss
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = Field(None, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_kind: KLKind = "low_var_kl"
    entropy_coef: float = 0.0
    loss_agg: LossAgg = "token-mean"
    old_logprobs: Literal["rollout", "recompute", "decoupled"] = "rollout"
    """PPO's "old" policy: the sampling logprobs (``rollout``), the current weights'
    (``recompute``), or both (``decoupled``: clip against the current weights, weigh each
    token by its importance against the policy that sampled it; what ``schedule.max_staleness
    > 0`` and ``rollout_correction`` use unless this is set:
    :func:`~voltrl.algorithms.local.loss.policy_loss`)."""
    rollout_correction: Correction | None = None
    """Correct for the engine's logprobs differing from the trainer's (a bfloat16 engine, other
    kernels, vLLM): the trainer scores every row under the weights that sampled it (one
    forward pass without autograd), PPO clips against that, and each token's importance weight
    of the engine against it is bounded by ``tis`` (truncated at ``rollout_correction_cap``) or
    ``mis`` (that, and a sequence whose ratio leaves ``[1/cap, cap]`` is dropped):
    :func:`~voltrl.algorithms.local.loss.importance_weights`. Implies ``old_logprobs=
    "decoupled"``. ``None``: the sampling logprobs are PPO's old policy, as recorded."""
    rollout_correction_cap: float = Field(2.0, gt=1)
    """The cap of ``rollout_correction`` (verl's ``rollout_is_threshold``, default 2)."""
    behaviour_weight_cap: float = Field(5.0, gt=1)
    """With ``decoupled``: the cap on the importance weight of a row sampled by older weights
    (asynchronous LocalRL)."""
    behaviour_weight_mode: Correction = "tis"
    """With ``decoupled``: how that weight is bounded, as ``rollout_correction`` bounds a fresh
    row's: ``tis`` truncates it at the cap, ``mis`` also drops a sequence whose ratio leaves
    ``[1/cap, cap]``."""
    # advantages
    norm_adv_by_std: bool = True
    adv_eps: float = Field(1e-6, ge=0)
    rollout_weighting: bool = False
    # batching
    micro_batch_size: int = Field(4, ge=1)
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    mini_batches: int = Field(1, ge=1)
    gradient_checkpointing: bool = False
    # LoRA
    use_lora: bool = False
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] | str = "all-linear"
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _correction_is_decoupled(cls, data: Any) -> Any:
        """``rollout_correction`` needs the decoupled objective: implied when ``old_logprobs``
        is not given, refused with another."""
        if not isinstance(data, dict) or not data.get("rollout_correction"):
            return data
        given = data.get("old_logprobs", "decoupled")
        if given != "decoupled":
            raise ValueError(
                f"rollout_correction weighs the engine's logprobs against the trainer's, with "
                f'old_logprobs="decoupled" (implied when not given), not old_logprobs={given!r}'
            )
        return {**data, "old_logprobs": "decoupled"}


def implied_update(
    update: PolicyUpdateConfig | dict[str, Any] | None,
    seed: int,
    lora_adapters: bool,
    max_staleness: int,
) -> PolicyUpdateConfig:
    """LocalRL's update settings: ``update`` (a dict takes LocalRL's ``seed`` unless it names
    one), with what LocalRL's other arguments imply where ``update`` leaves it unset: LoRA for
    ``lora_adapters``, ``old_logprobs="decoupled"`` for ``max_staleness``. A ``use_lora=False``
    set with ``lora_adapters`` is refused."""
    if isinstance(update, dict):
        update = PolicyUpdateConfig.model_validate({"seed": seed, **update})
    update = update or PolicyUpdateConfig(seed=seed)
    if lora_adapters and not update.use_lora:
        if "use_lora" in update.model_fields_set:
            raise ValueError("lora_adapters trains LoRA adapters: leave use_lora out (or True)")
        update = update.model_copy(update={"use_lora": True})
    if max_staleness and "old_logprobs" not in update.model_fields_set:
        update = update.model_copy(update={"old_logprobs": "decoupled"})
    return update

"""The policy update's settings: :class:`PolicyUpdateConfig` (``LocalRL(update=...)``).

Each field is one knob of :class:`~voltrl.algorithms.local.update.PolicyTrainer`'s step: the
optimizer, the loss (:mod:`~voltrl.algorithms.local.loss`), the advantages, how rows are
batched, LoRA. The run's ``train.yaml`` records them as ``algorithm.update``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from voltrl.algorithms.local.loss import KLKind, LossAgg
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
    > 0`` uses unless this is set: :func:`~voltrl.algorithms.local.loss.policy_loss`)."""
    behaviour_weight_cap: float | None = Field(5.0, gt=0)
    """With ``decoupled``: the cap on a token's importance weight against its sampler."""
    behaviour_weight_mode: Literal["clamp", "mask"] = "clamp"
    """With ``decoupled``: a weight over the cap is the cap (``clamp``), or 0 (``mask``,
    AReaL's: the token is left out of the update)."""
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

"""The LocalRL policy update: one GRPO/PPO step on a :class:`~voltrl.trajectory.TrainingBatch`.

::

    trainer = PolicyTrainer(model, PolicyUpdateConfig(lr=1e-5, use_lora=True))
    metrics = trainer.step(batch)          # advantages -> micro-batches -> clip -> AdamW
    weights = trainer.merged_state_dict()  # for the inference engine
    trainer.save_checkpoint("runs/x/checkpoints")

What :meth:`PolicyTrainer.step` does, top to bottom (the maths lives in
:mod:`voltrl.algorithms.local.loss`):

1. **Advantages.** One per row, :func:`~voltrl.algorithms.local.loss.grpo_advantages` over
   the batch's ``rewards`` grouped by ``group_ids`` (tasks); with ``rollout_weighting``,
   rollouts count once in the group statistics and share their weight among their rows.
2. **Reference / old logprobs** (only when needed): without autograd, under
   ``torch.inference_mode``, once per step: the reference policy's logprobs for the KL term
   (``kl_coef > 0``), and with ``old_logprobs="recompute"`` the current policy's, replacing
   the sampling logprobs as PPO's "old" policy (with ``"decoupled"``, as the proximal policy
   beside them: stale samples of asynchronous LocalRL).
3. **Mini-batches and epochs.** ``ppo_epochs`` passes over the rows, each split (shuffled
   by a seeded generator) into ``mini_batches`` optimizer steps.
4. **Micro-batches.** Rows of a mini-batch are split into micro-batches of at most
   ``micro_batch_size`` rows (and ``max_tokens_per_micro_batch`` padded tokens), rows that
   share a prompt prefix together, the cheaper of two orders' best cuts
   (:func:`~voltrl.algorithms.local.micro_batches.plan_micro_batches`); each micro-batch
   drops the padding columns none of its rows needs (left of its longest prompt, right of
   its last trained token), the prompt tokens all its rows start with (an agent's system
   prompt and tools) are fed once for all of them
   (:func:`~voltrl.algorithms.local.shared_prefix.split_common_prefix`), and only response columns
   holding a trained token go through the LM head. Each micro-batch's loss is divided by the
   *mini-batch's* normaliser (:func:`~voltrl.algorithms.local.loss.agg_normaliser`), so the
   accumulated gradient is the mini-batch's gradient whatever the micro-batch size.
   Rows whose loss is identically 0 (advantage 0 with no KL or entropy term: a GRPO group
   whose rollouts all got the same reward) still count in the normaliser but are not run.
   (:class:`~voltrl.algorithms.local.token_rows.TokenRows` feeds the micro-batches, as for SFT.)
5. **Step.** Gradient-norm clipping (a non-finite norm skips the step), then AdamW.

The settings are :class:`~voltrl.algorithms.local.update_config.PolicyUpdateConfig`; where
checkpoints go is :mod:`~voltrl.algorithms.local.checkpoints`.

One module of ~600 lines, on purpose: the steps above share one prepared batch (``_Prepared``:
old, proximal and reference logprobs, importance weights, the mismatch measured in the first
mini-batch), and a reader follows an update top to bottom here; the maths each step calls is
:mod:`~voltrl.algorithms.local.loss`'s, the row feeding :mod:`.token_rows`'.

Rows are as the trajectory builder made them in either mode: in trajectory mode the
mask-0 tokens inside a response (tool results, the next user turn) are fed to the model as
context and get no loss and no gradient.
"""

from __future__ import annotations

import copy
import math
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from voltrl.algorithms.local.checkpoints import load_trainer, save_trainer
from voltrl.algorithms.local.loss import (
    add_mismatch,
    agg_loss,
    agg_normaliser,
    grpo_advantages,
    importance_weights,
    kl_penalty,
    masked_mean,
    mismatch_metrics,
    mismatch_sums,
    policy_loss,
    rollout_weights,
    weight_advantages,
)
from voltrl.algorithms.local.master_weights import MasterWeights
from voltrl.algorithms.local.token_rows import TokenRows
from voltrl.algorithms.local.update_config import PolicyUpdateConfig
from voltrl.models.lora import adapter_of
from voltrl.models.threads import decide_threads, use_threads
from voltrl.trajectory import TrainingBatch

__all__ = ["PolicyTrainer", "PolicyUpdateConfig", "batch_advantages"]


@dataclass
class _Prepared:
    """A batch on the model's device with what the update adds to it: advantages, PPO's "old"
    logprobs and the reference policy's."""

    rows: TokenRows
    old_logprobs: Tensor  # (B, R)
    old_known: Tensor  # (B, R) bool: where old_logprobs is a real logprob
    advantages: Tensor  # (B,)
    engine_logprobs: Tensor  # (B, R): the sampling logprobs, as recorded
    fresh: Tensor  # (B, 1) bool: rows the weights being updated sampled (staleness 0)
    ref_logprobs: Tensor | None = None  # (B, R) when kl_coef > 0
    prox_logprobs: Tensor | None = None  # (B, R) with old_logprobs="decoupled"
    weights: Tensor | None = None  # (B, R) the decoupled objective's importance weights
    proximal_rows: int = 0  # the rows the current weights scored for it
    mismatch: dict[str, float] | None = None  # mismatch_sums of the fresh rows, once measured
    metrics: dict[str, float] | None = None  # what preparing measured (the weights' shares)


def batch_advantages(
    batch: TrainingBatch, config: PolicyUpdateConfig, rewards: Tensor | None = None
) -> Tensor:
    """Each row's advantage in an update of ``batch``: GRPO over its group (the task, or the
    task and agent group of ``TrajectoryConfig.group_by_agent``), with
    rollout weights when ``config.rollout_weighting`` (the dashboard shows the same numbers).
    ``rewards``: the batch's rewards already as a tensor (on the update's device)."""
    r = torch.tensor(batch.rewards, dtype=torch.float32) if rewards is None else rewards
    w = rollout_weights(batch.rollout_ids).to(r.device) if config.rollout_weighting else None
    adv = grpo_advantages(
        r,
        batch.group_ids,
        norm_by_std=config.norm_adv_by_std,
        eps=config.adv_eps,
        weights=w,
    )
    return adv if w is None else weight_advantages(adv, w)


def _checkpoint_activations(model: Any) -> None:
    """Turn activation (gradient) checkpointing on, by the name the installed transformers
    gives it (``gradient_checkpointing_enable`` is a deprecated alias since 5.x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _with_lora(model: Any, cfg: PolicyUpdateConfig, adapter: str | None) -> Any:
    """``model`` with a LoRA adapter named ``adapter`` (peft's ``"default"`` when None),
    added when missing: a plain model is wrapped by peft (in place), a ``PeftModel`` gets one
    more adapter."""
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    name = adapter or "default"
    if not isinstance(model, PeftModel):
        with warnings.catch_warnings():  # peft reads transformers' deprecated property
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            return get_peft_model(model, lora, adapter_name=name)
    if adapter is not None and adapter not in model.peft_config:
        model.add_adapter(adapter, lora)
    return model


def _ages(batch: TrainingBatch) -> list[int | None]:
    """Each row's staleness (``None``: unknown); a batch that records no row's age (not built
    by LocalRL's schedule) is taken as sampled by the weights being updated."""
    if any(age is not None for age in batch.staleness):
        return list(batch.staleness)
    return [0] * len(batch)


class UpdateStopped(Exception):
    """An update ended early by :attr:`PolicyTrainer.stop`; unless an optimizer step had run
    (:attr:`PolicyTrainer.mid_update`), the weights are those before it."""


class PolicyTrainer:
    """Owns the policy, its optimizer and the optional frozen reference policy.

    ``model`` is a Hugging Face causal LM on the device to train on. With ``use_lora`` it is
    wrapped by ``peft`` (only the adapters train) and the reference policy is the same model
    with its adapters disabled: no second copy. peft adds its layers to ``model`` in place, so
    take an inference copy before; :meth:`merged_state_dict` loads into that plain copy.
    With ``adapter``, the trainer trains the LoRA adapter of that name, added to ``model``
    (a ``PeftModel`` already holding others is shared: one trainer per adapter, each with its
    own optimizer; :meth:`adapter_state_dict` is what an engine serving them loads).
    Without LoRA and with ``kl_coef > 0``, the reference is ``ref_model`` when given, else a
    frozen copy of ``model`` taken here. :meth:`step` runs torch with ``threads`` intra-op
    threads in whichever thread calls it (default: the count in effect where the trainer is
    built, e.g. as LocalRL set it).
    """

    def __init__(
        self,
        model: Any,
        config: PolicyUpdateConfig | None = None,
        *,
        ref_model: Any = None,
        threads: int | None = None,
        adapter: str | None = None,
    ) -> None:
        self.config = cfg = config or PolicyUpdateConfig()
        if adapter is not None and not cfg.use_lora:
            raise ValueError("a named adapter needs use_lora=True")
        self.adapter = adapter
        if cfg.use_lora:
            model = _with_lora(model, cfg, adapter)
        self.model = model
        if cfg.gradient_checkpointing:
            _checkpoint_activations(model)
        self.ref_model = None
        if cfg.kl_coef > 0 and not cfg.use_lora:
            self.ref_model = ref_model if ref_model is not None else copy.deepcopy(model)
            self.ref_model.requires_grad_(False).eval()
        if adapter is None:
            self.params = [p for p in model.parameters() if p.requires_grad]
        else:  # this adapter's weights only: others sharing the model have trainers of their own
            self.params = [p for n, p in model.named_parameters() if adapter_of(n) == adapter]
        self.masters = MasterWeights(self.params)  # float32 copies of half-precision weights
        self.optimizer = torch.optim.AdamW(
            self.masters.optimized, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.device = next(model.parameters()).device
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.global_step = 0
        self.mid_update = False
        """Whether an update has begun to change the weights without completing: an optimizer
        step ran (or raised) and the update did not finish, so the weights are neither the last
        completed update's nor the next one's, and no checkpoint should hold them."""
        self.threads = torch.get_num_threads() if threads is None else decide_threads(threads)
        self.stop = threading.Event()
        """Set from another thread to end the update under way at its next micro-batch if no
        optimizer step of it has run yet (:class:`UpdateStopped`; a run being stopped);
        after one, the update finishes, so that the weights stay those of a step."""
        self.stoppable = True
        """Whether :attr:`stop` applies to the next update (LocalRL: not to an adapter's once
        another adapter of the same step has stepped)."""

    # ---- the update ---------------------------------------------------------------------------

    def step(self, batch: TrainingBatch) -> dict[str, float]:
        """One update on ``batch``: ``ppo_epochs`` x ``mini_batches`` optimizer steps.

        Returns ``loss``, ``pg_loss``, ``kl`` (only with a reference policy), ``entropy``,
        ``clip_frac``, ``approx_kl``, ``ratio_mean`` (token-weighted means over the
        micro-batches run, losses as their mini-batches', averaged over optimizer steps),
        ``grad_norm`` (before clipping, mean over optimizer steps), ``optimizer_steps``,
        ``skipped_steps`` (non-finite gradient norm), ``reward_mean``, ``zero_adv_frac``
        (rows with advantage 0), ``rows``, ``tokens`` (trained tokens, all epochs),
        ``adv_tokens`` (those with a non-zero advantage: 0 when every group's rewards were
        equal, so the policy gradient is zero),
        ``tokens_forward`` (tokens fed to the model for training, padding included, a shared
        prompt prefix once per micro-batch),
        ``padding_frac``, ``tokens_per_s`` (tokens of the rows run, per second; absent when no
        row ran, as when every advantage was 0), ``seconds``,
        ``lr`` and ``step`` (updates done so far, this one included). ``clip_frac``,
        ``approx_kl`` and ``ratio_mean`` are against the sampling policy whatever
        ``old_logprobs`` is; with ``decoupled`` the same against the proximal policy (where
        its clip acts) are ``prox_clip_frac``, ``prox_approx_kl`` and ``prox_ratio_mean``,
        beside ``behaviour_weight``, ``behaviour_truncated``, ``behaviour_masked`` and
        ``proximal_rows``.

        **The mismatch** of the engine's logprobs with the trainer's, for the rows the weights
        being updated sampled (staleness 0; stale rows and rows of unknown age are left out):
        ``mismatch/logprob_abs_mean``, ``mismatch/logprob_abs_max``, ``mismatch/kl``,
        ``mismatch/tokens_over`` and ``mismatch/tokens``
        (:func:`~voltrl.algorithms.local.loss.mismatch_metrics`). It costs nothing extra: the
        trainer's logprobs are those of the update's first mini-batch, before its first
        optimizer step (the rows it runs: rows whose advantage is 0 are not run, and with
        several mini-batches only the first's rows are compared), or of every row where the
        update scores them all beforehand (``recompute``, ``rollout_correction``). With
        ``rollout_correction`` also ``mismatch/truncated`` and ``mismatch/masked``, the shares of
        the fresh rows' tokens whose weight was truncated or dropped. (The first mini-batch
        runs in training mode: a model with dropout adds its noise to the figures.)
        """
        if not len(batch):
            raise ValueError("the batch has no rows")
        use_threads(self.threads)
        start = time.perf_counter()
        cfg = self.config
        self._activate()
        data = self._prepare(batch)
        sums: dict[str, float] = {}
        grad_norms: list[float] = []
        skipped = 0
        measure = data.mismatch is None  # before the update's first optimizer step
        if measure:
            data.mismatch = {}
        for _ in range(cfg.ppo_epochs):
            for rows in self._mini_batches(len(batch)):
                for k, v in self._accumulate(data, rows, measure=measure).items():
                    sums[k] = sums.get(k, 0.0) + v
                self._check_stop()
                measure = False
                norm = self._optimizer_step()
                if math.isfinite(norm):
                    grad_norms.append(norm)
                else:
                    skipped += 1
        self.global_step += 1
        self.mid_update = False
        seconds = time.perf_counter() - start
        n_steps = cfg.ppo_epochs * min(cfg.mini_batches, len(batch))
        weighted = max(sums.get("tokens_run", 0.0), 1.0)
        metrics = {
            "loss": sums.get("loss", 0.0) / n_steps,
            "pg_loss": sums.get("pg_loss", 0.0) / n_steps,
            "entropy": sums.get("entropy", 0.0) / weighted,
            "clip_frac": sums.get("clip_frac", 0.0) / weighted,
            "approx_kl": sums.get("approx_kl", 0.0) / weighted,
            "ratio_mean": sums.get("ratio_mean", 0.0) / weighted,
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "optimizer_steps": float(n_steps - skipped),
            "skipped_steps": float(skipped),
            "reward_mean": sum(batch.rewards) / len(batch),
            "zero_adv_frac": float((data.advantages == 0).float().mean()),
            "rows": float(len(batch)),
            "tokens": sums.get("tokens", 0.0),
            "adv_tokens": sums.get("adv_tokens", 0.0),
            "tokens_forward": sums.get("tokens_forward", 0.0),
            "padding_frac": sums.get("padding", 0.0) / max(sums.get("tokens_forward", 0.0), 1.0),
            "seconds": seconds,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "step": float(self.global_step),
        }
        if sums.get("tokens_run"):  # no row ran: no rate (it would be the tokens / ~0 s)
            metrics["tokens_per_s"] = sums["tokens_run"] / seconds
        if data.ref_logprobs is not None:
            metrics["kl"] = sums.get("kl", 0.0) / n_steps
        if data.prox_logprobs is not None:  # the clip's statistics against the proximal policy
            for name in ("prox_clip_frac", "prox_approx_kl", "prox_ratio_mean"):
                metrics[name] = sums.get(name, 0.0) / weighted
            metrics["proximal_rows"] = float(data.proximal_rows)
        metrics.update(data.metrics or {})
        metrics.update(mismatch_metrics(data.mismatch or {}))
        return metrics

    def accumulate_gradients(self, batch: TrainingBatch) -> dict[str, float]:
        """Run the whole batch as one mini-batch and leave its gradient in the parameters'
        ``.grad``, without an optimizer step (for custom loops and tests). Returns the raw
        sums :meth:`step` turns into its metrics."""
        self._activate()
        return self._accumulate(self._prepare(batch), list(range(len(batch))), measure=False)

    def _activate(self) -> None:
        """With a named adapter: make it the model's active adapter and the only one whose
        weights take gradients (another trainer may have activated its own since)."""
        if self.adapter is None:
            return
        self.model.set_adapter(self.adapter)
        for name, p in self.model.named_parameters():
            if (adapter := adapter_of(name)) is not None:
                p.requires_grad_(adapter == self.adapter)

    def _prepare(self, batch: TrainingBatch) -> _Prepared:
        cfg = self.config
        rows = TokenRows.of(batch, self.device)
        old = rows.tensors["response_logprobs"]
        data = _Prepared(
            rows,
            old_logprobs=old,
            old_known=old != 0,
            advantages=batch_advantages(batch, cfg, rows.tensors["rewards"]),
            engine_logprobs=old,
            fresh=torch.tensor([a == 0 for a in _ages(batch)], device=old.device).unsqueeze(1),
        )
        if cfg.kl_coef > 0:
            data.ref_logprobs = self._logprobs_no_grad(data, rows.trained, reference=True)
        if cfg.old_logprobs == "recompute":
            data.old_logprobs = self._logprobs_no_grad(data, rows.trained, reference=False)
            data.old_known = torch.ones_like(data.old_known)
            self._measure(data, data.old_logprobs)
        elif cfg.old_logprobs == "decoupled":
            self._proximal(data, batch)
        return data

    def _measure(self, data: _Prepared, trainer_logprobs: Tensor) -> None:
        """The mismatch of the fresh rows' engine logprobs against the trainer's, all rows
        scored before the update (:func:`~voltrl.algorithms.local.loss.mismatch_sums`)."""
        mask = data.rows.response_mask.bool() & (data.engine_logprobs != 0) & data.fresh
        data.mismatch = mismatch_sums(trainer_logprobs, data.engine_logprobs, mask)

    def _proximal(self, data: _Prepared, batch: TrainingBatch) -> None:
        """The decoupled objective's proximal logprobs and importance weights. The current
        weights score each row sampled by older weights, and with ``rollout_correction`` each
        row they sampled themselves too (``batch.staleness`` 0: the engine's logprobs against
        the trainer's); the other rows (fresh ones without correction, rows of unknown age:
        an explicit transition) keep their sampling logprobs as the proximal policy, with no
        forward pass, and train exactly as with ``old_logprobs="rollout"`` (weight 1)."""
        cfg = self.config
        ages = _ages(batch)
        stale = [i for i in data.rows.trained if ages[i] is not None and ages[i] > 0]
        fresh = [i for i in data.rows.trained if ages[i] == 0] if cfg.rollout_correction else []
        data.prox_logprobs, data.proximal_rows = data.old_logprobs, len(stale) + len(fresh)
        if stale or fresh:
            recomputed = self._logprobs_no_grad(data, sorted(stale + fresh), reference=False)
            scored = torch.zeros_like(data.fresh)
            scored[stale + fresh] = True
            data.prox_logprobs = torch.where(scored, recomputed, data.old_logprobs)
        if fresh:
            self._measure(data, data.prox_logprobs)
        data.weights, data.metrics = self._importance_weights(data)

    def _importance_weights(self, data: _Prepared) -> tuple[Tensor, dict[str, float]]:
        """Each token's importance weight, bounded as its row's age says: a stale row's by
        ``behaviour_weight_*``, a fresh row's by ``rollout_correction`` (weight 1 without), and
        their shares: ``behaviour_weight`` (the mean weight), ``behaviour_truncated`` and
        ``behaviour_masked`` over every trained token, and with a correction
        ``mismatch/truncated`` and ``mismatch/masked`` over the fresh rows' tokens."""
        cfg = self.config
        assert data.prox_logprobs is not None
        mask = data.rows.response_mask.bool()
        known = data.old_known
        args = (data.prox_logprobs, data.old_logprobs, known, mask)
        w, truncated, masked = importance_weights(
            *args, cfg.behaviour_weight_mode, cfg.behaviour_weight_cap
        )
        metrics: dict[str, float] = {}
        if cfg.rollout_correction:
            fw, ft, fm = importance_weights(
                *args, cfg.rollout_correction, cfg.rollout_correction_cap
            )
            w, truncated, masked = (
                torch.where(data.fresh, fw, w),
                torch.where(data.fresh, ft, truncated),
                torch.where(data.fresh, fm, masked),
            )
            fresh = mask & data.fresh
            metrics["mismatch/truncated"] = float(masked_mean(truncated.float(), fresh))
            metrics["mismatch/masked"] = float(masked_mean(masked.float(), fresh))
        metrics["behaviour_weight"] = float(masked_mean(w, mask))
        metrics["behaviour_truncated"] = float(masked_mean(truncated.float(), mask))
        metrics["behaviour_masked"] = float(masked_mean(masked.float(), mask))
        return w, metrics

    def _mini_batches(self, n: int) -> Iterator[list[int]]:
        """The rows of each optimizer step of one epoch: all rows in order when there is one
        mini-batch, else a seeded shuffle split into ``mini_batches`` near-equal parts (at
        most one per row)."""
        k = min(self.config.mini_batches, n)
        if k == 1:
            yield list(range(n))
            return
        order = torch.randperm(n, generator=self.generator).tolist()
        for part in range(k):
            yield sorted(order[part * n // k : (part + 1) * n // k])

    def _micro_batches(
        self, model: Any, data: _Prepared, rows: list[int]
    ) -> Iterator[tuple[Tensor, int, int]]:
        """``rows`` cut into micro-batches as the config bounds them
        (:meth:`~voltrl.algorithms.local.token_rows.TokenRows.micro_batches`)."""
        return data.rows.micro_batches(
            model,
            rows,
            max_rows=self.config.micro_batch_size,
            max_tokens=self.config.max_tokens_per_micro_batch,
        )

    def _logprobs_no_grad(self, data: _Prepared, rows: list[int], *, reference: bool) -> Tensor:
        """Logprobs of the trained tokens of ``rows`` (0 elsewhere) under the reference
        policy or the current one, in eval mode, without autograd."""
        out = torch.zeros_like(data.old_logprobs)
        model, ctx = self.model, nullcontext()
        if reference:
            model, ctx = self._reference()
        was_training = self.model.training
        self.model.eval()
        with torch.inference_mode(), ctx:
            for idx, first, width in self._micro_batches(model, data, rows):
                self._check_stop()
                logprobs, _, _ = data.rows.logprobs(model, idx, first, width, with_entropy=False)
                out[idx, :width] = logprobs
        self.model.train(was_training)
        return out

    def _reference(self) -> tuple[Any, AbstractContextManager[Any]]:
        if self.ref_model is not None:
            return self.ref_model, nullcontext()
        return self.model, self.model.disable_adapter()

    def _accumulate(self, data: _Prepared, rows: list[int], *, measure: bool) -> dict[str, float]:
        """Forward and backward every micro-batch of one mini-batch; gradients accumulate
        in ``.grad`` and sum to the mini-batch loss's gradient. With ``measure`` (no optimizer
        step of this update has run), the fresh rows' logprobs are the trainer's under the
        weights that sampled them: their mismatch with the engine's adds to ``data.mismatch``."""
        cfg = self.config
        self.model.train()
        mask = data.rows.response_mask[rows]
        norm = agg_normaliser(mask, cfg.loss_agg)
        needs_all = cfg.kl_coef > 0 or cfg.entropy_coef != 0
        run = [
            i
            for i in rows
            if data.rows.response_ends[i] > 0 and (needs_all or bool(data.advantages[i] != 0))
        ]
        sums = {"tokens": float(mask.sum()), "tokens_forward": 0.0, "padding": 0.0}
        sums["adv_tokens"] = float(mask[data.advantages[rows] != 0].sum())
        for idx, first, width in self._micro_batches(self.model, data, run):
            self._check_stop()
            m = data.rows.response_mask[idx, :width]
            prox = None if data.prox_logprobs is None else data.prox_logprobs[idx, :width]
            weights = None if data.weights is None else data.weights[idx, :width]
            logprobs, entropy, fed = data.rows.logprobs(
                self.model, idx, first, width, entropy_grad=cfg.entropy_coef != 0
            )
            assert entropy is not None
            pg, stats = policy_loss(
                logprobs,
                data.old_logprobs[idx, :width],
                data.advantages[idx],
                m,
                clip_eps=cfg.clip_eps,
                clip_eps_high=cfg.clip_eps_high,
                agg=cfg.loss_agg,
                old_known=data.old_known[idx, :width],
                normaliser=norm,
                prox_logprobs=prox,
                weights=weights,
            )
            if measure:
                engine = data.engine_logprobs[idx, :width]
                compared = m.bool() & (engine != 0) & data.fresh[idx]
                add_mismatch(data.mismatch, mismatch_sums(logprobs, engine, compared))
            loss = pg
            parts = {"pg_loss": pg.item()}
            if data.ref_logprobs is not None:
                kl = agg_loss(
                    kl_penalty(logprobs, data.ref_logprobs[idx, :width], cfg.kl_kind),
                    m,
                    cfg.loss_agg,
                    norm,
                )
                loss = loss + cfg.kl_coef * kl
                parts["kl"] = kl.item()
            if cfg.entropy_coef != 0:
                loss = loss - cfg.entropy_coef * agg_loss(entropy, m, cfg.loss_agg, norm)
            loss.backward()
            parts["loss"] = loss.item()
            tokens = float(m.sum())
            parts["entropy"] = float(masked_mean(entropy.detach(), m)) * tokens
            parts.update({k: float(v) * tokens for k, v in stats.items() if k != "known_frac"})
            parts["tokens_run"] = tokens
            parts["tokens_forward"], parts["padding"] = fed
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v
        return sums

    def _check_stop(self) -> None:
        # once an optimizer step has run, the update finishes: stopped, its weights would tear
        if self.stop.is_set() and self.stoppable and not self.mid_update:
            self.optimizer.zero_grad(set_to_none=True)
            raise UpdateStopped("the update was stopped (the run is ending)")

    def _optimizer_step(self) -> float:
        """Clip the gradient norm and step; returns the norm before clipping. A non-finite
        norm skips the step (gradients are dropped)."""
        limit = self.config.max_grad_norm or float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.masters.optimized, limit))
        if math.isfinite(norm):
            # An exception inside ``optimizer.step`` may leave some weights updated and others
            # not; one after it (a later mini-batch) leaves a part of the update applied.
            self.mid_update = True
            self.optimizer.step()
            self.masters.masters_to_params()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # ---- weights and checkpoints --------------------------------------------------------------

    def merged_state_dict(self) -> dict[str, Tensor]:
        """The policy's full weights under the base model's parameter names, for the
        inference engine. With LoRA, each adapted weight is ``W + (alpha / r) * B @ A``,
        computed aside (the trained model keeps its adapters, no merge/unmerge drift); the
        tensors are fresh. Without LoRA, the model's own (detached) tensors: do not modify
        them, and copy them if they must outlive the next step."""
        if not self.config.use_lora:
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        from peft.tuners.lora import LoraLayer

        base = self.model.get_base_model()
        out = {
            k.replace(".base_layer", ""): v.detach().clone()
            for k, v in base.state_dict().items()
            if "lora_" not in k
        }
        with torch.no_grad():
            for name, module in base.named_modules():
                if isinstance(module, LoraLayer):
                    weight = module.get_base_layer().weight
                    for adapter in [self.adapter] if self.adapter else module.active_adapters:
                        if adapter in module.lora_A:
                            weight = weight + module.get_delta_weight(adapter)
                    out[f"{name}.weight"] = weight.detach().clone()
        return out

    def adapter_state_dict(self) -> dict[str, Tensor]:
        """The LoRA weights this trainer trains (its named adapter, else the model's only
        one), as ``peft`` saves them: what the engine loads with ``update_weights(...,
        adapter=name)``. The tensors are the model's own: copy them if they must outlive the
        next step."""
        from peft import get_peft_model_state_dict

        if not self.config.use_lora:
            raise ValueError("adapter_state_dict needs use_lora=True")
        return get_peft_model_state_dict(self.model, adapter_name=self.adapter or "default")

    def save_checkpoint(self, directory: str | Path, step: int | None = None) -> Path:
        """Save to ``directory/step_{step:08d}/`` (``step`` defaults to the updates done), whole
        or not at all, fsynced: :func:`~voltrl.algorithms.local.checkpoints.save_trainer`."""
        return save_trainer(self, Path(directory), self.global_step if step is None else step)

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore weights, optimizer, step and RNG states from a checkpoint folder, or from
        the latest one under ``path``; returns the run's step it holds. Raises
        ``FileNotFoundError`` when there is none
        (:func:`~voltrl.algorithms.local.checkpoints.load_trainer`)."""
        return load_trainer(self, Path(path))

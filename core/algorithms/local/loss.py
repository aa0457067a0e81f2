"""The policy-gradient maths of LocalRL, in one place: plain torch functions, no state.

Everything a GRPO/PPO update computes is here, so it can be read top to bottom and
cross-checked (the verl integration tests against these definitions). Notation, per batch:

- ``i`` a row (one training sequence), ``t`` a response position, ``m[i,t]`` the loss mask
  (1 on generated tokens that are trained, 0 on context tokens and padding);
- ``r_i`` the row's reward, ``g(i)`` its group (the task id: GRPO groups the rollouts of one
  task), ``A_i`` its advantage;
- ``logp[i,t] = log pi_theta(y_t | y_<t)``, the current policy; ``old[i,t]`` the logprob the
  token was sampled with (the behaviour policy); ``ref[i,t]`` a frozen reference policy.

The update minimises::

    loss = agg(L_pg, m) + kl_coef * agg(kl(logp, ref), m) - entropy_coef * agg(H, m)

with the PPO-clip term ``L_pg`` of :func:`policy_loss`, an estimator ``kl`` of
:func:`kl_penalty` and the aggregation ``agg`` of :func:`agg_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from voltrl.models.kv_cache import prefill, shares_prefix_cache

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLKind = Literal["low_var_kl", "kl", "mse"]
Correction = Literal["tis", "mis"]

# ---- advantages -------------------------------------------------------------------------------


def rollout_weights(rollout_ids: Sequence[Hashable]) -> Tensor:
    """Per-row weights ``w_i = 1 / n(rollout_i)``, where ``n(rollout)`` is how many rows of
    the batch come from that rollout.

    The rows of one rollout then weigh 1 in total, whatever their number: a rollout that
    became 6 transitions does not count 6 times as much as one that became a single
    trajectory row. :func:`grpo_advantages` uses them as frequency weights for the group
    statistics; :func:`weight_advantages` scales each row's advantage by them.
    """
    counts: dict[Hashable, int] = {}
    for rid in rollout_ids:
        counts[rid] = counts.get(rid, 0) + 1
    return torch.tensor([1.0 / counts[rid] for rid in rollout_ids], dtype=torch.float32)


def grpo_advantages(
    rewards: Tensor,
    group_ids: Sequence[Hashable],
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    weights: Tensor | None = None,
) -> Tensor:
    """GRPO advantages, one per row: the reward minus its group's mean, over the group's std.

    With frequency weights ``w`` (all 1 by default; :func:`rollout_weights` makes each
    rollout count once), for group ``G`` with ``W = sum_{j in G} w_j``::

        mean_G = sum_{j in G} w_j r_j / W
        std_G  = sqrt( sum_{j in G} w_j (r_j - mean_G)^2 / (W - 1) )     (Bessel-corrected)
        A_i    = (r_i - mean_G) / (std_G + eps)     if norm_by_std       (GRPO)
        A_i    =  r_i - mean_G                      otherwise            (Dr. GRPO)

    With unit weights ``std_G`` is ``torch.std`` of the group's rewards; with rollout
    weights and rewards shared by a rollout's rows it is the std over rollouts. A group with
    ``W <= 1`` (a single row, or a single rollout under rollout weights) has no baseline to
    compare against and gets ``A_i = 0`` (verl instead passes a lone reward through as its
    advantage). A group whose rewards are all equal gets exactly 0 (no rounding noise
    divided by a rounding-noise std, even with ``eps = 0``).
    """
    r = rewards.detach().to(torch.float32).flatten()
    if len(group_ids) != r.numel():
        raise ValueError(f"{len(group_ids)} group ids for {r.numel()} rewards")
    w = torch.ones_like(r) if weights is None else weights.to(r).flatten()
    index: dict[Hashable, int] = {}
    g = torch.tensor([index.setdefault(gid, len(index)) for gid in group_ids], device=r.device)
    n_groups = len(index)
    w_sum = torch.zeros(n_groups, device=r.device).index_add_(0, g, w)
    mean = torch.zeros(n_groups, device=r.device).index_add_(0, g, w * r) / w_sum
    centred = r - mean[g]
    adv = centred
    if norm_by_std:
        sq = torch.zeros(n_groups, device=r.device).index_add_(0, g, w * centred**2)
        std = (sq / (w_sum - 1).clamp(min=1e-12)).sqrt()
        adv = centred / (std[g] + eps)
    hi = torch.full((n_groups,), -torch.inf, device=r.device).scatter_reduce(0, g, r, "amax")
    lo = torch.full((n_groups,), torch.inf, device=r.device).scatter_reduce(0, g, r, "amin")
    has_baseline = (w_sum > 1 + 1e-6) & (hi > lo)
    return torch.where(has_baseline[g], adv, torch.zeros_like(adv))


def weight_advantages(advantages: Tensor, weights: Tensor) -> Tensor:
    """Scale each row's advantage by its weight, normalised to mean 1 over the batch::

        A'_i = A_i * w_i * N / sum_j w_j          (N rows)

    With :func:`rollout_weights` the rows of a rollout share its gradient weight instead of
    each carrying the full weight, while the overall scale of the loss stays unchanged.
    """
    w = weights.to(advantages).flatten()
    return advantages * w * (w.numel() / w.sum())


# ---- log-probabilities ------------------------------------------------------------------------


def token_logprobs(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    response_length: int,
    *,
    keep: Tensor | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    prefix: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of the last ``response_length`` tokens of each row under ``model``
    (a Hugging Face causal LM, plain or ``peft``-wrapped), and their entropies.

    ``input_ids`` is ``prompt + response`` (``(B, P + R)``, prompts left-padded, responses
    right-padded, as in :class:`voltrl.trajectory.TrainingBatch`). With ``z`` the logits at
    the position before token ``y_t`` (temperature 1, as the engine's recorded logprobs)::

        logp_t = z[y_t] - logsumexp(z)
        H_t    = logsumexp(z) - sum_v softmax(z)_v z_v        (entropy of pi(. | y_<t))

    Only positions that predict a needed response token go through the LM head (the
    model's ``logits_to_keep``): all ``R`` of them, or with ``keep`` (``(B, R)``, e.g. the
    loss mask) the response columns where some row has ``keep`` set; the others (context
    tokens inside trajectory-mode responses, padding) get logprob and entropy 0. The last
    input token is not fed at all: it predicts nothing. ``logsumexp`` is computed once and
    shared by both; no ``log_softmax`` tensor of the vocabulary's size is kept. Unless
    ``entropy_grad`` (an entropy bonus in the loss), the entropy is a metric: computed
    without autograd, one row at a time, so its ``softmax`` temporary is ``(R, V)``, not
    ``(B, R, V)``. Returns ``(logprobs, entropy)``, both ``(B, R)`` float32; ``entropy`` is
    ``None`` when ``with_entropy`` is false.

    ``prefix`` (``(L,)``, from :func:`~.prefix_cache.split_common_prefix`) is a run of tokens
    that every row starts with and that ``input_ids`` leaves out: it is fed once and its keys
    and values are repeated for every row, which gives the same logprobs and gradients as
    feeding it in each row (with dropout, one draw serves every row), at the cost of one row.
    """
    r = response_length
    fed = input_ids.shape[1] - 1
    cols = None if keep is None else keep.any(0).nonzero().squeeze(-1)
    cache: dict[str, Any] = {}
    if prefix is not None:
        if not shares_prefix_cache(model):
            raise ValueError("this model cannot share a prefix's KV cache among rows")
        cache = prefill(model, prefix, repeat=input_ids.shape[0])
        ones = attention_mask.new_ones(input_ids.shape[0], len(prefix))
        attention_mask = torch.cat([ones, attention_mask], dim=1)
    out = model(
        input_ids=input_ids[:, :fed],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, :fed],
        use_cache=bool(cache),
        logits_to_keep=r if cols is None else cols + (fed - r),
        **cache,
    )
    logits = out.logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    targets = input_ids[:, -r:] if cols is None else input_ids[:, -r:][:, cols]
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy and entropy_grad:
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    elif with_entropy:
        with torch.no_grad():
            entropy = torch.empty_like(lse)
            for k, z in enumerate(logits):
                entropy[k] = lse[k] - (torch.softmax(z, dim=-1) * z).sum(-1)
    if cols is not None:
        full = logprobs.new_zeros(logprobs.shape[0], r)
        logprobs = full.index_copy(1, cols, logprobs)
        entropy = None if entropy is None else full.index_copy(1, cols, entropy)
    return logprobs, entropy


# ---- aggregation ------------------------------------------------------------------------------


def agg_normaliser(mask: Tensor, agg: LossAgg) -> float:
    """The denominator :func:`agg_loss` divides by for this mask: the number of trained
    tokens (``token-mean``) or of rows with at least one trained token (``seq-mean-*``).

    Computed once over a whole mini-batch and passed to every micro-batch's
    :func:`agg_loss`, it makes the sum of micro-batch losses equal the mini-batch loss, so the
    gradient does not depend on how the mini-batch was split.
    """
    if agg == "token-mean":
        return float(mask.sum())
    if agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float((mask.sum(-1) > 0).sum())
    raise ValueError(f"unknown loss aggregation {agg!r}")


def agg_loss(values: Tensor, mask: Tensor, agg: LossAgg, normaliser: float | None = None) -> Tensor:
    """Reduce per-token values ``x[i,t]`` (``(B, T)``) over the mask ``m`` to a scalar::

        token-mean:           sum_{i,t} m x / sum_{i,t} m
        seq-mean-token-sum:   (1/B') sum_i  sum_t m x
        seq-mean-token-mean:  (1/B') sum_i (sum_t m x / sum_t m)

    ``B'`` counts rows with at least one trained token (rows without any contribute 0).
    ``normaliser`` replaces the denominator (``sum m`` or ``B'``) by one computed over a
    larger batch (:func:`agg_normaliser`); a zero denominator gives 0.
    """
    m = mask.to(values.dtype)
    norm = agg_normaliser(mask, agg) if normaliser is None else normaliser
    if agg in ("token-mean", "seq-mean-token-sum"):
        total = (values * m).sum()
    elif agg == "seq-mean-token-mean":
        total = ((values * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum()
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}")
    return total / norm if norm > 0 else total * 0.0


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``sum m x / sum m`` (0 when the mask is empty): the token-mean used for statistics."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


# ---- the PPO-clip policy loss -----------------------------------------------------------------


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    agg: LossAgg = "token-mean",
    old_known: Tensor | None = None,
    normaliser: float | None = None,
    dual_clip: float | None = None,
    max_log_ratio: float | None = None,
    prox_logprobs: Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip loss against the sampling logprobs, aggregated by :func:`agg_loss`.

    Per token, with ``A`` the row's advantage (``advantages`` is ``(B,)`` per row or
    ``(B, T)`` per token), ``e_lo = clip_eps`` and ``e_hi = clip_eps_high`` (default
    ``clip_eps``; a larger value is DAPO's clip-higher)::

        ratio_t = exp(logp_t - old_t)
        L_t     = max( -A * ratio_t,  -A * clip(ratio_t, 1 - e_lo, 1 + e_hi) )
        loss    = agg(L, m)

    Two options make this verl's ``vanilla`` policy loss (``core_algos.
    compute_policy_loss_vanilla``; both off by default, as LocalRL trains): ``max_log_ratio``
    clamps ``logp_t - old_t`` to ``[-max_log_ratio, max_log_ratio]`` before ``exp`` (verl: 20),
    and ``dual_clip = c > 1`` is dual-clip PPO (verl's ``clip_ratio_c``, default 3): where
    ``A < 0``, ``L_t = min(L_t, -A * c)``, bounding how much one token with a huge ratio can
    push. The VERL integration's tests check the two definitions agree numerically.

    **Unknown old logprobs.** The trajectory builder writes 0 where the sampling logprob is
    unknown (retokenized calls, backends that returned none, context tokens). Where
    ``old_known`` is 0 (default: where ``old_logprobs == 0``; everywhere when
    ``old_logprobs`` is ``None``), ``old_t`` is replaced by ``logp_t`` detached, so
    ``ratio_t = 1`` with gradient ``grad logp_t``: ``L_t = -A * ratio_t`` has the REINFORCE
    gradient ``-A * grad logp_t`` and is never clipped. (A sampled token with logprob
    exactly 0 had probability 1; its ratio is ~1 anyway.)

    **Decoupled PPO** (AReaL's objective for stale samples, and the rollout correction of an
    engine whose logprobs differ from the trainer's). With ``prox_logprobs`` (``prox[i,t]``:
    the trainer's logprobs under the weights before the update, the proximal policy), the clip
    is taken against the proximal policy, and the policy that sampled the token enters through
    ``weights`` (``w[i,t]``, from :func:`importance_weights`; 1 when ``None``)::

        ratio_t = exp(logp_t - prox_t)
        L_t     = w_t * max( -A * ratio_t,  -A * clip(ratio_t, 1 - e_lo, 1 + e_hi) )

    With ``prox_t = old_t`` and ``w_t = 1`` (a token sampled by the weights being updated, on
    an engine that computes as the trainer does) this is the PPO-clip loss above, exactly. A
    ``prox_t`` of 0 is unknown, like ``old_t``: ``logp_t`` detached stands in.

    Statistics (token means over the mask, detached), each with one meaning whatever the
    objective: ``clip_frac`` (tokens whose ratio against the sampling policy is beyond the
    clip on the side that cuts the gradient), ``approx_kl`` (``old - logp``, the k1 estimate
    of KL(sampler || pi) on known tokens), ``ratio_mean`` (``exp(logp - old)``),
    ``known_frac``. With ``prox_logprobs`` also the same three against the proximal policy,
    where the clip acts (``prox_clip_frac``, ``prox_approx_kl``, ``prox_ratio_mean``).
    """
    e_lo = clip_eps
    e_hi = clip_eps if clip_eps_high is None else clip_eps_high
    if old_logprobs is None:
        known = torch.zeros_like(response_mask, dtype=torch.bool)
        old = logprobs.detach()
    else:
        known = (old_logprobs != 0) if old_known is None else old_known.bool()
        old = torch.where(known, old_logprobs.to(logprobs.dtype), logprobs.detach())
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    behaviour = old
    if prox_logprobs is not None:  # decoupled: clip against the proximal policy
        prox = prox_logprobs.to(logprobs.dtype)
        old = torch.where(prox != 0, prox, logprobs.detach())  # unknown: as ``old`` above

    def clipped_terms(log_ratio: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if max_log_ratio is not None:
            log_ratio = log_ratio.clamp(min=-max_log_ratio, max=max_log_ratio)
        ratio = torch.exp(log_ratio)
        unclipped = -adv * ratio
        return log_ratio, ratio, unclipped, -adv * torch.clamp(ratio, 1.0 - e_lo, 1.0 + e_hi)

    log_ratio, ratio, unclipped, clipped = clipped_terms(logprobs - old)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)
    if weights is not None:
        per_token = weights.detach().to(per_token.dtype) * per_token
    loss = agg_loss(per_token, response_mask, agg, normaliser)
    with torch.no_grad():
        m = response_mask.bool()
        b_log, b_ratio, b_unclipped, b_clipped = clipped_terms(logprobs.detach() - behaviour)
        stats = {
            "clip_frac": masked_mean((b_clipped > b_unclipped).float(), m),
            "approx_kl": masked_mean(-b_log, m & known),
            "ratio_mean": masked_mean(b_ratio, m),
            "known_frac": masked_mean(known.float(), m),
        }
        if prox_logprobs is not None:
            stats["prox_clip_frac"] = masked_mean((clipped > unclipped).float(), m)
            stats["prox_approx_kl"] = masked_mean(-log_ratio, m)
            stats["prox_ratio_mean"] = masked_mean(ratio, m)
    return loss, stats


# ---- the sampler against the trainer: importance weights and the mismatch ---------------------


def importance_weights(
    prox_logprobs: Tensor,
    old_logprobs: Tensor,
    old_known: Tensor,
    mask: Tensor,
    mode: Correction,
    cap: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The importance weights ``w[i,t]`` of :func:`policy_loss`'s decoupled objective: how
    much likelier the trainer's proximal policy finds each sampled token than the policy that
    sampled it did, bounded (the ratio itself is unbounded and its variance with it).

    With ``d_t = prox_t - old_t`` (0 where ``old_known`` is 0, clamped to ``[-20, 20]``),
    ``rho_t = exp(d_t)`` the token's ratio and ``rho_i = exp(sum_t m d_t)`` the sequence's::

        tis  (truncated IS):  w_t = min(rho_t, cap)
        mis  (masked IS):     w_t = min(rho_t, cap) * 1[1/cap <= rho_i <= cap]

    ``tis`` is verl's ``rollout_is="token"`` with ``rollout_is_threshold=cap`` (and AReaL's
    capped behaviour weight); ``mis`` adds verl's rejection of whole sequences whose ratio
    leaves the band (``rollout_rs="seq_sum_k1"``, threshold ``"1/cap_cap"``): a sequence the
    sampler and the trainer disagree on as a whole is dropped from the update rather than
    trained at a truncated weight. (verl also takes a rejected sequence's tokens out of the
    loss's normaliser; here they stay in it with weight 0.) A token the weights being updated
    sampled, on an engine that computes as the trainer does, has ``d_t = 0``: ``w_t = 1``.

    Returns ``(w, truncated, masked)``: the weights (``(B, T)``, 0 off the mask) and, on the
    mask, which tokens' ratio was over the cap and which tokens' sequence was dropped.
    """
    if cap <= 1.0:
        raise ValueError(f"the importance weight's cap must be > 1, got {cap}")
    m = mask.bool()
    d = torch.where(old_known.bool() & m, prox_logprobs - old_logprobs, 0.0).clamp(-20.0, 20.0)
    rho = torch.exp(d)
    truncated = (rho > cap) & m
    w = rho.clamp(max=cap)
    if mode == "tis":
        masked = torch.zeros_like(m)
    elif mode == "mis":
        seq = d.sum(-1, keepdim=True)
        kept = (seq >= -math.log(cap)) & (seq <= math.log(cap))
        masked = ~kept & m
        w = torch.where(kept, w, torch.zeros_like(w))
    else:
        raise ValueError(f"the importance weights are bounded by tis or mis, not {mode!r}")
    return torch.where(m, w, torch.zeros_like(w)), truncated, masked


MISMATCH_OVER = 0.1
"""``mismatch/tokens_over`` counts the tokens whose logprobs differ by more than this."""


def mismatch_sums(trainer: Tensor, engine: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the engine's logprobs of the sampled tokens (``engine``, what it recorded) are
    from the trainer's for the same weights (``trainer``), summed over the tokens of ``mask``
    (pass only tokens whose engine logprob is known, of rows those very weights sampled).

    With ``d_t = trainer_t - engine_t`` (clamped to ``[-20, 20]``): ``tokens``, ``abs`` =
    ``sum |d_t|``, ``max`` = ``max |d_t|``, ``k3`` = ``sum exp(d_t) - d_t - 1`` (Schulman's k3
    estimator of KL(engine || trainer) from the engine's samples, verl's
    ``rollout_corr/k3_kl``; in float64 with ``expm1``, and at least 0 per token as it is
    exactly, where float rounding of ``exp(d) - d - 1`` for tiny ``d`` goes below),
    ``over`` = the tokens with ``|d_t| > MISMATCH_OVER``. Sums, so
    that micro-batches add up; :func:`mismatch_metrics` turns them into the step's metrics.
    """
    m = mask.bool()
    d = (trainer.detach().float() - engine.float()).clamp(-20.0, 20.0)[m]
    if not d.numel():
        return {}
    return {
        "tokens": float(d.numel()),
        "abs": float(d.abs().sum()),
        "max": float(d.abs().max()),
        "k3": float((torch.expm1(d.double()) - d.double()).clamp(min=0).sum()),
        "over": float((d.abs() > MISMATCH_OVER).sum()),
    }


def add_mismatch(total: dict[str, float], part: dict[str, float]) -> None:
    """Add one :func:`mismatch_sums` to another (in place): sums add, maxima take the max."""
    for key, value in part.items():
        held = total.get(key, 0.0)
        total[key] = max(held, value) if key == "max" else held + value


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The step's mismatch metrics from :func:`mismatch_sums` (none when no token was
    compared): ``mismatch/logprob_abs_mean``, ``mismatch/logprob_abs_max``, ``mismatch/kl``
    (per token), ``mismatch/tokens_over`` (the share over ``MISMATCH_OVER``) and
    ``mismatch/tokens`` (how many tokens were compared)."""
    n = sums.get("tokens", 0.0)
    if not n:
        return {}
    return {
        "mismatch/logprob_abs_mean": sums["abs"] / n,
        "mismatch/logprob_abs_max": sums["max"],
        "mismatch/kl": sums["k3"] / n,
        "mismatch/tokens_over": sums["over"] / n,
        "mismatch/tokens": n,
    }


# ---- KL to a reference policy -----------------------------------------------------------------


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "low_var_kl") -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from the sampled tokens (Schulman's
    estimators, http://joschu.net/blog/kl-approx.html), with ``d = ref_t - logp_t``::

        kl          (k1):  -d                          unbiased, high variance, can be < 0
        mse         (k2):  d^2 / 2                     low variance, biased
        low_var_kl  (k3):  exp(d) - d - 1              unbiased, >= 0 (GRPO's choice)

    ``low_var_kl`` clamps ``d`` to ``[-20, 20]`` and the result to ``[-10, 10]``, as verl
    does, so one badly off-policy token cannot blow up the loss.
    """
    d = ref_logprobs - logprobs
    if kind == "kl":
        return -d
    if kind == "mse":
        return 0.5 * d.square()
    if kind == "low_var_kl":
        d = d.clamp(min=-20.0, max=20.0)
        return (torch.exp(d) - d - 1.0).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}")

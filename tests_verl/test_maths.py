"""One definition of the maths: verl's advantages and policy loss on our batch equal LocalRL's
(``voltrl.algorithms.local.loss``) on the same batch, with the options that make them match."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import rollout

from voltrl.algorithms.local.loss import (
    agg_loss,
    grpo_advantages,
    kl_penalty,
    policy_loss,
    rollout_weights,
    weight_advantages,
)
from voltrl.algorithms.verl.batch import to_dataproto
from voltrl.algorithms.verl.driver import scale_advantages_per_rollout
from voltrl.trajectory import collate


def _one_row_per_rollout():
    rewards = {"a": [1.0, 0.0, 0.0, 1.0], "b": [0.5, 0.25, 1.0], "c": [0.0, 1.0]}
    return collate(
        [rollout(f"{t}{k}", t, [r]) for t, rs in rewards.items() for k, r in enumerate(rs)]
    )


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_verl_grpo_advantages_equal_ours(norm_by_std):
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage

    batch = _one_row_per_rollout()
    data = compute_advantage(
        to_dataproto(batch), AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=norm_by_std
    )
    ours = grpo_advantages(torch.tensor(batch.rewards), batch.group_ids, norm_by_std=norm_by_std)
    mask = data.batch["response_mask"].float()
    torch.testing.assert_close(data.batch["advantages"], ours.unsqueeze(-1) * mask)


def test_several_rows_per_rollout_match_rollout_weighted_statistics():
    """verl's v1 trainer counts each rollout once (its final row) in the group statistics and
    broadcasts the advantage to the rollout's rows: our rollout-weighted GRPO when a
    rollout's rows share its reward (credit "final"). Per-rollout normalisation then scales
    each row by 1/k, as LocalRL's weight_advantages does."""
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    sessions = {
        "ua_0": [1.0] * 3,
        "ua_1": [0.0],
        "ua_2": [0.0] * 2,
        "ub_0": [1.0],
        "ub_1": [0.0] * 4,
    }
    trajectories = [rollout(s, s.split("_")[0], rs) for s, rs in sessions.items()]
    batch = collate(trajectories)
    keys = [f"{rid}_{i}" for rid, rs in sessions.items() for i in range(len(rs))]
    data = to_dataproto(batch)
    data = compute_advantage_for_multi_trajectories(
        data, batch_keys=keys, adv_estimator=AdvantageEstimator.GRPO
    )
    w = rollout_weights(batch.rollout_ids)
    ours = grpo_advantages(torch.tensor(batch.rewards), batch.group_ids, weights=w)
    mask = data.batch["response_mask"].float()
    torch.testing.assert_close(data.batch["advantages"], ours.unsqueeze(-1) * mask)
    tags = [{} for _ in keys]
    scaled = scale_advantages_per_rollout(keys, tags, data.batch["advantages"])
    torch.testing.assert_close(scaled, weight_advantages(ours, w).unsqueeze(-1) * mask)
    nested = torch.nested.as_nested_tensor(list(data.batch["advantages"]), layout=torch.jagged)
    again = scale_advantages_per_rollout(keys, tags, nested).to_padded_tensor(0.0)
    torch.testing.assert_close(again, scaled)


def _actor_config(composed, **changes):
    from omegaconf import OmegaConf, open_dict
    from verl.utils.config import omega_conf_to_dataclass

    cfg = OmegaConf.create(OmegaConf.to_container(composed[0].actor_rollout_ref.actor))
    with open_dict(cfg):
        for key, value in changes.items():
            cfg[key] = value
    return omega_conf_to_dataclass(cfg)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("clip_high", [None, 0.28])
def test_verl_policy_loss_equals_ours(composed, agg, clip_high):
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    torch.manual_seed(0)
    batch = _one_row_per_rollout()
    data = to_dataproto(batch)
    mask = data.batch["response_mask"]
    old = data.batch["rollout_log_probs"]
    # ratios far outside the clip range in both directions, and past verl's clamp
    logp = old + torch.randn_like(old) * 0.7
    logp[1, 0] = old[1, 0] + 25.0  # row 1 has a negative advantage: dual-clip applies
    adv = grpo_advantages(torch.tensor(batch.rewards), batch.group_ids)
    per_token_adv = adv.unsqueeze(-1) * mask
    actor = _actor_config(composed, clip_ratio_high=clip_high or 0.2, clip_ratio_low=0.2)
    theirs, metrics = compute_policy_loss_vanilla(old, logp, per_token_adv, mask, agg, actor)
    ours, stats = policy_loss(
        logp,
        old,
        per_token_adv,
        mask,
        clip_eps=0.2,
        clip_eps_high=clip_high,
        agg=agg,
        old_known=torch.ones_like(mask, dtype=torch.bool),
        dual_clip=actor.clip_ratio_c,
        max_log_ratio=20.0,
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(stats["clip_frac"]), abs=1e-6)
    # without the two verl options, a token with a huge ratio and negative advantage differs
    plain, _ = policy_loss(logp, old, per_token_adv, mask, agg=agg, old_known=mask.bool())
    assert plain.item() != pytest.approx(theirs.item())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_verl_loss_aggregation_equals_ours(agg):
    from verl.trainer.ppo.core_algos import agg_loss as verl_agg

    torch.manual_seed(1)
    values = torch.randn(5, 7)
    mask = (torch.rand(5, 7) > 0.4).long()
    mask[3] = 0  # a row with nothing trained
    torch.testing.assert_close(
        agg_loss(values, mask, agg), verl_agg(values, mask, agg), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(
    ("ours_kind", "verl_kind"), [("low_var_kl", "low_var_kl"), ("kl", "kl"), ("mse", "mse")]
)
def test_verl_kl_estimators_equal_ours(ours_kind, verl_kind):
    from verl.trainer.ppo.core_algos import kl_penalty as verl_kl

    torch.manual_seed(2)
    logp, ref = -torch.rand(4, 6) * 3, -torch.rand(4, 6) * 3
    torch.testing.assert_close(kl_penalty(logp, ref, ours_kind), verl_kl(logp, ref, verl_kind))


def test_documented_differences():
    """Where the definitions differ by design (docs/verl.md): a group with a single rollout
    gets advantage 0 from us and its raw reward from verl."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    scores = torch.zeros(1, 3)
    scores[0, -1] = 0.7
    theirs, _ = compute_grpo_outcome_advantage(
        scores, torch.ones(1, 3), np.array(["g"], dtype=object)
    )
    assert float(theirs[0, 0]) == pytest.approx(0.7, rel=1e-5)
    assert float(grpo_advantages(torch.tensor([0.7]), ["g"])[0]) == 0.0


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_verl_rollout_correction_weights_and_metrics_equal_ours(mode):
    """verl's rollout correction with the settings that are ours (``rollout_is="token"`` with
    threshold 2, and for MIS ``rollout_rs="seq_sum_k1"`` with ``"0.5_2.0"``) gives our
    importance weights (its rejected tokens are our weight-0 ones), and its metrics, under
    our names (:func:`~voltrl.algorithms.verl.algorithm.mismatch_metrics`), are ours."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from voltrl.algorithms.local.loss import importance_weights, mismatch_metrics, mismatch_sums
    from voltrl.algorithms.verl.algorithm import mismatch_metrics as from_verl

    g = torch.Generator().manual_seed(0)
    engine = -torch.rand(6, 5, generator=g) * 3 - 0.01
    trainer = engine + torch.randn(6, 5, generator=g) * 0.6  # some tokens far off, some not
    mask = torch.ones(6, 5)
    mask[4, 3:] = 0
    rejection = {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"}
    proto, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=trainer,
        rollout_log_prob=engine,
        response_mask=mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        **(rejection if mode == "mis" else {}),
    )
    w, truncated, masked = importance_weights(trainer, engine, engine != 0, mask, mode, 2.0)
    assert torch.allclose(w, proto.batch["rollout_is_weights"] * kept, atol=1e-6)
    assert (mode == "mis") == bool(masked.any())  # the seed makes MIS drop some
    ours = mismatch_metrics(mismatch_sums(trainer, engine, mask))
    theirs = from_verl(metrics)
    assert theirs["mismatch/kl"] == pytest.approx(ours["mismatch/kl"], rel=1e-5)
    assert theirs["mismatch/truncated"] == pytest.approx(float(truncated.sum() / mask.sum()))
    if mode == "mis":
        assert theirs["mismatch/masked"] == pytest.approx(float(masked.sum() / mask.sum()))

"""The engine's logprobs against the trainer's: the mismatch each update measures
(``mismatch/*``), and the rollout correction (``update.rollout_correction``: TIS, MIS) that
weighs it, by hand, reduced to today's update when there is none, and through ``fit`` with a
bfloat16 engine serving a float32 policy."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from local_rl_setup import make_algorithm
from tiny_batches import sampled_batch

import voltrl as vl
from voltrl.algorithms.local.loss import (
    MISMATCH_OVER,
    importance_weights,
    mismatch_metrics,
    mismatch_sums,
    policy_loss,
)
from voltrl.algorithms.local.update import PolicyTrainer, PolicyUpdateConfig
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer

# ---- by hand ----------------------------------------------------------------------------------


def test_tis_weighs_each_token_by_its_ratio_truncated_at_the_cap():
    old = torch.tensor([[-1.5, -0.2, -2.0, 0.0]])  # the engine's (the last: unknown)
    prox = torch.tensor([[-1.2, -1.0, -0.5, -3.0]])  # the trainer's
    mask = torch.tensor([[1, 1, 1, 1]])
    w, truncated, masked = importance_weights(prox, old, old != 0, mask, "tis", 2.0)
    expected = [math.exp(0.3), math.exp(-0.8), 2.0, 1.0]  # exp(1.5) > 2; unknown: 1
    assert w[0].tolist() == pytest.approx(expected)
    assert truncated.tolist() == [[False, False, True, False]]
    assert not masked.any()


def test_mis_drops_every_token_of_a_sequence_whose_ratio_leaves_the_band():
    """Sequence ratios exp(1.0) (over 2), exp(0.4) (inside [1/2, 2]) and exp(-1.0) (under
    1/2): the first and the last are dropped whole; the kept one's tokens are weighed as TIS
    weighs them. Padding (mask 0) counts in no sequence's ratio."""
    old = torch.tensor([[-1.5, -0.2, -2.0], [-1.0, -1.0, -1.0], [-0.5, -0.5, -9.0]])
    prox = torch.tensor([[-1.2, -1.0, -0.5], [-0.8, -1.1, -0.7], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    w, truncated, masked = importance_weights(prox, old, old != 0, mask, "mis", 2.0)
    assert w[0].tolist() == [0.0, 0.0, 0.0] and w[2].tolist() == [0.0, 0.0, 0.0]
    assert w[1].tolist() == pytest.approx([math.exp(0.2), math.exp(-0.1), math.exp(0.3)])
    assert masked.tolist() == [[True] * 3, [False] * 3, [True, True, False]]
    assert truncated.tolist() == [[False, False, True], [False] * 3, [False] * 3]
    # in the loss: the dropped rows add nothing and get no gradient
    logp = torch.full((3, 3), -1.0, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, _ = policy_loss(
        logp, old, adv, mask, agg="seq-mean-token-sum", prox_logprobs=prox, weights=w
    )
    ratio = torch.exp(logp.detach()[1] - prox[1])
    by_hand = (w[1] * torch.maximum(-ratio, -ratio.clamp(0.8, 1.2))).sum() / 3
    assert float(loss.detach()) == pytest.approx(float(by_hand))
    (grad,) = torch.autograd.grad(loss, logp)
    assert not grad[0].any() and not grad[2].any() and grad[1].any()


def test_a_bound_other_than_tis_or_mis_or_a_cap_of_1_is_refused():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="tis or mis, not 'drop'"):
        importance_weights(x, x, x.bool(), x, "drop", 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cap must be > 1"):
        importance_weights(x, x, x.bool(), x, "tis", 1.0)


def test_the_mismatch_metrics_are_the_token_means_of_the_logprob_gap():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    engine = torch.tensor([[-1.0, -2.5, -2.8], [-1.05, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the 9 is padding
    sums = mismatch_sums(trainer, engine, mask)
    d = torch.tensor([0.0, 0.5, -0.2, 0.05, 0.0])
    metrics = mismatch_metrics(sums)
    assert metrics["mismatch/tokens"] == 5
    assert metrics["mismatch/logprob_abs_mean"] == pytest.approx(0.75 / 5)
    assert metrics["mismatch/logprob_abs_max"] == pytest.approx(0.5)
    assert metrics["mismatch/kl"] == pytest.approx(float((d.exp() - d - 1).mean()))
    assert metrics["mismatch/tokens_over"] == pytest.approx(2 / 5)  # 0.5 and 0.2 > 0.1
    assert MISMATCH_OVER == 0.1
    assert mismatch_metrics(mismatch_sums(trainer, engine, torch.zeros_like(mask))) == {}


# ---- the update -------------------------------------------------------------------------------


def drifted_batch():
    """Four rows the tiny model sampled (their logprobs its own), as an engine that computes
    otherwise recorded them: row 0's logprobs 0.3 lower, row 3's 5 lower, row 3 sampled by
    the weights of the update before (staleness 1)."""
    tok = build_tiny_tokenizer()
    batch = sampled_batch(build_tiny_model(tok, seed=0), tok)
    for row, gap in ((0, 0.3), (3, 5.0)):
        batch.response_logprobs[row] = [lp - gap for lp in batch.response_logprobs[row]]
    batch.staleness = [0, 0, 0, 1]
    return tok, batch


@pytest.mark.parametrize(
    "update",
    [{}, {"old_logprobs": "recompute"}, {"rollout_correction": "tis"}],
    ids=["in the update", "recompute", "tis"],
)
def test_an_update_measures_the_mismatch_of_the_rows_these_weights_sampled(update):
    """Rows 0-2 (9 tokens) were sampled by the weights being updated; row 0's logprobs are
    0.3 off. The stale row 3 is left out, however far off. Measured in the update's first
    mini-batch or in the forward pass that scores every row first: the same figures."""
    tok, batch = drifted_batch()
    trainer = PolicyTrainer(build_tiny_model(tok, seed=0), PolicyUpdateConfig(**update))
    metrics = trainer.step(batch)
    assert metrics["mismatch/tokens"] == 9
    assert metrics["mismatch/logprob_abs_mean"] == pytest.approx(0.3 * 3 / 9, abs=1e-4)
    assert metrics["mismatch/logprob_abs_max"] == pytest.approx(0.3, abs=1e-4)
    assert metrics["mismatch/kl"] == pytest.approx((math.exp(0.3) - 1.3) * 3 / 9, abs=1e-4)
    assert metrics["mismatch/tokens_over"] == pytest.approx(3 / 9)


def test_tis_truncates_the_drifted_tokens_and_mis_drops_their_sequence():
    """Row 0's ratio exp(0.3) per token: under TIS with cap 1.2 its 3 tokens are truncated;
    under MIS its sequence ratio exp(0.9) leaves [1/1.2, 1.2] and the row is dropped. The shares
    are over the 9 tokens of the rows these weights sampled."""
    tok, batch = drifted_batch()
    shares = {}
    for mode in ("tis", "mis"):
        config = PolicyUpdateConfig(rollout_correction=mode, rollout_correction_cap=1.2)
        metrics = PolicyTrainer(build_tiny_model(tok, seed=0), config).step(batch)
        shares[mode] = (metrics["mismatch/truncated"], metrics["mismatch/masked"])
    assert shares["tis"] == (pytest.approx(3 / 9), 0.0)
    assert shares["mis"] == (pytest.approx(3 / 9), pytest.approx(3 / 9))


def test_a_corrected_update_without_mismatch_is_todays_update():
    """On rows whose recorded logprobs are the trainer's own, TIS and MIS weigh every token 1
    and clip against the same logprobs: the gradient is today's (to the rounding of the
    trainer's second forward pass), and nothing is truncated or dropped."""
    tok = build_tiny_tokenizer()
    batch = sampled_batch(build_tiny_model(tok, seed=0), tok)
    batch.staleness = [0] * len(batch)
    grads = {}
    for correction in (None, "tis", "mis"):
        config = PolicyUpdateConfig(rollout_correction=correction)
        trainer = PolicyTrainer(build_tiny_model(tok, seed=0), config)
        trainer.accumulate_gradients(batch)
        grads[correction] = {n: p.grad for n, p in trainer.model.named_parameters()}
        if correction:
            metrics = PolicyTrainer(build_tiny_model(tok, seed=0), config).step(batch)
            assert metrics["mismatch/truncated"] == metrics["mismatch/masked"] == 0.0
            assert metrics["behaviour_weight"] == pytest.approx(1.0, abs=1e-5)
    for correction in ("tis", "mis"):
        for name, grad in grads[None].items():
            assert torch.allclose(grad, grads[correction][name], rtol=1e-3, atol=1e-8), name


def test_rollout_correction_implies_the_decoupled_objective_and_refuses_another():
    assert PolicyUpdateConfig(rollout_correction="tis").old_logprobs == "decoupled"
    assert PolicyUpdateConfig().old_logprobs == "rollout"
    with pytest.raises(ValueError, match=r'old_logprobs="decoupled".*not old_logprobs=.recompute'):
        PolicyUpdateConfig(rollout_correction="mis", old_logprobs="recompute")
    with pytest.raises(ValueError, match="rollout_correction_cap"):
        PolicyUpdateConfig(rollout_correction="tis", rollout_correction_cap=1.0)
    tok = build_tiny_tokenizer()
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        vl.LocalRL(build_tiny_model(tok), tokenizer=tok, serving={"dtype": "float8"})


# ---- through fit ------------------------------------------------------------------------------

SEEN: Counter[str] = Counter()


@vl.rollout
async def alternating(task: dict, llm: vl.LLM) -> float:
    """One chat call; reward 0 for a task's 1st, 3rd... rollout, 1 for its 2nd, 4th...: each
    group of two holds both, so every row has an advantage and the update runs every row."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": f"Say {task['letter']}."}],
        **llm.sampling_parameters,
    )
    SEEN[task["letter"]] += 1
    return float(SEEN[task["letter"]] % 2 == 0)


@pytest.mark.slow
def test_fit_logs_the_mismatch_of_a_bfloat16_engine_and_corrects_it(tmp_path: Path):
    """A float32 policy served in float32 has no mismatch to speak of; served in bfloat16
    (``serving.dtype``), the engine's logprobs are measurably off the trainer's, and
    ``rollout_correction`` reports what it truncated. Every step logs ``mismatch/*``."""
    SEEN.clear()
    runs = {}
    for name, serving, update in (
        ("float32", {}, {}),
        ("bfloat16", {"dtype": "bfloat16"}, {"rollout_correction": "tis"}),
    ):
        algo = make_algorithm(
            schedule={"steps": 2, "group_size": 2, "tasks_per_step": 2},
            validation={"every": 0},
            checkpoints={"every": 0},
            serving=serving,
            update=PolicyUpdateConfig(lr=1e-3, **update),
            trajectory={"mode": "transition"},
        )
        trainer = vl.Trainer(algo, n_runners=1, run_dir=tmp_path, name=name, progress=False)
        rows = [{"letter": "a"}, {"letter": "b"}]
        runs[name] = [m for m in trainer.fit(alternating, rows).metrics if "update/loss" in m]
    for name, steps in runs.items():
        assert len(steps) == 2 and all(m["mismatch/tokens"] > 0 for m in steps), name
    # the tiny model: ~2e-7 in float32, ~7e-4 in bfloat16
    assert all(m["mismatch/logprob_abs_max"] < 1e-5 for m in runs["float32"])
    assert all(m["mismatch/logprob_abs_mean"] > 1e-4 for m in runs["bfloat16"])
    assert all(0.0 <= m["mismatch/truncated"] <= 1.0 for m in runs["bfloat16"])
    assert "mismatch/truncated" not in runs["float32"][0]

"""LocalRL's policy update: the loss maths by hand, and the trainer on a tiny random Qwen2."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import transformers
from tiny_batches import (
    agent_batch,
    rollout,
    row,
    set_sampling_logprobs,
    tiny_model,
    varied_batch,
)

from voltrl.algorithms.local.checkpoints import latest_checkpoint
from voltrl.algorithms.local.loss import (
    agg_loss,
    agg_normaliser,
    grpo_advantages,
    kl_penalty,
    policy_loss,
    rollout_weights,
    token_logprobs,
    weight_advantages,
)
from voltrl.algorithms.local.shared_prefix import split_common_prefix
from voltrl.algorithms.local.update import (
    PolicyTrainer,
    PolicyUpdateConfig,
    _checkpoint_activations,
)
from voltrl.trajectory import TrainingBatch, TrajectoryConfig, build_trajectory, collate
from voltrl.types import LLMCall, Trajectory

AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and more torch threads than free cores (a busy
    machine) make every kernel wait for a descheduled thread: run this module on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SYSTEM = list(range(100, 124))  # 24 tokens every prompt of shared_prompt_batch starts with


def shared_prompt_batch() -> TrainingBatch:
    """An agent's rows: every prompt starts with one system prompt, then a question of its
    own length (each starting with a different token); trajectory-mode rows whose responses
    hold mask-0 tool results; two rollouts of one task with the same prompt."""
    config = TrajectoryConfig(mode="trajectory")
    questions = {"r0": [1, 2, 3], "r1": [4], "r2": [5, 6, 7, 8, 9, 10], "r3": [5, 6, 7, 8, 9, 10]}
    trajectories = []
    for k, (rid, question) in enumerate(questions.items()):
        first = [*SYSTEM, *question]
        answer = [30 + k, 31]
        calls = [
            LLMCall(
                rollout_id=rid,
                attempt_id=f"{rid}-at",
                sequence_id=0,
                prompt_token_ids=first,
                response_token_ids=answer,
            ),
            LLMCall(
                rollout_id=rid,
                attempt_id=f"{rid}-at",
                sequence_id=1,
                prompt_token_ids=[*first, *answer, 90, 91 + k],
                response_token_ids=[40 + k] * (k + 1),
            ),
        ]
        task = "a" if k < 2 else "b"  # r2 and r3: one task, one prompt
        trajectories.append(build_trajectory(rollout(rid, task, float(k)), calls, config=config))
    return collate(trajectories, config)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def response_logprob(model: torch.nn.Module, prompt: list[int], response: list[int]) -> float:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return float(logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None]).sum())


# ---- the maths by hand ------------------------------------------------------------------------


def test_grpo_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 2.0, 5.0, 3.0, 3.0])
    groups = ["a", "a", "a", "b", "c", "c"]
    # group a: mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1; b is a singleton; c is flat
    adv = grpo_advantages(rewards, groups, eps=0.0)
    assert adv.tolist() == pytest.approx([0.0, -1.0, 1.0, 0.0, 0.0, 0.0])
    adv = grpo_advantages(rewards, groups, eps=1.0)
    assert adv.tolist() == pytest.approx([0.0, -0.5, 0.5, 0.0, 0.0, 0.0])
    adv = grpo_advantages(rewards, groups, norm_by_std=False)
    assert adv.tolist() == pytest.approx([0.0, -1.0, 1.0, 0.0, 0.0, 0.0])
    assert grpo_advantages(torch.tensor([4.0, 6.0]), ["g", "g"], norm_by_std=False).tolist() == [
        -1.0,
        1.0,
    ]
    flat = grpo_advantages(torch.tensor([0.1] * 7), ["g"] * 7, eps=0.0)  # mean has rounding
    assert flat.tolist() == [0.0] * 7
    with pytest.raises(ValueError):
        grpo_advantages(rewards, groups[:2])


def test_rollout_weighted_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    rollouts = ["r1", "r1", "r1", "r2"]
    w = rollout_weights(rollouts)
    assert w.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0])
    # unweighted: mean 0.75, std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5
    plain = grpo_advantages(rewards, ["g"] * 4, eps=0.0)
    assert plain.tolist() == pytest.approx([0.5, 0.5, 0.5, -1.5])
    # weighted: each rollout counts once: mean 0.5, std sqrt((0.25 + 0.25) / (2 - 1))
    adv = grpo_advantages(rewards, ["g"] * 4, eps=0.0, weights=w)
    s = 0.5 / math.sqrt(0.5)
    assert adv.tolist() == pytest.approx([s, s, s, -s])
    # A_i * w_i * N / sum(w) = A_i * w_i * 4 / 2: each rollout's rows share its weight
    scaled = weight_advantages(adv, w)
    assert scaled.tolist() == pytest.approx([2 * s / 3, 2 * s / 3, 2 * s / 3, -2 * s])
    assert scaled[:3].sum() == pytest.approx(-scaled[3])
    # one rollout alone in its group has no baseline, however many rows it has
    alone = grpo_advantages(
        torch.tensor([1.0, 0.0]), ["g", "g"], weights=rollout_weights(["r", "r"])
    )
    assert alone.tolist() == [0.0, 0.0]


def test_policy_loss_clipping_by_hand() -> None:
    old = torch.full((1, 3), -1.0)
    ratios = torch.tensor([[1.5, 0.5, 1.1]])
    logp = (old + ratios.log()).requires_grad_(True)
    mask = torch.ones(1, 3)
    # A = +1: per token max(-r, -clip(r, 0.8, 1.2)) = [-1.2, -0.5, -1.1]
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.1) / 3)
    assert float(stats["clip_frac"]) == pytest.approx(1 / 3)
    assert float(stats["ratio_mean"]) == pytest.approx(1.0 + 0.1 / 3)
    assert float(stats["approx_kl"]) == pytest.approx(-float(ratios.log().mean()), rel=1e-5)
    loss.backward()
    # the clipped token gets no gradient; the others -A * ratio / 3
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5 / 3, -1.1 / 3])
    # A = -1: max(r, clip(r)) = [1.5, 0.8, 1.1]; the second token is the clipped one
    loss, stats = policy_loss(logp, old, torch.tensor([-1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx((1.5 + 0.8 + 1.1) / 3)
    assert float(stats["clip_frac"]) == pytest.approx(1 / 3)
    # clip-higher: 1.5 < 1 + 0.6 is no longer clipped
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2, clip_eps_high=0.6)
    assert loss.item() == pytest.approx((-1.5 - 0.5 - 1.1) / 3)
    # per-token advantages work too
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, _ = policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1) / 3)


def test_unknown_old_logprobs_mean_ratio_one() -> None:
    logp = torch.tensor([[-0.5, -2.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    # old logprob 0 = unknown: ratio 1, REINFORCE gradient -A / n, never clipped
    old = torch.tensor([[0.0, -1.0, -7.0]])
    loss, stats = policy_loss(logp, old, torch.tensor([2.0]), mask)
    r1 = math.exp(-1.0)  # the known token: ratio exp(-2 - -1), below 0.8 but A > 0: unclipped
    assert loss.item() == pytest.approx((-2.0 * 1.0 + max(-2.0 * r1, -2.0 * 0.8)) / 2)
    assert float(stats["known_frac"]) == pytest.approx(0.5)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -2.0 * r1 / 2, 0.0])
    # no old logprobs at all: pure REINFORCE, loss -mean(A) with gradient -A / n
    logp.grad = None
    loss, stats = policy_loss(logp, None, torch.tensor([2.0]), mask)
    assert loss.item() == pytest.approx(-2.0)
    assert float(stats["clip_frac"]) == 0.0
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -1.0, 0.0])


@pytest.mark.parametrize("agg", AGGS)
def test_aggregation_by_hand(agg: str) -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    expected = {
        "token-mean": (1 + 2 + 4) / 3,
        "seq-mean-token-sum": ((1 + 2) + 4) / 2,  # the all-masked row does not count
        "seq-mean-token-mean": ((1 + 2) / 2 + 4) / 2,
    }[agg]
    assert float(agg_loss(values, mask, agg)) == pytest.approx(expected)  # type: ignore[arg-type]
    # micro-batches with the whole batch's normaliser sum to the whole batch's value
    norm = agg_normaliser(mask, agg)  # type: ignore[arg-type]
    parts = [agg_loss(values[i : i + 1], mask[i : i + 1], agg, norm) for i in range(3)]  # type: ignore[arg-type]
    assert float(sum(parts)) == pytest.approx(expected)
    assert float(agg_loss(values, torch.zeros_like(mask), agg)) == 0.0  # type: ignore[arg-type]


def test_kl_estimators_by_hand() -> None:
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])  # d = ref - logp = [-0.5, 1.0]
    assert kl_penalty(logp, ref, "kl").tolist() == pytest.approx([0.5, -1.0])
    assert kl_penalty(logp, ref, "mse").tolist() == pytest.approx([0.125, 0.5])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.e - 1 - 1]
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == pytest.approx(k3)
    assert kl_penalty(torch.tensor([-50.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0
    assert kl_penalty(logp, logp, "low_var_kl").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "nope")  # type: ignore[arg-type]


def test_token_logprobs_match_a_plain_forward() -> None:
    model = tiny_model()
    batch = varied_batch()
    t = batch.to_torch()
    lp, ent = token_logprobs(
        model, t["input_ids"], t["attention_mask"], t["position_ids"], batch.response_length
    )
    assert ent is not None
    for i in range(len(batch)):
        prompt = [x for x, a in zip(batch.prompt_ids[i], batch.prompt_mask[i], strict=True) if a]
        n = sum(batch.attention_mask[i]) - len(prompt)
        ids = torch.tensor([prompt + batch.response_ids[i][:n]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        ref = logits.log_softmax(-1)
        expected = ref.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        assert lp[i, :n].tolist() == pytest.approx(expected.tolist(), abs=1e-5)
        entropy = -(ref.exp() * ref).sum(-1)
        assert ent[i, :n].tolist() == pytest.approx(entropy.tolist(), abs=1e-5)
    # with ``keep``, columns no row keeps are not projected on the vocabulary: 0 there
    keep = torch.zeros_like(t["response_mask"], dtype=torch.bool)
    keep[0, 1] = keep[3, 3] = True
    lp_kept, ent_kept = token_logprobs(
        model, t["input_ids"], t["attention_mask"], t["position_ids"], 4, keep=keep
    )
    assert ent_kept is not None
    for col in range(4):
        if col in (1, 3):
            torch.testing.assert_close(lp_kept[:, col], lp[:, col])
            torch.testing.assert_close(ent_kept[:, col], ent[:, col])
        else:
            assert lp_kept[:, col].abs().sum() == 0 and ent_kept[:, col].abs().sum() == 0


def test_a_shared_prompt_prefix_fed_once_gives_the_same_logprobs_and_gradients() -> None:
    batch = shared_prompt_batch()
    t = batch.to_torch()
    lengths = t["prompt_mask"].sum(1).tolist()
    inputs = t["input_ids"], t["attention_mask"], t["position_ids"]
    model = tiny_model().train()
    prefix, ids, mask, positions = split_common_prefix(model, *inputs, lengths)
    assert prefix is not None and prefix.tolist() == SYSTEM  # the questions differ at once
    assert ids.shape[1] == t["input_ids"].shape[1] - len(SYSTEM)
    trained = t["response_mask"].bool()
    real = t["attention_mask"][:, -batch.response_length :].bool()  # context tokens too

    def logprobs_and_grads(*args: torch.Tensor, **split: object) -> tuple[torch.Tensor, dict]:
        lp, _ = token_logprobs(
            model,
            *args,
            batch.response_length,
            keep=t["response_mask"],
            **split,  # type: ignore[arg-type]
        )
        model.zero_grad(set_to_none=True)
        (lp * trained).sum().backward()
        return lp, grads(model)

    want, want_grads = logprobs_and_grads(*inputs)
    widths: list[int] = []
    model.model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    got, got_grads = logprobs_and_grads(ids, mask, positions, prefix=prefix)
    assert widths == [len(SYSTEM), ids.shape[1] - 1]  # the prefix once, then the rows
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["checkpointed", "sliding window"])
def test_rows_are_fed_whole_where_one_prefix_cache_cannot_serve_them(kind: str) -> None:
    """A checkpointed layer would add its keys to the cache again when recomputed; a sliding
    window would count the masked columns between the prefix and a row as distance."""
    model = tiny_model()
    if kind == "checkpointed":
        _checkpoint_activations(model)
    else:
        model.config.use_sliding_window, model.config.sliding_window = True, 8
        model.config.layer_types = ["sliding_attention"] * 2
        model = transformers.Qwen2ForCausalLM(model.config)
    model.train()
    t = shared_prompt_batch().to_torch()
    inputs = t["input_ids"], t["attention_mask"], t["position_ids"]
    lengths = t["prompt_mask"].sum(1).tolist()
    prefix, *rows = split_common_prefix(model, *inputs, lengths)
    assert prefix is None and all(a is b for a, b in zip(rows, inputs, strict=True))
    with pytest.raises(ValueError, match="cannot share"):
        token_logprobs(model, *inputs, 4, prefix=torch.tensor(SYSTEM))
    if kind == "checkpointed":  # not recomputed without autograd: shared there
        with torch.no_grad():
            assert split_common_prefix(model, *inputs, lengths)[0] is not None


def test_a_prefix_is_what_every_prompt_starts_with_less_the_token_before_the_response() -> None:
    model = tiny_model()
    ones = torch.ones(2, 27, dtype=torch.long)
    ids = torch.tensor([[*SYSTEM, 1, 2, 3], [*SYSTEM, 1, 5, 6]])  # they part after 25 tokens
    prefix, rest, mask, positions = split_common_prefix(
        model, ids, ones, ones.cumsum(1) - 1, [27, 27]
    )
    assert prefix is not None and prefix.tolist() == [*SYSTEM, 1]
    assert rest.tolist() == [[2, 3], [5, 6]] and positions.tolist() == [[25, 26], [25, 26]]
    # the same prompt twice (one task's group): each row keeps its last prompt token
    ids, ones = ids[[0, 0], :25], ones[:, :25]
    prefix, rest, mask, positions = split_common_prefix(
        model, ids, ones, ones.cumsum(1) - 1, [25, 25]
    )
    assert prefix is not None and prefix.tolist() == SYSTEM
    assert rest.tolist() == [[1], [1]] and mask.tolist() == [[1], [1]]
    assert positions.tolist() == [[24], [24]]
    # a shorter prompt, left-padded: its padding and its copy of the prefix are masked out
    ids = torch.tensor([[*SYSTEM, 1, 2, 3], [0, 0, *SYSTEM, 4]])
    mask = torch.tensor([[1] * 27, [0, 0] + [1] * 25])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    prefix, rest, mask, positions = split_common_prefix(model, ids, mask, positions, [27, 25])
    assert prefix is not None and prefix.tolist() == SYSTEM
    assert rest.tolist() == [[1, 2, 3], [122, 123, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions[:, -1].tolist() == [26, 24]
    # too short a prefix (under 16 tokens) or one row: nothing is split
    short = split_common_prefix(model, ids[:, -10:], mask[:, -10:], mask[:, -10:], [10, 10])
    assert short[0] is None and short[1].shape[1] == 10
    assert split_common_prefix(model, ids[:1], mask[:1], mask[:1], [27])[0] is None


# ---- the trainer ------------------------------------------------------------------------------


def test_step_reduces_the_loss_on_its_batch() -> None:
    model = tiny_model()
    batch = varied_batch()
    set_sampling_logprobs(model, batch)
    trainer = PolicyTrainer(model, PolicyUpdateConfig(lr=1e-3, micro_batch_size=2))
    before = trainer.accumulate_gradients(batch)["loss"]
    trainer.optimizer.zero_grad()
    metrics = trainer.step(batch)
    after = trainer.accumulate_gradients(batch)["loss"]
    assert metrics["loss"] == pytest.approx(before)
    assert after < before
    assert metrics["tokens"] == sum(map(sum, batch.response_mask))
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["optimizer_steps"] == 1.0 and metrics["step"] == 1.0
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0


@pytest.mark.parametrize("mode", ["transition", "trajectory"])
def test_steps_move_the_policy_toward_rewarded_completions(mode: str) -> None:
    model = tiny_model()
    good, bad, prompt = [50, 51, 52], [60, 61, 62], [1, 2, 3]
    config = TrajectoryConfig(mode=mode)  # type: ignore[arg-type]
    trajectories = [
        build_trajectory(
            rollout(rid, "t", reward),
            [
                LLMCall(
                    rollout_id=rid,
                    attempt_id=f"{rid}-at",
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                )
            ],
            config=config,
        )
        for rid, response, reward in [("g", good, 1.0), ("b", bad, 0.0)]
    ]
    batch = collate(trajectories, config)
    trainer = PolicyTrainer(model, PolicyUpdateConfig(lr=3e-3))
    good0, bad0 = response_logprob(model, prompt, good), response_logprob(model, prompt, bad)
    for _ in range(5):
        set_sampling_logprobs(model, batch)  # on-policy, as fresh rollouts would be
        trainer.step(batch)
    assert response_logprob(model, prompt, good) > good0 + 0.5
    assert response_logprob(model, prompt, bad) < bad0 - 0.5


# two_agent_batch's agents' system prompts: 120 tokens each, none in common (long enough that
# feeding each once beats one pass of all rows)
WRITER = [100 + k % 24 for k in range(120)]
REVIEWER = [150 + k % 24 for k in range(120)]


def two_agent_batch() -> TrainingBatch:
    """Two agents' calls, interleaved: a writer whose prompts start with WRITER and a reviewer
    whose prompts start with REVIEWER, transition-mode rows, two tasks."""
    calls = []
    for k in range(6):
        system = WRITER if k % 2 else REVIEWER
        call = LLMCall(
            rollout_id=f"r{k}",
            attempt_id=f"r{k}-at",
            sequence_id=0,
            prompt_token_ids=[*system, 10 + k, *range(1, 1 + k)],
            response_token_ids=[30 + k] * (1 + k % 3),
        )
        trajectory = build_trajectory(rollout(f"r{k}", "ab"[k % 2], float(k in (2, 3, 4))), [call])
        calls.append(trajectory)
    return collate(calls)


@pytest.mark.parametrize(
    "extra",
    [
        {"loss_agg": "token-mean"},
        {"loss_agg": "seq-mean-token-sum"},
        {"loss_agg": "seq-mean-token-mean"},
        {"kl_coef": 0.1, "entropy_coef": 0.01, "rollout_weighting": True},
        {"gradient_checkpointing": True, "clip_eps_high": 0.28},
    ],
)
@pytest.mark.parametrize("make_batch", [varied_batch, shared_prompt_batch, two_agent_batch])
def test_gradient_does_not_depend_on_micro_batch_size(
    extra: dict[str, object], make_batch: Callable[[], TrainingBatch]
) -> None:
    """Rows fed alone, in micro-batches, or all together (each agent's rows then in one
    micro-batch, their prompt prefix fed once) give one gradient."""
    model = tiny_model()
    batch = make_batch()
    set_sampling_logprobs(model, batch)
    # perturb the policy so ratios differ from 1 and some tokens clip
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape))
    results = []
    for size in [1, 3, len(batch)]:
        config = PolicyUpdateConfig(micro_batch_size=size, **extra)  # type: ignore[arg-type]
        trainer = PolicyTrainer(copy.deepcopy(model), config)
        sums = trainer.accumulate_gradients(batch)
        results.append((sums["loss"], grads(trainer.model)))
    config = PolicyUpdateConfig(max_tokens_per_micro_batch=12, **extra)  # type: ignore[arg-type]
    budget = PolicyTrainer(copy.deepcopy(model), config)
    results.append((budget.accumulate_gradients(batch)["loss"], grads(budget.model)))
    loss0, g0 = results[0]
    assert g0 and sums["clip_frac"] > 0  # some tokens clip: the test covers both branches
    if make_batch is not varied_batch:  # each agent's rows together, its prefix fed once
        fed = 0
        systems = [SYSTEM] if make_batch is shared_prompt_batch else [WRITER, REVIEWER]
        pairs = zip(batch.prompt_ids, batch.prompt_mask, strict=True)
        prompts = [ids[len(ids) - sum(m) :] for ids, m in pairs]
        for system in systems:
            rows = [i for i, p in enumerate(prompts) if p[: len(system)] == system]
            prompt = max(sum(batch.prompt_mask[i]) for i in rows)
            ends = (len(m) - m[::-1].index(1) for m in (batch.response_mask[i] for i in rows))
            fed += len(rows) * (prompt + max(ends) - 1) - (len(rows) - 1) * len(system)
        if extra.get("gradient_checkpointing"):  # fed whole (a recomputed layer would add its
            width = batch.prompt_length + max(
                len(m) - m[::-1].index(1) for m in batch.response_mask
            )
            fed = len(batch) * (width - 1)  # keys to a shared cache again), all in one pass
        assert sums["tokens_forward"] == fed
    for loss, g in results[1:]:
        assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-7)
        assert g.keys() == g0.keys()
        for name in g0:
            torch.testing.assert_close(g[name], g0[name], rtol=1e-4, atol=1e-5)


def test_mask_zero_tokens_are_context_not_trained() -> None:
    """A trajectory-mode row's gradient equals a plain re-computation that sums the loss
    over generated tokens only, on unpadded sequences."""
    model = tiny_model()
    batch = agent_batch("trajectory")
    assert len(batch) == 3 and 0 in batch.response_mask[0][: sum(batch.attention_mask[0])]
    trainer = PolicyTrainer(copy.deepcopy(model), PolicyUpdateConfig(micro_batch_size=2))
    trainer.accumulate_gradients(batch)
    got = grads(trainer.model)

    adv = grpo_advantages(torch.tensor(batch.rewards), batch.group_ids)
    n_tokens = sum(map(sum, batch.response_mask))
    loss = torch.zeros(())
    for i in range(len(batch)):
        prompt = [x for x, a in zip(batch.prompt_ids[i], batch.prompt_mask[i], strict=True) if a]
        n = sum(batch.attention_mask[i]) - len(prompt)
        mask = batch.response_mask[i][:n]
        ids = torch.tensor([prompt + batch.response_ids[i][:n]])
        logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        logp = logp.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        trained = torch.tensor(mask, dtype=torch.bool)
        # no sampling logprobs were recorded: ratio 1, loss -A * logp summed over trained tokens
        loss = loss - (adv[i] * torch.exp(logp - logp.detach())[trained]).sum() / n_tokens
    loss.backward()
    want = grads(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)

    # and the context tokens' recorded logprobs do not matter
    for k, m in enumerate(batch.response_mask[0]):
        if not m:
            batch.response_logprobs[0][k] = -5.0
    model.zero_grad(set_to_none=True)
    again = PolicyTrainer(copy.deepcopy(model), PolicyUpdateConfig(micro_batch_size=2))
    again.accumulate_gradients(batch)
    for name, g in grads(again.model).items():
        torch.testing.assert_close(g, got[name], rtol=1e-5, atol=1e-7)


def test_trajectory_mode_trains_the_same_tokens_with_fewer_forward_tokens() -> None:
    traj, trans = agent_batch("trajectory"), agent_batch("transition")
    m1 = PolicyTrainer(tiny_model(), PolicyUpdateConfig()).step(traj)
    m2 = PolicyTrainer(tiny_model(), PolicyUpdateConfig()).step(trans)
    assert m1["tokens"] == m2["tokens"] == 3 * 3 * 2
    assert m1["tokens_forward"] < m2["tokens_forward"]


def test_zero_advantage_rows_are_not_run() -> None:
    batch = collate(
        [
            Trajectory(rollout_id=f"r{k}", task_id="t", transitions=[row([1, 2], [3, 4], 1.0)])
            for k in range(3)
        ]
    )
    metrics = PolicyTrainer(tiny_model(), PolicyUpdateConfig()).step(batch)
    assert metrics["zero_adv_frac"] == 1.0
    assert metrics["tokens_forward"] == 0.0 and metrics["loss"] == 0.0
    assert metrics["grad_norm"] == 0.0


def test_recomputed_old_logprobs_replace_stale_ones() -> None:
    batch = varied_batch()
    batch.response_logprobs = [[-9.0 if m else 0.0 for m in ms] for ms in batch.response_mask]
    stale = PolicyTrainer(tiny_model(), PolicyUpdateConfig()).step(batch)
    fresh = PolicyTrainer(tiny_model(), PolicyUpdateConfig(old_logprobs="recompute")).step(batch)
    assert stale["ratio_mean"] > 10 and stale["clip_frac"] > 0
    assert fresh["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and fresh["clip_frac"] == 0.0


def test_epochs_and_mini_batches_take_one_optimizer_step_each() -> None:
    model = tiny_model()
    batch = varied_batch()
    set_sampling_logprobs(model, batch)
    config = PolicyUpdateConfig(lr=1e-2, ppo_epochs=2, mini_batches=2, micro_batch_size=2)
    metrics = PolicyTrainer(model, config).step(batch)
    assert metrics["optimizer_steps"] == 4.0 and metrics["step"] == 1.0
    # later mini-batches see a policy that already moved away from the sampling one
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-4)
    assert metrics["tokens"] == 2 * sum(map(sum, batch.response_mask))
    few = PolicyTrainer(tiny_model(), PolicyUpdateConfig(mini_batches=50)).step(batch)
    assert few["optimizer_steps"] == len(batch)


def test_empty_batch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no rows"):
        PolicyTrainer(tiny_model(), PolicyUpdateConfig()).step(collate([]))


def test_empty_prompt_is_a_clear_error() -> None:
    batch = collate([Trajectory(rollout_id="r", task_id="t", transitions=[row([], [1, 2], 1.0)])])
    with pytest.raises(ValueError, match="empty prompt"):
        PolicyTrainer(tiny_model(), PolicyUpdateConfig()).step(batch)


def test_update_has_no_temperature_of_its_own() -> None:
    """PPO's old logprobs are the engine's raw temperature-1 ones: scoring the new policy at
    another temperature would skew every ratio, so there is no such setting."""
    with pytest.raises(ValueError, match=r"temperature\s+Extra inputs are not permitted"):
        PolicyUpdateConfig(temperature=0.7)  # type: ignore[call-arg]


# ---- LoRA -------------------------------------------------------------------------------------


def test_lora_step_changes_only_adapters_and_merges() -> None:
    base_state = {k: v.clone() for k, v in tiny_model().state_dict().items()}
    config = PolicyUpdateConfig(lr=1e-2, use_lora=True, lora_r=4, lora_alpha=8, kl_coef=0.1)
    trainer = PolicyTrainer(tiny_model(), config)
    assert trainer.ref_model is None  # the reference is the base, adapters disabled
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    batch = varied_batch()
    first = trainer.step(batch)
    second = trainer.step(batch)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7) and second["kl"] > 0
    for name, p in trainer.model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == ("lora_" in name), name
        assert ("lora_" in name) == p.requires_grad

    merged = trainer.merged_state_dict()
    assert merged.keys() == base_state.keys()
    q_proj, embed = "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"
    assert not torch.equal(merged[q_proj], base_state[q_proj])
    torch.testing.assert_close(merged[embed], base_state[embed])
    reference = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    for k, v in reference.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-6)
    # the merged weights give the adapted model's logprobs
    plain = tiny_model()
    plain.load_state_dict(merged)
    assert response_logprob(plain, [1, 2, 3], [10, 11]) == pytest.approx(
        response_logprob(trainer.model, [1, 2, 3], [10, 11]), abs=1e-4
    )


# ---- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("use_lora", [False, True])
def test_checkpoint_resumes_identically(tmp_path: Path, use_lora: bool) -> None:
    config = PolicyUpdateConfig(lr=1e-3, use_lora=use_lora, mini_batches=2, kl_coef=0.05)
    batch = varied_batch()
    first = PolicyTrainer(tiny_model(), config)
    first.step(batch)
    first.step(batch)
    saved = first.save_checkpoint(tmp_path)
    assert saved.name == "step_00000002" and latest_checkpoint(tmp_path) == saved
    first.save_checkpoint(tmp_path, step=1)
    assert latest_checkpoint(tmp_path) == saved
    expected = first.step(batch)

    resumed = PolicyTrainer(tiny_model(), config)
    assert resumed.load_checkpoint(tmp_path) == 2
    got = resumed.step(batch)
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-7)
    assert got["kl"] == pytest.approx(expected["kl"], abs=1e-7)
    assert got["step"] == 3.0
    for (n, p), q in zip(first.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=n)


def test_load_checkpoint_without_one_raises(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError):
        PolicyTrainer(tiny_model(), PolicyUpdateConfig()).load_checkpoint(tmp_path)

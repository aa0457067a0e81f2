"""Asynchronous LocalRL (``max_staleness``): the decoupled PPO loss and its reduction to the
synchronous loss, the version bookkeeping (per-call versions on rows, staleness, drops), and an
end-to-end run whose rollouts span weight updates, checked call by call against the weights
that sampled them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from rl_agents import STEP, thinks_between_calls
from tiny_batches import sampled_batch

import voltrl as vl
from voltrl._http.serving import serve_in_thread
from voltrl.algorithms.local.loss import importance_weights, policy_loss
from voltrl.algorithms.local.schedule import WeightVersions, drop_stale, row_staleness
from voltrl.algorithms.local.update import PolicyTrainer, PolicyUpdateConfig
from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.store.sql import SQLStore
from voltrl.trajectory import TrajectoryConfig, build_trajectory, collate
from voltrl.types import LLMCall, Rollout, Task, Trajectory, Transition

# ---- the loss ---------------------------------------------------------------------------------


def loss_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (4, 7)
    return {
        "logprobs": (-torch.rand(shape, generator=g) * 3).requires_grad_(),
        "old": -torch.rand(shape, generator=g) * 3 - 0.01,  # every token known (non-zero)
        "adv": torch.randn(4, generator=g),
        "mask": (torch.rand(shape, generator=g) > 0.2).long(),
    }


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_decoupled_loss_whose_proximal_policy_sampled_the_tokens_is_todays_loss_exactly(
    agg: str, mode: str
):
    """With staleness 0 the proximal policy is the behaviour policy: the importance weight is
    exp(0) = 1 and the clip is taken against the same logprobs, so loss and gradient are the
    synchronous PPO-clip loss's, bit for bit."""
    x = loss_inputs()
    today, stats = policy_loss(x["logprobs"], x["old"], x["adv"], x["mask"], agg=agg)  # type: ignore[arg-type]
    (grad_today,) = torch.autograd.grad(today, x["logprobs"])
    prox = x["old"].clone()
    weights, truncated, masked = importance_weights(
        prox,
        x["old"],
        x["old"] != 0,
        x["mask"],
        mode,
        5.0,  # type: ignore[arg-type]
    )
    assert torch.equal(weights, x["mask"].float()) and not truncated.any() and not masked.any()
    decoupled, dstats = policy_loss(
        x["logprobs"],
        x["old"],
        x["adv"],
        x["mask"],
        agg=agg,
        prox_logprobs=prox,
        weights=weights,  # type: ignore[arg-type]
    )
    (grad_decoupled,) = torch.autograd.grad(decoupled, x["logprobs"])
    assert torch.equal(today, decoupled)
    assert torch.equal(grad_today, grad_decoupled)
    assert torch.equal(stats["clip_frac"], dstats["clip_frac"])


def test_decoupled_loss_clips_against_the_proximal_policy_and_weighs_by_the_capped_importance():
    """Per token: w * max(-A r, -A clip(r)), r = exp(logp - prox), w = min(exp(prox - old), cap)."""
    logp = torch.tensor([[-1.0, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -0.2, -2.0]])  # behaviour: sampled them
    prox = torch.tensor([[-1.2, -1.0, -0.5]])  # the weights before this update
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.long)
    weights, truncated, _ = importance_weights(prox, old, old != 0, mask, "tis", 2.0)
    loss, _ = policy_loss(
        logp, old, adv, mask, agg="seq-mean-token-sum", prox_logprobs=prox, weights=weights
    )
    ratio = torch.exp(logp.detach() - prox)
    weight = torch.exp(prox - old).clamp(max=2.0)
    expected = (weight * torch.maximum(-ratio, -ratio.clamp(0.8, 1.2))).sum()
    assert torch.allclose(loss, expected)
    assert weight[0, 2] == 2.0  # exp(1.5) capped
    assert truncated.tolist() == [[False, False, True]]


def test_the_loss_statistics_keep_one_meaning_and_name_the_proximal_ones_apart():
    """``approx_kl``, ``ratio_mean`` and ``clip_frac`` are against the sampling policy with or
    without a proximal one; the proximal policy's are ``prox_*``."""
    logp = torch.tensor([[-1.0, -1.0, -2.0]])
    old = torch.tensor([[-1.5, -0.2, -2.0]])
    prox = torch.tensor([[-1.2, -1.0, -0.5]])
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.long)
    _, plain = policy_loss(logp, old, adv, mask)
    _, decoupled = policy_loss(logp, old, adv, mask, prox_logprobs=prox)
    for name in ("approx_kl", "ratio_mean", "clip_frac"):
        assert torch.equal(plain[name], decoupled[name]), name
    assert float(decoupled["approx_kl"]) == pytest.approx(float((old - logp).mean()))
    assert float(decoupled["prox_approx_kl"]) == pytest.approx(float((prox - logp).mean()))
    assert float(decoupled["prox_ratio_mean"]) == pytest.approx(
        float(torch.exp(logp - prox).mean())
    )
    assert "prox_clip_frac" in decoupled and "prox_approx_kl" not in plain


@pytest.mark.parametrize("age", [0, None], ids=["sampled by these weights", "unknown age"])
def test_a_decoupled_update_of_rows_that_are_not_stale_is_the_synchronous_update_exactly(
    age: int | None,
) -> None:
    """Rows whose staleness is 0, and rows of unknown age (an explicit transition: they train
    as they always did, docs/async.md), use their sampling logprobs as the proximal policy
    (no forward pass): the update is the synchronous one, bit for bit, optimizer step
    included."""
    tok = build_tiny_tokenizer()
    batch = sampled_batch(build_tiny_model(tok, seed=0), tok)
    batch.staleness = [age] * len(batch)
    weights, metrics = {}, {}
    for mode in ("rollout", "decoupled"):
        trainer = PolicyTrainer(
            build_tiny_model(tok, seed=0), PolicyUpdateConfig(lr=1e-2, old_logprobs=mode)
        )
        metrics[mode] = trainer.step(batch)
        weights[mode] = trainer.model.state_dict()
    assert metrics["decoupled"]["proximal_rows"] == 0
    assert metrics["decoupled"]["behaviour_weight"] == 1.0
    assert all(torch.equal(w, weights["decoupled"][k]) for k, w in weights["rollout"].items())


def test_a_decoupled_update_on_fresh_samples_has_the_synchronous_gradient():
    """Rows marked stale are scored by the current weights for the proximal policy: on
    samples those weights produced, that equals the behaviour logprobs to float rounding, so
    both objectives give one gradient."""
    tok = build_tiny_tokenizer()
    batch = sampled_batch(build_tiny_model(tok, seed=0), tok)
    batch.staleness = [1] * len(batch)
    grads = {}
    for mode in ("rollout", "decoupled"):
        trainer = PolicyTrainer(
            build_tiny_model(tok, seed=0), PolicyUpdateConfig(old_logprobs=mode)
        )
        trainer.accumulate_gradients(batch)
        grads[mode] = {n: p.grad for n, p in trainer.model.named_parameters()}
    stepped = PolicyTrainer(build_tiny_model(tok, seed=0), PolicyUpdateConfig(old_logprobs=mode))
    assert stepped.step(batch)["behaviour_weight"] == pytest.approx(1.0, abs=1e-5)
    for name, grad in grads["rollout"].items():
        assert torch.allclose(grad, grads["decoupled"][name], rtol=1e-3, atol=1e-8), name


def test_max_staleness_picks_the_decoupled_objective_unless_the_update_names_one():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    assert vl.LocalRL(model, tokenizer=tok).update.old_logprobs == "rollout"
    assert (
        vl.LocalRL(model, tokenizer=tok, schedule={"max_staleness": 1}).update.old_logprobs
        == "decoupled"
    )
    named = vl.LocalRL(
        model, tokenizer=tok, schedule={"max_staleness": 2}, update={"old_logprobs": "rollout"}
    )
    assert named.update.old_logprobs == "rollout"
    with pytest.raises(
        ValueError, match=r"schedule\.max_staleness: Input should be greater than or equal to 0"
    ):
        vl.LocalRL(model, tokenizer=tok, schedule={"max_staleness": -1})


# ---- versions and staleness -------------------------------------------------------------------


def versioned_call(seq: int, prompt: list[int], response: list[int], version: int) -> LLMCall:
    return LLMCall(
        rollout_id="r",
        attempt_id="a",
        sequence_id=seq,
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=[-0.1 * version - 0.01 * k for k in range(len(response))],
        request={"messages": []},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": ""}}]},
        resources_version=version,
        started_at=float(seq),
        ended_at=float(seq) + 0.5,
    )


def test_a_row_whose_calls_span_an_update_keeps_each_calls_version_and_behaviour_logprobs():
    first = versioned_call(0, [1, 2], [3, 4], version=3)
    second = versioned_call(1, [1, 2, 3, 4, 9], [5, 6], version=5)  # after an update
    rollout = Rollout(
        rollout_id="r", task=Task(task_id="t", input={}), status="succeeded", reward=1.0,
        final_attempt_id="a",
    )  # fmt: skip
    (row,) = build_trajectory(
        rollout, [first, second], config=TrajectoryConfig(mode="trajectory")
    ).transitions
    assert row.metadata["resources_versions"] == [3, 5]
    # each generated token trains against the logprob of the call that sampled it
    assert row.response_logprobs == [*first.response_logprobs, 0.0, *second.response_logprobs]  # type: ignore[misc]
    weights_of = {3: 1, 4: 1, 5: 2}  # resources version -> weights version (3 and 4: same weights)
    assert row_staleness([3, 5], weights_of, current=2) == 1  # its oldest call's weights
    assert row_staleness([4], weights_of, current=2) == 1
    assert row_staleness([5], weights_of, current=2) == 0
    assert row_staleness([7], weights_of, current=2) is None  # not a version LocalRL published
    assert row_staleness([], weights_of, current=2) is None  # an explicit transition


def test_rollouts_staler_than_the_bound_are_dropped_whole_and_counted_and_rows_keep_their_age():
    def trajectory(rid: str, *versions: list[int]) -> Trajectory:
        rows = [
            Transition(
                prompt_token_ids=[1], response_token_ids=[2], metadata={"resources_versions": v}
            )
            for v in versions
        ]
        return Trajectory(rollout_id=rid, task_id="t", transitions=rows, reward=1.0)

    weights_of = {1: 0, 2: 1, 3: 2}
    batch = [
        trajectory("fresh", [3]),
        trajectory("one", [2], [3]),
        trajectory("two", [1, 3]),
        trajectory("unknown", [9]),  # a sampler not recorded: trained, its age unknown
    ]
    kept, metrics = drop_stale(batch, weights_of, current=2, max_staleness=1)
    assert [len(t.transitions) for t in kept] == [1, 2, 0, 1]
    assert kept[2].stats == {"dropped/stale": 1}
    assert metrics == {"staleness/mean": 1 / 3, "staleness/max": 1.0, "dropped/stale": 1.0}
    collated = collate(kept)
    assert collated.stats["dropped/stale"] == 1
    assert collated.staleness == [0, 1, 0, None]  # per row, for the update


# ---- end to end -------------------------------------------------------------------------------


async def read_store(path: Path) -> tuple[list[Rollout], dict[str, list[LLMCall]], dict]:
    store = SQLStore(path)
    try:
        rollouts = await store.query_rollouts()
        calls = {r.rollout_id: await store.get_llm_calls(r.rollout_id) for r in rollouts}
        latest = (await store.get_resources()).version  # type: ignore[union-attr]
        weights = {
            v: (await store.get_resources(v)).items["main_llm"].weights_version  # type: ignore[union-attr]
            for v in range(1, latest + 1)
        }
        return rollouts, calls, weights
    finally:
        await store.close()


def recomputed_logprobs(model: Any, call: LLMCall) -> torch.Tensor:
    prompt, response = call.prompt_token_ids or [], call.response_token_ids or []
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    picked = logits[len(prompt) - 1 : -1].log_softmax(-1)
    return picked.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.slow
def test_rollouts_queued_ahead_span_updates_and_every_call_was_sampled_by_its_versions_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """``max_staleness=1``: step t+1's rollouts run during step t's update. Every call's
    recorded logprobs are those of the weights its resources version names (a checkpoint per
    step), so no request was decoded across a weight swap; rows span updates; each step
    trains its own rollouts, at most one update stale."""
    notes = tmp_path / "notes"
    notes.mkdir()
    update, publish = PolicyTrainer.step, WeightVersions.publish
    updates = iter(range(1, 4))

    def held_update(self: PolicyTrainer, batch: Any) -> dict:
        """Update ``k`` starts once step ``k + 1``'s rollouts have all made their first call
        (on the weights before it); the last has no step after it."""
        k = next(updates)
        while k < 3 and not (notes / f"call-{STEP * (k + 1) - 1}").exists():
            time.sleep(0.02)
        return update(self, batch)

    async def noted_publish(self: WeightVersions, ctx: Any, llm: vl.LLM) -> int:
        """Publish, then leave a note that weights ``self.current`` are served."""
        version = await publish(self, ctx, llm)
        (notes / f"weights-{self.current}").touch()
        return version

    monkeypatch.setattr(PolicyTrainer, "step", held_update)
    monkeypatch.setattr(WeightVersions, "publish", noted_publish)
    tok = build_tiny_tokenizer()
    algo = vl.LocalRL(
        build_tiny_model(tok, seed=0),
        tokenizer=tok,
        schedule={"steps": 3, "tasks_per_step": 2, "group_size": 2, "max_staleness": 1},
        checkpoints={"every": 1},
        sampling={"temperature": 1.0, "max_tokens": 6},
        update={"lr": 1e-2, "micro_batch_size": 4},
        trajectory={"mode": "trajectory"},
    )
    trainer = vl.Trainer(algo, n_runners=1, max_concurrency=4, run_dir=tmp_path, name="async")
    result = trainer.fit(thinks_between_calls, [{"letter": c, "notes": str(notes)} for c in "abcd"])
    steps = [m for m in result.metrics if "update/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [m["staleness/max"] for m in steps] == [0.0, 1.0, 1.0]
    assert all(m["dropped/stale"] == 0 and "update/behaviour_weight" in m for m in steps)
    assert [m["weights_version"] for m in steps] == [0, 1, 2]  # the weights each step trained
    # only rows sampled by older weights were scored for the proximal policy
    assert steps[0]["update/proximal_rows"] == 0 and steps[1]["update/proximal_rows"] > 0
    assert {"update/prox_approx_kl", "update/approx_kl"} <= steps[1].keys()  # both meanings

    rollouts, calls, weights = asyncio.run(read_store(tmp_path / "async" / "store.sqlite"))
    train = [r for r in rollouts if r.mode == "train"]
    # each step's rollouts under a version of their own: the step's batch, trained once
    batch_versions = [m["resources_version"] for m in steps]
    assert len(set(batch_versions)) == 3
    assert sorted(r.resources_version for r in train) == sorted(batch_versions * 4)
    # every call was sampled by the weights of the version it recorded
    policies = [build_tiny_model(tok, seed=0)]
    for step in (1, 2, 3):
        model = build_tiny_model(tok, seed=0)
        ckpt = tmp_path / "async" / "checkpoints" / f"step_{step:08d}" / "model.pt"
        model.load_state_dict(torch.load(ckpt, weights_only=True))
        policies.append(model)
    spanned = 0
    for r in train:
        versions = [weights[c.resources_version] for c in calls[r.rollout_id]]  # type: ignore[index]
        spanned += len(set(versions)) > 1
        for c, v in zip(calls[r.rollout_id], versions, strict=True):
            recorded = torch.tensor(c.response_logprobs)
            assert torch.allclose(recorded, recomputed_logprobs(policies[v], c), atol=1e-4)
    assert spanned == 8  # steps 2 and 3: begun during the update before, ended after it

    # the dashboard's step page says which weights sampled the step's rows
    last = next(r for r in train if r.resources_version == batch_versions[-1])
    with (
        serve_in_thread(dashboard_app(Catalog([tmp_path]))) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        rows = client.get(f"/rollouts/{last.rollout_id}/rows").text
    assert "rows sampled by weights version 1 (" in rows, rows
    # a second call is sampled by weights 2: in its first call's row, or in one of its own
    assert "sampled by weights 1 → 2" in rows or "sampled by weights 2<" in rows, rows

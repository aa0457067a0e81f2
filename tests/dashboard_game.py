"""A werewolf-sized run for the dashboard's rollout page: two train games of one task and a
validation game, each of ``rounds`` rounds of ``calls_per_round`` calls whose prompts re-render
the whole game so far into one user message (as AgentScope's formatter does) and hold
``prompt_tokens`` token ids, with the sample's spans (an ``invoke_agent`` and a ``chat`` span
per call, carrying the input messages), its per-call penalties, each side's outcome for its
players' calls and its ``game`` event. Written through the store's own API, with the tiny
tokenizer saved where LocalRL saves it, so token views decode.

The default sizes are those of a 4-round game of the werewolf sample with LocalRL's tiny
model (about 200 calls a round) and a real model's prompt lengths (2-3k tokens)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path

from voltrl.models.tiny import build_tiny_tokenizer
from voltrl.store.sql import SQLStore
from voltrl.types import AttemptResult, LLMCall, Reward, Run, Span, Task

RUN_NAME = "game"
SIDES = {"village": ["seer", "witch", "hunter", "villager"], "wolves": ["werewolf"]}
SYSTEM = (
    "You play Werewolf with 9 players: 3 werewolves, 3 villagers, a seer, a witch and a hunter. "
    "At night the werewolves kill one player; the seer learns whether one player is a werewolf; "
    "the witch can save the victim once and poison one player once. By day everyone speaks, "
    "then votes to eliminate one player. Speak in one or two short sentences.\n"
)


@dataclass
class Game:
    """What :func:`make_game_run` wrote: the run directory and the rollouts' ids."""

    run_dir: Path
    train: list[str]
    val: str
    calls: int


def _seat(i: int) -> tuple[str, str, str]:
    """Player ``i``'s name, side and role."""
    side = "wolves" if i in (2, 5, 8) else "village"
    role = "werewolf" if side == "wolves" else ["seer", "witch", "hunter", "villager"][i % 4]
    return f"Player{i + 1}", side, role


def _game(
    rollout_id: str,
    attempt_id: str,
    *,
    rounds: int,
    calls_per_round: int,
    prompt_tokens: int,
    winner: str,
    tokenizer: object,
    seed: int,
) -> tuple[list[LLMCall], list[Span], list[Reward]]:
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size  # type: ignore[attr-defined]
    history: list[str] = []
    calls, spans, rewards = [], [], []
    t = 1_800_000_000.0 + seed
    for k in range(rounds * calls_per_round):
        name, side, role = _seat(k % 9)
        phase = f"{'Night' if (k // 20) % 2 == 0 else 'Day'} {k // calls_per_round + 1}"
        said = f"{name}: I think Player{rng.randint(1, 9)} is a werewolf; they voted oddly."
        text = "<history>\n" + "\n".join(history)[-6000:] + f"\n</history>\n{phase}: your turn."
        messages = [
            {"role": "system", "content": SYSTEM + f"You are {name}; your role is {role}."},
            {"role": "user", "content": text},
        ]
        agent = f"policy/{side}/{role}/{name}"
        response_ids = [rng.randrange(vocab) for _ in range(24)]
        call = LLMCall(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=k,
            agent_name=agent,
            request={"model": "voltrl-local", "messages": messages},
            response={"choices": [{"index": 0, "message": {"role": "assistant", "content": said}}]},
            prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_tokens)],
            response_token_ids=response_ids,
            response_logprobs=[-rng.random() * 3 for _ in response_ids],
            finish_reason="stop",
            model="voltrl-local",
            resources_version=1,
            started_at=t + k,
            ended_at=t + k + 0.4,
        )
        calls.append(call)
        invoke = Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            name=f"invoke_agent {name}",
            start_time=t + k,
            end_time=t + k + 0.5,
            attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": name},
            status="ok",
        )
        chat = Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            parent_id=invoke.span_id,
            name="chat voltrl-local",
            start_time=t + k + 0.01,
            end_time=t + k + 0.4,
            attributes={"gen_ai.operation.name": "chat", "gen_ai.input.messages": str(messages)},
            status="ok",
        )
        spans += [invoke, chat]
        if rng.random() < 0.1:
            rewards.append(
                Reward(
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                    value=-0.2,
                    name="invalid_output",
                    timestamp=t + k + 0.45,
                )
            )
        history.append(said)
    end = t + rounds * calls_per_round + 1
    for side in SIDES:
        value = 1.0 if side == winner else 0.0
        meta = {"agents": rf"[^/]+/{side}/.*"}
        rewards.append(
            Reward(
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                value=value,
                name=f"outcome/{side}",
                metadata=meta,
                timestamp=end,
            )
        )
    game = {"winner": winner, "rounds": rounds, "decisions": rounds * 30, "invalid_outputs": 3}
    spans.append(
        Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            name="game",
            start_time=end,
            end_time=end,
            attributes={**game, "roles": {_seat(i)[0]: _seat(i)[2] for i in range(9)}},
            status="ok",
        )
    )
    return calls, spans, rewards


async def _write(
    run_dir: Path, rounds: int, calls_per_round: int, prompt_tokens: int
) -> tuple[list[str], str]:
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(run_dir / "tokenizer")
    store = SQLStore(run_dir / "store.sqlite")
    try:
        config = {
            "trajectory": {"mode": "transition", "max_transitions_per_rollout": 64},
            "update": {},
        }
        run = await store.add_run(
            Run(name=RUN_NAME, kind="fit", algorithm="local_rl", status="finished", config=config)
        )
        task = Task(task_id="game-0", input={"seed": 0, "train": "village", "max_rounds": rounds})
        queued = await store.enqueue([task, task], run_id=run.run_id, resources_version=1)
        val_task = Task(task_id="val-0", input={"seed": 7, "train": "village"})
        queued += await store.enqueue(
            [val_task], run_id=run.run_id, mode="val", resources_version=1
        )
        for i, winner in enumerate(["village", "wolves", "village"]):
            claim = await store.claim("worker-0", lease_s=600)
            assert claim is not None
            rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
            calls, spans, rewards = _game(
                rid,
                aid,
                rounds=rounds,
                calls_per_round=calls_per_round,
                prompt_tokens=prompt_tokens,
                winner=winner,
                tokenizer=tokenizer,
                seed=i,
            )
            for start in range(0, len(calls), 100):
                await store.add_llm_calls(calls[start : start + 100])
            reward = 1.0 if winner == "village" else 0.0
            await store.complete(
                aid, AttemptResult(status="succeeded", reward=reward, spans=spans, rewards=rewards)
            )
        return [r.rollout_id for r in queued[:2]], queued[2].rollout_id
    finally:
        await store.close()


def make_game_run(
    root: Path, *, rounds: int = 4, calls_per_round: int = 200, prompt_tokens: int = 2500
) -> Game:
    """Write the run into ``root / RUN_NAME`` (see the module docstring)."""
    run_dir = root / RUN_NAME
    run_dir.mkdir(parents=True, exist_ok=True)
    train, val = asyncio.run(_write(run_dir, rounds, calls_per_round, prompt_tokens))
    return Game(run_dir, train, val, rounds * calls_per_round)

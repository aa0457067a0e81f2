"""APO's optimizer LLM: every call goes through a gateway of the run, recorded in a rollout of
mode ``optimizer`` that APO holds itself (``Store.start_rollout``), under the agent name
``apo-optimizer``; such rollouts are never queued for runners and never trained on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from voltrl.errors import VoltRLError
from voltrl.resources import LLM
from voltrl.store.base import Store
from voltrl.types import AttemptResult, Claim, Task

AGENT_NAME = "apo-optimizer"


class OptimizerError(VoltRLError):
    """The optimizer LLM failed a call after the gateway's retries."""


@dataclass
class Optimizer:
    """Calls the optimizer LLM behind the run's gateway at ``url`` (``http://host:port/v1``)."""

    store: Store
    run_id: str
    url: str
    model: str
    token: str | None = field(repr=False)
    sampling: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0

    async def start(self, task: Task, version: int | None) -> Claim:
        """A rollout to record the calls of one expansion in (a critique, then rewrites at
        once). APO ends it itself; its lease outlasts two calls' timeouts, so that one it
        abandons (the process died) fails in the end, and the trainer cancels those left
        running when a run stops."""
        return await self.store.start_rollout(
            task,
            worker_id=AGENT_NAME,
            mode="optimizer",
            run_id=self.run_id,
            resources_version=version,
            lease_s=2 * self.timeout_s + 300.0,
        )

    async def finish(self, claim: Claim, error: str | None = None) -> None:
        """End the rollout: succeeded, or failed with ``error``."""
        status = "failed" if error else "succeeded"
        await self.store.complete(
            claim.attempt.attempt_id, AttemptResult(status=status, error=error)
        )

    async def ask(self, claim: Claim, prompt: str) -> str:
        """The optimizer's answer to ``prompt`` (one user message), recorded in ``claim``'s
        rollout. Raises :class:`OptimizerError` with the gateway's message when it fails."""
        import aiohttp  # here: `import voltrl` (every runner and command) does without it

        llm = LLM(endpoint=self.url, model=self.model, gateway=True)
        endpoint = llm.scoped(claim.rollout.rollout_id, claim.attempt.attempt_id, AGENT_NAME)
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}]}
        body |= self.sampling
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(
                    f"{endpoint.endpoint}/chat/completions", json=body, headers=headers
                ) as resp,
            ):
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise OptimizerError(f"the optimizer LLM did not answer: {exc!r}") from None
        if resp.status != 200 or not isinstance(answer, dict):
            error = answer.get("error") if isinstance(answer, dict) else None
            message = error.get("message") if isinstance(error, dict) else str(answer)[:300]
            raise OptimizerError(f"the optimizer LLM answered {resp.status}: {message}")
        try:
            return str(answer["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            raise OptimizerError(f"the optimizer LLM's answer has no message: {answer}") from None

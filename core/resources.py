"""Resources: what an algorithm publishes and a rollout runs with (LLMs, prompt templates).

A :class:`Resources` is a named set with a version number the store assigns; every rollout
records the version it ran with, so stale (off-policy) data is always identifiable.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import Field, PrivateAttr

from voltrl.errors import UnknownResourceError
from voltrl.types import Model, now


class LLM(Model):
    """An OpenAI-compatible model endpoint.

    ``endpoint`` is a base URL as the OpenAI client takes it (``http://host:port/v1``). When
    ``gateway`` is true the endpoint is a VoltRL gateway, and :meth:`scoped` rewrites it so the
    calls of one rollout attempt are recorded against it; the agent's client needs no change.
    """

    kind: Literal["llm"] = "llm"
    endpoint: str
    model: str
    api_key: str = "EMPTY"
    sampling_parameters: dict[str, Any] = Field(default_factory=dict)
    gateway: bool = False

    def scoped(self, rollout_id: str, attempt_id: str, agent_name: str | None = None) -> LLM:
        """This LLM with an endpoint that records calls against one rollout attempt."""
        if not self.gateway:
            return self
        base = self.endpoint.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        path = f"/rollouts/{quote(rollout_id, safe='')}/attempts/{quote(attempt_id, safe='')}"
        if agent_name:
            path += f"/agents/{quote(agent_name, safe='')}"
        return self.model_copy(update={"endpoint": f"{base}{path}/v1"})

    def for_agent(self, agent_name: str) -> LLM:
        """The same rollout-scoped LLM, with calls attributed to ``agent_name``."""
        if not self.gateway or "/rollouts/" not in self.endpoint:
            return self
        base = self.endpoint.rstrip("/")
        base = base[: -len("/v1")] if base.endswith("/v1") else base
        if "/agents/" in base:
            base = base[: base.rindex("/agents/")]
        return self.model_copy(
            update={"endpoint": f"{base}/agents/{quote(agent_name, safe='')}/v1"}
        )


class PromptTemplate(Model):
    """A prompt with ``{placeholders}`` (``engine='f-string'``) or Jinja2 syntax."""

    kind: Literal["prompt_template"] = "prompt_template"
    template: str
    engine: Literal["f-string", "jinja"] = "f-string"

    def format(self, **values: Any) -> str:
        """Fill the template."""
        if self.engine == "jinja":
            import jinja2

            return jinja2.Template(self.template).render(**values)
        return self.template.format(**values)


Resource = Annotated[LLM | PromptTemplate, Field(discriminator="kind")]


class Resources(Model):
    """A versioned, named set of resources. ``version`` is assigned by the store (0 = unsaved)."""

    items: dict[str, Resource]
    version: int = 0
    created_at: float = Field(default_factory=now)
    _rollout_id: str | None = PrivateAttr(default=None)

    def __getitem__(self, name: str) -> LLM | PromptTemplate:
        try:
            return self.items[name]
        except KeyError:
            where = f"rollout {self._rollout_id}: " if self._rollout_id else ""
            raise UnknownResourceError(
                f"{where}unknown resource {name!r}; resources version {self.version} has "
                f"{sorted(self.items) or 'none'}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self.items

    def of_kind(self, cls: type[LLM] | type[PromptTemplate]) -> dict[str, Any]:
        """The resources of one type, by name."""
        return {k: v for k, v in self.items.items() if isinstance(v, cls)}

    def scoped(self, rollout_id: str, attempt_id: str) -> Resources:
        """A copy whose LLMs record their calls against this rollout attempt."""
        items = {
            k: v.scoped(rollout_id, attempt_id) if isinstance(v, LLM) else v
            for k, v in self.items.items()
        }
        scoped = self.model_copy(update={"items": items})
        scoped._rollout_id = rollout_id
        return scoped

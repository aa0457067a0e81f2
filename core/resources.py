"""Resources: what an algorithm publishes and a rollout runs with (LLMs, prompt templates).

A :class:`Resources` is a named set with a version number the store assigns; every rollout
records the version it ran with, so stale (off-policy) data is always identifiable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import quote

from pydantic import Field, PrivateAttr

from voltrl._redact import shown
from voltrl.errors import UnknownResourceError, VoltRLError
from voltrl.types import Model, now

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI


class LLM(Model):
    """An OpenAI-compatible model endpoint.

    ``endpoint`` is a base URL as the OpenAI client takes it (``http://host:port/v1``). When
    ``gateway`` is true the endpoint is a VoltRL gateway, and :meth:`scoped` rewrites it so the
    calls of one rollout attempt are recorded against it; the agent's client needs no change.

    ``api_key`` is a secret: it is never serialized (not into the store, not over HTTP, not in
    a repr). The agent's copy is filled in by the runner (:meth:`Resources.with_keys`): the
    run's token for a gateway endpoint, else the key the trainer handed its workers in memory,
    else the environment variable named by ``api_key_env`` (how a remote ``voltrl runner``
    gets a provider key).
    """

    kind: Literal["llm"] = "llm"
    endpoint: str
    model: str
    api_key: str = Field("EMPTY", exclude=True, repr=False)
    api_key_env: str | None = None
    sampling_parameters: dict[str, Any] = Field(default_factory=dict)
    gateway: bool = False
    reasoning_split: bool = False
    """Have the trainer's gateway in front of this endpoint hand agents the ``<think>...``
    the model writes into its content as ``reasoning_content`` (:mod:`voltrl.gateway.reasoning`);
    the recorded calls keep the response as sampled."""
    lora_adapters: dict[str, int] = Field(default_factory=dict)
    """The LoRA adapters the endpoint serves per agent role (LocalRL's ``lora_adapters=``), each
    with its weights version (updates so far): a call's recorded ``model`` names the adapter
    that sampled it, and its resources version says which version of it that was."""
    weights_version: int | None = None
    """The version of the weights the endpoint serves (LocalRL: the updates loaded into its
    engine; None for a model VoltRL does not train): a call's resources version says which
    weights sampled it, and so how stale it is when a later version trains on it."""

    def __repr_args__(self) -> Any:
        """The fields as ``repr`` shows them: a URL's password, secret query parameters and
        secret-named headers (in ``sampling_parameters``' ``extra_headers``) as ``***``."""
        for name, value in super().__repr_args__():
            yield name, shown(value)

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

    def openai_client(
        self, agent_name: str | None = None, *, timeout: float = 600.0, max_retries: int = 2
    ) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client for this LLM, cheap to get in every rollout.

        It has this LLM's endpoint (the rollout's, inside a rollout; with ``agent_name``, its
        calls are recorded under that agent) and API key, and sends through connections shared
        with the other clients used on the same event loop: getting one costs microseconds,
        where building an ``AsyncOpenAI`` reads the CA certificates (tens of milliseconds on
        the loop every rollout shares). It works on any loop; ``close()`` closes this client
        only. Each request also carries the current rollout's headers, so a client made once
        and shared by concurrent rollouts records each call against its own rollout
        (:mod:`voltrl.openai_clients`). Needs the ``openai`` package."""
        return _clients().async_openai(self, agent_name, timeout=timeout, max_retries=max_retries)

    def sync_openai_client(
        self, agent_name: str | None = None, *, timeout: float = 600.0, max_retries: int = 2
    ) -> OpenAI:
        """The ``openai.OpenAI`` form of :meth:`openai_client` (one pool per process)."""
        return _clients().sync_openai(self, agent_name, timeout=timeout, max_retries=max_retries)


def _clients() -> Any:
    """:mod:`voltrl.openai_clients`, imported on first use: ``openai`` is optional."""
    try:
        import httpx2  # noqa: F401
        import openai  # noqa: F401
    except ImportError:
        raise VoltRLError(
            "LLM.openai_client() needs the openai package (3.x, on httpx2), which voltrl "
            "does not install: pip install 'openai>=3'"
        ) from None
    import voltrl.openai_clients

    return voltrl.openai_clients


class PromptTemplate(Model):
    """A prompt with ``{placeholders}`` (``engine='f-string'``) or Jinja2 syntax
    (``engine='jinja'``; jinja2 is a dependency of voltrl, since any runner may render it)."""

    kind: Literal["prompt_template"] = "prompt_template"
    template: str
    engine: Literal["f-string", "jinja"] = "f-string"

    def format(self, **values: Any) -> str:
        """Fill the template. A jinja template renders in jinja2's sandbox
        (``jinja2.sandbox.SandboxedEnvironment``): one that reaches for Python internals
        (``__class__``, ``__mro__``, ``__subclasses__``, ``__globals__``...) raises
        :class:`~voltrl.errors.PromptTemplateError` instead of rendering."""
        if self.engine == "jinja":
            return _render_jinja(self.template, values)
        return self.template.format(**values)


def _render_jinja(template: str, values: dict[str, Any]) -> str:
    """``template`` rendered in the sandbox, every unsafe attribute access an error."""
    from voltrl.errors import PromptTemplateError

    try:
        from jinja2.exceptions import SecurityError
        from jinja2.sandbox import SandboxedEnvironment
    except ImportError:
        raise PromptTemplateError(
            "PromptTemplate(engine='jinja') needs jinja2, a dependency of voltrl missing from "
            "this environment: pip install 'jinja2>=3.1'"
        ) from None

    class Sandbox(SandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            # jinja2 returns an undefined here, which renders `{{ x.__class__ }}` as ""
            raise SecurityError(f"{type(obj).__name__}.{attribute}")

    try:
        return Sandbox().from_string(template).render(**values)
    except SecurityError as exc:
        raise PromptTemplateError(
            f"the jinja template reaches for Python internals ({exc}), which the sandbox refuses"
        ) from None


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

    def with_keys(self, keys: ApiKeys) -> Resources:
        """A copy whose LLMs carry their API keys again (see :class:`ApiKeys`)."""
        items = {k: keys.fill(k, v) if isinstance(v, LLM) else v for k, v in self.items.items()}
        filled = self.model_copy(update={"items": items})
        filled._rollout_id = self._rollout_id
        return filled


@dataclass(frozen=True)
class ApiKeys:
    """The secrets a runner puts back into the resources it reads from the store, which never
    holds them: ``gateway`` (the run's token, the key of every gateway endpoint) and ``llms``
    (provider keys of LLMs that are not behind a gateway, by resource name; handed to local
    workers in memory)."""

    gateway: str | None = None
    llms: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"ApiKeys(gateway={'***' if self.gateway else None}, llms={sorted(self.llms)})"

    def fill(self, name: str, llm: LLM) -> LLM:
        """``llm`` (the resource ``name``) with its key: see :class:`LLM`."""
        if llm.gateway:
            key = self.gateway or "EMPTY"
        elif name in self.llms:
            key = self.llms[name]
        elif llm.api_key_env:
            if (key := os.environ.get(llm.api_key_env)) is None:  # type: ignore[assignment]
                raise VoltRLError(
                    f"LLM {name!r} reads its API key from ${llm.api_key_env}, which is not set "
                    "on this runner"
                )
        else:
            return llm
        return llm.model_copy(update={"api_key": key})


def llm_keys(resources: Resources | Mapping[str, Any]) -> dict[str, str]:
    """The provider keys of the LLMs in ``resources`` that are not behind a gateway (what
    :class:`ApiKeys` hands local workers), by resource name."""
    items = resources.items if isinstance(resources, Resources) else resources
    return {
        name: item.api_key
        for name, item in items.items()
        if isinstance(item, LLM) and not item.gateway and item.api_key != "EMPTY"
    }

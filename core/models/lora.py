"""Per-role LoRA adapters: which adapter serves, and trains on, each agent's calls.

``LocalRL(lora_adapters={"writer": "write|rewrite", "checker": "check"})`` gives every adapter
name a regex; a call goes to the first adapter (in the order given) whose regex fully matches
its recorded agent name (``""`` when it has none). A call no pattern matches is served by the
base model and not trained; end with ``".*"`` to send the rest to a catch-all adapter.

The gateway forwards each call with its adapter's name as the model (vLLM's multi-LoRA
convention), so the call's recorded ``model`` says which adapter sampled it, and the engine
generates it with that adapter. A training row trains the adapter that sampled it
(``TrainingBatch.models``); rows with no recorded model (explicit transitions) go by their
agent name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from voltrl.trajectory import TrainingBatch

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class LoraAdapters:
    """Adapter names and the agent-name regexes routed to them, in match order."""

    patterns: dict[str, re.Pattern[str]]

    @classmethod
    def parse(cls, mapping: Mapping[str, str], *, served_name: str) -> LoraAdapters:
        """Check ``{name: regex}``: names are identifiers peft can use as module keys
        (letters, digits, ``_``, ``-``), distinct ignoring case (they name folders), not
        ``served_name``, not peft's own ``default`` and not a piece of ``lora_`` (peft warns
        that such an adapter may be reinitialised when loaded); every regex compiles and is
        not empty. Raises ``ValueError``."""
        if not isinstance(mapping, Mapping) or not mapping:
            raise ValueError(
                "lora_adapters must map adapter names to agent-name regexes, e.g. "
                '{"writer": "write|rewrite", "checker": "check"}'
            )
        patterns: dict[str, re.Pattern[str]] = {}
        seen: dict[str, str] = {}
        for name, pattern in mapping.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(
                    f"adapter name {name!r}: use letters, digits, '_' or '-', starting with a "
                    "letter"
                )
            if name == "default":
                raise ValueError("adapter name 'default' is peft's own: pick another")
            if name in "lora_":
                raise ValueError(
                    f"adapter name {name!r} is a piece of peft's prefix 'lora_' (peft may "
                    "reinitialise such an adapter when it loads it): pick a longer name"
                )
            if name == served_name:
                raise ValueError(
                    f"adapter name {name!r} is the served model's name (served_name="
                    f"{served_name!r}): pick another"
                )
            if name.lower() in seen:
                raise ValueError(
                    f"adapter names {seen[name.lower()]!r} and {name!r} differ only by case "
                    "(they name folders)"
                )
            seen[name.lower()] = name
            if not isinstance(pattern, str):
                raise ValueError(f"adapter {name!r}: the agent-name pattern must be a string")
            if not pattern:
                raise ValueError(
                    f'adapter {name!r}: the agent-name pattern is empty ("^$" matches calls '
                    "with no agent name)"
                )
            try:
                patterns[name] = re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"adapter {name!r}: {pattern!r} is not a valid regex: {e}"
                ) from None
        return cls(patterns)

    @property
    def names(self) -> list[str]:
        """The adapter names, in match order."""
        return list(self.patterns)

    def adapter_for(self, agent_name: str | None) -> str | None:
        """The adapter serving ``agent_name``'s calls, or None (the base model)."""
        for name, pattern in self.patterns.items():
            if pattern.fullmatch(agent_name or ""):
                return name
        return None

    def rows_by_adapter(self, batch: TrainingBatch) -> dict[str | None, list[int]]:
        """The batch's row indices per adapter they train (None: served by the base model,
        not trained): the adapter that sampled the row, from its recorded model, else the
        one its agent name routes to."""
        out: dict[str | None, list[int]] = {}
        models = batch.models or [None] * len(batch)  # a batch built by hand may have none
        for i, (model, agent) in enumerate(zip(models, batch.agent_names, strict=True)):
            adapter = model if model in self.patterns else None
            if model is None:
                adapter = self.adapter_for(agent)
            out.setdefault(adapter, []).append(i)
        return out

    def split(self, batch: TrainingBatch) -> tuple[dict[str | None, TrainingBatch], list[int]]:
        """The batch per adapter it trains (its rows only, adapters in match order) and the
        rows no adapter trains (served by the base model)."""
        rows = self.rows_by_adapter(batch)
        untrained = rows.pop(None, [])
        parts = {name: batch.select(rows[name]) for name in self.names if name in rows}
        return parts, untrained

    def config(self) -> dict[str, str]:
        """``{name: regex}`` as given."""
        return {name: p.pattern for name, p in self.patterns.items()}


def trainer_parts(
    adapters: LoraAdapters | None, batch: TrainingBatch
) -> tuple[dict[str | None, TrainingBatch], list[int]]:
    """The batch per trainer: whole (under ``None``) without adapters, else each adapter's
    rows (:meth:`LoraAdapters.split`); and the rows no adapter trains."""
    if adapters is None:
        return ({None: batch} if len(batch) else {}), []
    return adapters.split(batch)


def adapter_of(parameter_name: str) -> str | None:
    """The LoRA adapter a peft parameter belongs to (``...q_proj.lora_A.writer.weight`` ->
    ``writer``), or None for a base weight."""
    parts = parameter_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return None


def adapter_key(parameter_name: str) -> str:
    """A peft parameter's name without its adapter's, as ``get_peft_model_state_dict``
    keys it (``...lora_A.writer.weight`` -> ``...lora_A.weight``)."""
    parts = parameter_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return ".".join(parts[: i + 1] + parts[i + 2 :])
    return parameter_name

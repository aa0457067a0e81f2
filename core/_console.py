"""Console sanitising: what came from agents, models or users reaches the terminal as text.

A store's records (errors, run names, task inputs, model replies, rewards' metadata) are data,
not terminal commands nor rich markup: an ``ESC`` sequence would move the cursor or retitle the
terminal, and ``[/INST]`` in a run name makes rich raise ``MarkupError``. Every console writer
(the trainer's summary and failure report, ``voltrl runs``, ``voltrl show``, the CLI's error
lines) passes such values through :func:`printable` (plain strings) or :func:`text` (rich).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pydantic import BaseModel
from rich.text import Text

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(value: Any) -> Any:
    """``value`` (a string, a record, a view and their fields) with every terminal control
    character in its text written as an escape (``\\x1b``); newlines and tabs stay."""
    if isinstance(value, str):
        return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value)
    if isinstance(value, list | tuple):
        return type(value)(printable(v) for v in value)
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, BaseModel):
        return value.model_copy(update={k: printable(v) for k, v in value.__dict__.items()})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: printable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    return value


def text(value: object, style: str = "") -> Text:
    """A rich :class:`~rich.text.Text` showing ``value`` as it is: its control characters
    escaped and its brackets never read as markup."""
    return Text(printable(str(value)), style=style)

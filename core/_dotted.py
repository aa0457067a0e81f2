"""Settings named by a dotted path in nested dicts (``schedule.steps`` in an algorithm's
config): the one walk that recording, upgrading and comparing configs share."""

from __future__ import annotations

from typing import Any


def section(config: dict[str, Any], dotted: str, *, create: bool = False) -> tuple[Any, str]:
    """The dict that holds ``dotted``'s last part, and that part: ``(config["a"]["b"], "c")``
    for ``a.b.c``. A missing or non-dict level gives ``None``, or with ``create`` a new dict."""
    *parents, name = dotted.split(".")
    found: Any = config
    for parent in parents:
        if not isinstance(found, dict):
            return None, name
        found = found.setdefault(parent, {}) if create else found.get(parent)
    return (found if isinstance(found, dict) else None), name

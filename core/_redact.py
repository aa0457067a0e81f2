"""Secret redaction: the one place that decides what of a URL, a message or a config is secret.

Everything VoltRL writes or shows outside the process goes through it: the store (a run's
config), ``train.yaml``, the trackers (W&B/MLflow config), the dashboard's pages, ``voltrl
show`` and ``voltrl runs``, console messages and ``repr``\\ s. Two kinds of secret exist here:

- a password in a URL's user info (``postgresql://alice:s3cret@host/db``), anywhere in a
  string: :func:`redact` replaces it by ``***`` for people to read; :func:`without_secrets`
  leaves it out of a config (``alice@host``), so that ``voltrl train`` of the written
  ``train.yaml`` still runs with the password the database client takes from its environment
  (``PGPASSWORD``, ``~/.pgpass``);
- the value of a field named for a secret (``api_key``, ``token``, ``password``, ``secret``,
  ``authorization`` and names ending in them): dropped from configs, ``***`` in messages.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MASK = "***"

# scheme://user:password@ — the password is what stands between the first ':' after the
# scheme and the last '@' before the host (a password may itself hold '@' or ':').
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s/:@]*:)(?P<pw>[^\s/]*)@")
_SECRET_KEY = re.compile(r"(?i)(^|[_\-.])(api_?key|token|password|passwd|secret|authorization)$")


def is_secret_key(key: str) -> bool:
    """Whether a config or header field of this name holds a secret (``api_key``,
    ``backend_api_key``, ``token``, ``write_token``, ``password``, ``Authorization``, …)."""
    return bool(_SECRET_KEY.search(key))


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``: for messages,
    ``repr`` and pages (``postgresql://alice:***@host/db``)."""
    if "://" not in text:
        return text
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@" if m["pw"] else m[0], text)


def scrub(text: str, *secrets: str | None) -> str:
    """``text`` (a driver's error message, say) with each of ``secrets`` replaced by ``***``
    and URL passwords redacted."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return redact(text)


def _drop_url_passwords(text: str) -> str:
    if "://" not in text:
        return text
    return _URL_PASSWORD.sub(lambda m: f"{m['head'][:-1]}@", text)


def without_secrets(value: Any) -> Any:
    """A copy of a config (mappings, lists, strings, numbers) fit to store, write to a file or
    send to a tracker: fields named for a secret are left out and URLs lose their passwords
    (``alice@host``: the rest still names the same database)."""
    if isinstance(value, str):
        return _drop_url_passwords(value)
    if isinstance(value, Mapping):
        return {
            k: without_secrets(v)
            for k, v in value.items()
            if not (isinstance(k, str) and is_secret_key(k) and v)
        }
    if isinstance(value, list | tuple):
        return [without_secrets(v) for v in value]
    return value


def shown(value: Any) -> Any:
    """A copy of a config for people to read (pages, the terminal): like
    :func:`without_secrets`, but a secret field shows as ``***`` and a URL's password as
    ``***``, so the reader sees that one was set."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {
            k: MASK if isinstance(k, str) and is_secret_key(k) and v else shown(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [shown(v) for v in value]
    return value

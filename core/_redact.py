"""Secret redaction: the one place that decides what of a URL, a message or a config is secret.

Everything VoltRL writes or shows outside the process goes through it: the store (a run's
config), ``train.yaml``, the trackers (W&B/MLflow config), the dashboard's pages, ``voltrl
show`` and ``voltrl runs``, console messages and ``repr``\\ s. Two kinds of secret exist here:

- a password in a URL's user info (``postgresql://alice:s3cret@host/db``), anywhere in a
  string: :func:`redact` replaces it by ``***`` for people to read; :func:`without_secrets`
  leaves it out of a config (``alice@host``), so that ``voltrl train`` of the written
  ``train.yaml`` still runs with the password the database client takes from its environment
  (``PGPASSWORD``, ``~/.pgpass``);
- the value of a field, header or URL query parameter named for a secret
  (:func:`is_secret_key`: ``api_key``, ``api-key``, ``X-Api-Key``, ``apikey``, ``token``,
  ``password``, ``secret``, ``Authorization``, ``Cookie`` and names ending in them, in any
  case and with any separator): dropped from configs, ``***`` in messages.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

MASK = "***"

# scheme://user:password@ — the password is what stands between the first ':' after the
# scheme and the last '@' before the host (a password may itself hold '@' or ':').
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s/:@]*:)(?P<pw>[^\s/]*)@")
_SECRET_KEY = re.compile(
    r"(?i)(^|[_\-.\s])((api|access|secret|private|subscription)[_\-.]?key|token|password"
    r"|passwd|passphrase|secret|authorization|cookie|credentials?)$"
)
_SECRET_PARAMS = ("key", "sig", "signature")
"""Query parameters that hold a secret besides the secret-named ones (Google's ``?key=``,
Azure's SAS ``sig``)."""
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s\"'<>]+")


def is_secret_key(key: str) -> bool:
    """Whether a config field, header or query parameter of this name holds a secret
    (``api_key``, ``api-key``, ``X-Api-Key``, ``apikey``, ``backend_api_key``, ``token``,
    ``X-Auth-Token``, ``client_secret``, ``password``, ``Authorization``,
    ``Proxy-Authorization``, ``Cookie``, ``aws_secret_access_key``, …; not ``api_key_env``
    nor ``max_tokens``)."""
    return bool(_SECRET_KEY.search(key))


def _secret_params(url: str, replacement: str | None) -> str:
    """``url`` with the value of each secret-named query parameter replaced (None: the
    parameter left out); the rest of the URL is kept as written."""
    base, question, rest = url.partition("?")
    if not question:
        return url
    query, hash_mark, fragment = rest.partition("#")
    kept = []
    for part in query.split("&"):
        name, equals, value = part.partition("=")
        secret = is_secret_key(unquote(name)) or unquote(name).lower() in _SECRET_PARAMS
        if equals and value and secret:
            if replacement is None:
                continue
            part = f"{name}={replacement}"
        kept.append(part)
    return base + ("?" + "&".join(kept) if kept else "") + hash_mark + fragment


def redact(text: str) -> str:
    """``text`` with the password of every URL in it, and the value of every secret-named
    query parameter, replaced by ``***``: for messages, ``repr`` and pages
    (``postgresql://alice:***@host/db``, ``https://host/v1?api-key=***``)."""
    if "://" not in text:
        return text
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@" if m["pw"] else m[0], text)
    return _URL.sub(lambda m: _secret_params(m[0], MASK), text) if "?" in text else text


def scrub(text: str, *secrets: str | None) -> str:
    """``text`` (a driver's error message, say) with each of ``secrets`` replaced by ``***``
    and URL passwords redacted."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return redact(text)


def _drop_url_secrets(text: str) -> str:
    if "://" not in text:
        return text
    text = _URL_PASSWORD.sub(lambda m: f"{m['head'][:-1]}@", text)
    return _URL.sub(lambda m: _secret_params(m[0], None), text) if "?" in text else text


def without_secrets(value: Any) -> Any:
    """A copy of a config (mappings, lists, strings, numbers) fit to store, write to a file or
    send to a tracker: fields named for a secret are left out, and URLs lose their passwords
    (``alice@host``: the rest still names the same database) and secret query parameters."""
    if isinstance(value, str):
        return _drop_url_secrets(value)
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
    """A copy of a config for people to read (pages, the terminal, ``repr``): like
    :func:`without_secrets`, but a secret field shows as ``***``, and so do a URL's password
    and secret query parameters, so the reader sees that one was set."""
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

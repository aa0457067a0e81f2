"""The store over HTTP: :class:`HTTPStore`, the client that a remote runner uses as if the store
were local, and the server's endpoints (:mod:`voltrl.store.http.endpoints`: ``store_app``,
``store_router``), imported from there: the server needs FastAPI, which a runner does without."""

from voltrl.store.http.client import HTTPStore

__all__ = ["HTTPStore"]

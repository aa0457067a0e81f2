"""The store over HTTP: the server's endpoints and :class:`HTTPStore`, the client that a remote
runner uses as if the store were local."""

from voltrl.store.http.client import HTTPStore
from voltrl.store.http.endpoints import store_app, store_router

__all__ = ["HTTPStore", "store_app", "store_router"]

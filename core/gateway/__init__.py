"""The gateway: an OpenAI-compatible reverse proxy that records every call with its token ids.

:class:`Gateway` is the ASGI app; :func:`start_gateway` serves one for a run or for ``voltrl
gateway``; :func:`is_context_overflow` tells a backend's "prompt too long" answer apart.
"""

from voltrl.gateway.errors import is_context_overflow
from voltrl.gateway.hosting import ServedGateway, start_gateway
from voltrl.gateway.proxy import Gateway

__all__ = ["Gateway", "ServedGateway", "is_context_overflow", "start_gateway"]

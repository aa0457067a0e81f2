"""HTTP plumbing shared by every server of VoltRL: serving an ASGI app, bearer-token auth,
loopback checks (a token off loopback, the Host check on it), and how long idle connections
stay open on each side."""

KEEPALIVE_S = 5.0
"""How long VoltRL's servers keep an idle connection open (uvicorn's ``timeout_keep_alive``)."""
CLIENT_KEEPALIVE_S = 4.0
"""How long VoltRL's HTTP clients (the gateway's to its backends, the store's, the agents'
OpenAI clients) keep an idle pooled connection: less than :data:`KEEPALIVE_S`, so a request
rarely meets a connection the server is closing. With aiohttp's default of 15 s, the
gateway's first requests after an update's pause met LocalRL's engine closing them
(``ServerDisconnectedError``, retried and printed)."""

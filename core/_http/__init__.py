"""HTTP plumbing shared by every server of VoltRL: serving an ASGI app, bearer-token auth,
loopback checks (a token off loopback, the Host check on it), and how long idle connections
stay open on each side."""

KEEPALIVE_S = 15.0
"""How long VoltRL's servers keep an idle connection open (uvicorn's ``timeout_keep_alive``;
its default is 5 s)."""
CLIENT_KEEPALIVE_S = 4.0
"""How long VoltRL's HTTP clients (the gateway's to its backends, the store's, the agents'
OpenAI clients) keep an idle pooled connection: well under :data:`KEEPALIVE_S`, so a request
does not meet a connection the server is closing, even from a client whose event loop is
seconds late on a busy machine. A client's clock starts when it has read the response, the
server's when it sent it. With 15 s (aiohttp's default) against uvicorn's 5, the gateway's
requests to LocalRL's engine met closing connections (``ServerDisconnectedError``); with 4
against 5, a busy runner's store requests still did (``Can not write request body``): both
retried, and printed."""

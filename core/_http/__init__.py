"""HTTP plumbing shared by every server of VoltRL: serving an ASGI app, bearer-token auth,
loopback checks (a token off loopback, the Host check on it)."""

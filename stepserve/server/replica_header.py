"""The header that names the serving replica on every response (X-Stepserve-Replica), and the middleware that
adds it: every app a replica serves (the API, the console) mounts it."""

from __future__ import annotations

REPLICA_HEADER = "X-Stepserve-Replica"


class ReplicaHeader:
    """Pure ASGI middleware (streams pass through untouched) that names the serving replica on every response."""

    def __init__(self, app, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message) -> None:  # once: a server of several models names it on its front too
            if message["type"] == "http.response.start" and all(k != self.header[0] for k, _ in
                                                                 message.get("headers", ())):
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)

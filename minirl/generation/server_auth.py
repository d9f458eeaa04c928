"""An ASGI middleware for the vLLM servers minirl starts (`vllm serve --middleware
minirl.generation.server_auth.RequireKey`): every path needs the run's API key.

Why: vLLM's own `--api-key` check guards only paths under /v1, /v2, /inference and /cohere. With runtime LoRA
updating on (which minirl needs), vLLM also mounts SageMaker-style `/adapters` routes that load, replace in place
(`load_inplace`) or unload adapters, and they sit outside that prefix: without this, any local user could swap the
adapter a run samples from. Runs inside the server process: standard library only, no minirl or vLLM imports.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os


class RequireKey:
    """Answers 401 to any HTTP or websocket request without `Authorization: Bearer <VLLM_API_KEY>`; with no key in
    the environment it lets everything through (vLLM's own behaviour)."""

    def __init__(self, app):
        self.app = app
        key = os.environ.get("VLLM_API_KEY")
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self.digest)
        return False

    async def __call__(self, scope, receive, send):
        if self.digest is None or scope["type"] not in ("http", "websocket") or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

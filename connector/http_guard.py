"""An ASGI middleware for the vLLM API server of a turbowire engine: a generation request whose
``vllm_xargs`` carry ``kv_transfer_params`` or ``ec_transfer_params`` gets HTTP 400.

vLLM's request models type ``vllm_xargs`` values as strings, numbers or lists and copy them into
``SamplingParams.extra_args``, where vLLM (0.32) reads ``kv_transfer_params`` as the transfer
params without checking their type: a string there makes the frontend's output processor raise
``AttributeError`` (HTTP 500), and code that reads it after the frontend (the engine core's
scheduler and its KV connector) would do the same inside the engine loop. Transfer params travel
in the top-level ``kv_transfer_params`` field, which vLLM validates as an object; a copy in
``vllm_xargs`` is never legitimate, so the request is refused with a message that says so before
vLLM parses it. Install with ``vllm serve ... --middleware
turbowire.connector.http_guard.TransferParamsGuard`` (turbowire's launcher and Helm chart do).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: vllm_xargs keys vLLM treats as transfer params (vllm/v1/request.py reads them from extra_args)
SMUGGLED_KEYS = ("kv_transfer_params", "ec_transfer_params")


def smuggled_params(body: Any) -> str | None:
    """The first transfer-params key a request body carries inside ``vllm_xargs``, if any."""
    if not isinstance(body, dict):
        return None
    xargs = body.get("vllm_xargs")
    if not isinstance(xargs, dict):
        return None
    return next((key for key in SMUGGLED_KEYS if key in xargs), None)


class TransferParamsGuard:
    """Refuse (400) POST bodies with transfer params inside ``vllm_xargs``; pass all else on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:  # vLLM reads the whole body itself; this holds it once more, briefly
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                await self.app(scope, _replay(None, message, receive), send)
                return
            chunks.append(message.get("body", b""))
            more = bool(message.get("more_body"))
        body = b"".join(chunks)
        key = None
        if b"_transfer_params" in body:  # cheap test first: almost every body lacks it
            try:
                key = smuggled_params(json.loads(body))
            except (ValueError, RecursionError):
                key = None  # not JSON: vLLM answers that itself
        if key is None:
            await self.app(scope, _replay(body, None, receive), send)
            return
        payload = json.dumps({"error": {
            "message": f"vllm_xargs.{key} is not accepted: send transfer params as the top-level "
                       f"'{key}' object (a P/D router forwards them there)",
            "type": "BadRequestError", "param": f"vllm_xargs.{key}", "code": 400,
        }}).encode()
        await send({"type": "http.response.start", "status": 400, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]})
        await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes | None, first: Message | None, receive: Receive) -> Receive:
    """A receive() that hands over the buffered body in one message (or ``first``, a message
    to pass on), then the server's own receive() (which waits for the client to go away)."""
    pending: list[Message] = [first] if first is not None else [
        {"type": "http.request", "body": body or b"", "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay

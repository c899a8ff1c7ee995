"""The ASGI application (uvicorn in production: event streams hold no thread).

The static files (the admin's styles and scripts, the API documentation's) are served here from
STATIC_ROOT, where `manage.py collectstatic` puts them, so a deployment needs no other server
for them.

Django's ASGI handler reads a whole request body into a temporary file before any middleware
runs, so the API's body limit is enforced here, while the body streams in: a declared
Content-Length over the limit, or more bytes than the limit without one, is answered 413
before the rest is read.
"""

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

import django
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.responses import PlainTextResponse
from starlette.staticfiles import StaticFiles

from config.handlers import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

django.setup(set_prefix=False)
django_application = ASGIHandler()

from django.conf import settings  # noqa: E402

from config.api import error_body  # noqa: E402 - needs the apps loaded above
from config.middleware import body_limit  # noqa: E402

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps(
        error_body("PAYLOAD_TOO_LARGE", "The request body is too large.", {"max_bytes": limit})
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _route(scope: Message) -> str:
    """The request's path below the server's root path (`uvicorn --root-path`), which
    uvicorn includes in `path`."""
    path, root_path = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root_path) :] if root_path and path.startswith(root_path) else path


class BodyLimit:
    """Bound the body of an API request (below the server's root path, if any) to what its
    endpoint allows (`config.middleware.body_limit`)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        route = _route(scope) if scope["type"] == "http" else ""
        if not route.startswith("/api/"):
            await self.app(scope, receive, send)
            return
        limit = body_limit(scope["method"], route)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > limit:
            await _too_large(send, limit)
            return
        received: list[Message] = []
        size = 0
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > limit:
                await _too_large(send, limit)
                return
            if not message.get("more_body"):
                break
        replay = iter(received)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)


# What every static file is answered with: no script of its runs (the API documentation's
# assets include an HTML page), and no page of another site may frame it.
STATIC_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"),
]


class StaticAssets:
    """Requests under STATIC_ROUTE (below the server's root path, if any) are answered from
    STATIC_ROOT: a file outside it, or none (collectstatic not run), is a 404; any other
    request goes to `app`."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.route = settings.STATIC_ROUTE
        self.root = settings.STATIC_ROOT
        # The middleware turns the 404 and 405 StaticFiles raises into answers.
        self.files = ExceptionMiddleware(StaticFiles(directory=self.root, check_dir=False))

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        route = _route(scope) if scope["type"] == "http" else ""
        if not route.startswith(self.route):
            await self.app(scope, receive, send)
            return

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], *STATIC_HEADERS]}
            await send(message)

        if not os.path.isdir(self.root):
            await PlainTextResponse("Not Found", status_code=404)(scope, receive, sent)
            return
        inner = {**scope, "path": route[len(self.route) - 1 :], "root_path": ""}
        await self.files(inner, receive, sent)


application = StaticAssets(BodyLimit(django_application))

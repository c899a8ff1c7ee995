"""The ASGI entry point refuses an oversized API body while it streams in."""

import asyncio
import contextvars
import json

import pytest
from asgiref.sync import async_to_sync

from config.asgi import application


def asgi_call(
    *, path: str, headers: list, chunks: list[bytes], root_path: str = ""
) -> tuple[int, dict, bytes, int]:
    """Drive the project's ASGI application by hand with a POST of `chunks`; returns (status,
    headers sent, body, chunks read). Under a root path (`uvicorn --root-path`), `path`
    includes it, as uvicorn gives it. The request is served in a context of its own, as a
    server serves each: the script prefix Django sets from the root path stays there, where
    `async_to_sync` would bring it back to the test's thread and every URL reversed after."""
    pending = [
        {"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
        for index, chunk in enumerate(chunks)
    ]
    read = []
    sent = []

    async def receive():
        if pending:
            message = pending.pop(0)
            read.append(message)
            return message
        await asyncio.Event().wait()  # like a server: nothing more until the client leaves

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": root_path,
        "headers": [(b"host", b"testserver"), *headers],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
    }
    contextvars.copy_context().run(async_to_sync(application), scope, receive, send)
    start = next(message for message in sent if message["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    headers_sent = {name.decode().lower(): value.decode() for name, value in start["headers"]}
    return start["status"], headers_sent, body, len(read)


def _call(
    *, path: str, headers: list, chunks: list[bytes], root_path: str = ""
) -> tuple[int, dict, int]:
    """(status, JSON body, chunks read) of `asgi_call`."""
    status, _, body, read = asgi_call(
        path=path, headers=headers, chunks=chunks, root_path=root_path
    )
    return status, json.loads(body), read


@pytest.mark.django_db
def test_a_declared_length_over_the_limit_is_refused_before_reading(settings):
    status, body, read = _call(
        path="/api/v1/messages",
        headers=[(b"content-length", str(settings.API_MAX_BODY_BYTES + 1).encode())],
        chunks=[b"{}"],
    )

    assert status == 413
    assert body["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert read == 0


@pytest.mark.django_db
def test_a_chunked_body_over_the_limit_is_refused_as_it_streams(settings):
    chunk = b"x" * (settings.API_MAX_BODY_BYTES // 4)

    status, body, read = _call(
        path="/api/v1/messages",
        headers=[(b"content-type", b"application/json")],
        chunks=[chunk] * 10,
    )

    assert status == 413
    assert body == {
        "error": {
            "code": "PAYLOAD_TOO_LARGE",
            "message": "The request body is too large.",
            "details": {"max_bytes": settings.API_MAX_BODY_BYTES},
        }
    }
    assert read == 5


@pytest.mark.django_db
def test_a_body_within_the_limit_reaches_the_api(settings):
    status, body, read = _call(
        path="/api/v1/messages",
        headers=[(b"content-type", b"application/json")],
        chunks=[b'{"channel":', b' "api"}'],
    )

    assert status == 401
    assert body["error"]["code"] == "AUTHENTICATION_REQUIRED"
    assert read == 2


@pytest.mark.django_db
def test_below_a_root_path_a_declared_length_over_the_limit_is_refused_before_reading(settings):
    status, body, read = _call(
        path="/agentgov/api/v1/messages",
        root_path="/agentgov",
        headers=[(b"content-length", str(settings.API_MAX_BODY_BYTES + 1).encode())],
        chunks=[b"{}"],
    )

    assert (status, body["error"]["details"], read) == (
        413,
        {"max_bytes": settings.API_MAX_BODY_BYTES},
        0,
    )


@pytest.mark.django_db
def test_below_a_root_path_a_chunked_body_over_the_limit_is_refused_as_it_streams(settings):
    chunk = b"x" * (settings.API_MAX_BODY_BYTES // 4)

    status, body, read = _call(
        path="/agentgov/api/v1/messages",
        root_path="/agentgov",
        headers=[(b"content-type", b"application/json")],
        chunks=[chunk] * 10,
    )

    assert (status, body["error"]["code"], read) == (413, "PAYLOAD_TOO_LARGE", 5)


@pytest.mark.django_db
def test_below_a_root_path_an_upload_is_bounded_by_the_attachment_limit(settings):
    limit = settings.ATTACHMENT_MAX_BYTES + settings.ATTACHMENT_MULTIPART_OVERHEAD_BYTES

    status, body, read = _call(
        path="/agentgov/api/v1/attachments",
        root_path="/agentgov",
        headers=[(b"content-length", str(limit + 1).encode())],
        chunks=[b"x"],
    )

    assert (status, body["error"]["details"], read) == (413, {"max_bytes": limit}, 0)


@pytest.mark.django_db
def test_below_a_root_path_an_upload_over_the_json_limit_reaches_the_api(settings):
    size = settings.API_MAX_BODY_BYTES + 1

    status, body, read = _call(
        path="/agentgov/api/v1/attachments",
        root_path="/agentgov",
        headers=[
            (b"content-type", b"multipart/form-data; boundary=x"),
            (b"content-length", str(size).encode()),
        ],
        chunks=[b"x" * size],
    )

    assert (status, body["error"]["code"], read) == (401, "AUTHENTICATION_REQUIRED", 1)

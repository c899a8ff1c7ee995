import tempfile
from collections.abc import Callable
from typing import IO

from django.conf import settings
from django.core.handlers.wsgi import LimitedStream
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse
from django.urls import get_resolver
from django.utils.cache import add_never_cache_headers

from config.api import error_body
from config.handlers import MalformedContentType

READ_CHUNK_BYTES = 64 * 1024


def body_limit(method: str, route: str) -> int:
    """The largest body a request may carry: an upload carries a whole attachment, every
    other API request at most API_MAX_BODY_BYTES of JSON. `route` is the path below the
    server's root path (a request's `path_info`)."""
    # The route of the URL, without the script prefix `reverse` adds under a root path.
    if method == "POST" and route == "/" + get_resolver().reverse("attachments"):
        return settings.ATTACHMENT_MAX_BYTES + settings.ATTACHMENT_MULTIPART_OVERHEAD_BYTES
    return settings.API_MAX_BODY_BYTES


def _too_large(limit: int, **details: int) -> JsonResponse:
    return JsonResponse(
        error_body(
            "PAYLOAD_TOO_LARGE", "The request body is too large.", {"max_bytes": limit, **details}
        ),
        status=413,
    )


def _read_at_most(source: IO[bytes], limit: int) -> tuple[IO[bytes], int] | None:
    """Copy up to `limit` bytes into a spooled file (memory up to FILE_UPLOAD_MAX_MEMORY_SIZE,
    disk beyond) and return it with its size; None if the body has more, reading one byte
    past the limit to know."""
    # Not a context manager: the file becomes the request's stream and outlives this call.
    body = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE)  # noqa: SIM115
    size = 0
    while size <= limit:
        chunk = source.read(min(READ_CHUNK_BYTES, limit + 1 - size))
        if not chunk:
            break
        body.write(chunk)
        size += len(chunk)
    if size > limit:
        body.close()
        return None
    body.seek(0)
    return body, size


def _unreadable_undeclared_body(request: HttpRequest) -> bool:
    """Whether the server cut the input at the absent Content-Length without decoding the
    chunked body: Django's development server (`runserver`, which `make run` serves with) hands
    over a stream limited to 0 bytes, so the body it was sent cannot be read at all."""
    source = request.META.get("wsgi.input")
    return isinstance(source, LimitedStream) and source.limit == 0


def _bound_undeclared_body(request: HttpRequest, limit: int) -> bool:
    """Give a body sent without Content-Length (chunked) a declared length, unless it is over
    `limit`; False when it is.

    Under WSGI the server hands the body over as wsgi.input (chunked framing removed), while
    WSGIRequest's own stream stops at the absent Content-Length, i.e. reads nothing. Under
    ASGI, Django has already received the whole body into the request's stream before any
    middleware runs. Either way it is copied from there, at most one byte past the limit.
    """
    source = request.META.get("wsgi.input", request._stream)
    read = _read_at_most(source, limit)
    if read is None:
        return False
    request._stream, size = read
    request.META["CONTENT_LENGTH"] = str(size)
    return True


class UnreadableContentTypeMiddleware:
    """Refuse a request whose Content-Type Django could not parse (`config.handlers`) with
    400, the API's error body or the 400 page, before anything reads its body."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if getattr(request, "content_type_unreadable", False):
            raise MalformedContentType("The Content-Type header cannot be read.")
        return self.get_response(request)


class ApiBodySizeLimitMiddleware:
    """Refuse an API request whose body is larger than its endpoint allows with 413, before
    any view reads it.

    A declared Content-Length is checked as it stands. A body without one (Transfer-Encoding:
    chunked) is read up to one byte past the limit: refused if that byte exists, otherwise
    handed on with its length declared, since Django parses no body without Content-Length.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path_info.startswith("/api/"):
            return self.get_response(request)
        limit = body_limit(request.method, request.path_info)
        declared = request.META.get("CONTENT_LENGTH")
        if declared:
            # Digits only (RFC 9110): int() would also read "1_0", "+10" or other scripts' digits.
            if not (declared.isascii() and declared.isdigit()):
                return JsonResponse(
                    error_body("VALIDATION_ERROR", "Content-Length is not a number of bytes."),
                    status=400,
                )
            if int(declared) > limit:
                return _too_large(limit, declared_bytes=int(declared))
        elif "HTTP_TRANSFER_ENCODING" in request.META:
            if _unreadable_undeclared_body(request):
                return JsonResponse(
                    error_body(
                        "LENGTH_REQUIRED",
                        "This server cannot read a body without Content-Length; send one.",
                    ),
                    status=411,
                )
            if not _bound_undeclared_body(request, limit):
                return _too_large(limit)
        return self.get_response(request)


class NulQueryRefusalMiddleware:
    """Refuse a page whose query string carries a NUL character with 400: PostgreSQL text
    cannot hold one, and a filter passed on to the database (the admin's list filters) would
    fail with a 500. The API refuses one itself, naming the parameter."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path_info.startswith("/api/") and any(
            "\x00" in name or any("\x00" in value for value in values)
            for name, values in request.GET.lists()
        ):
            return HttpResponseBadRequest(
                "A NUL character is not allowed in the address.", content_type="text/plain"
            )
        return self.get_response(request)


class PrivateResponsesMiddleware:
    """What a signed-in person or an API token is answered (runs, approvals, exports, the
    admin) is never kept by a browser's or a proxy's cache, unless the view said otherwise."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        signed_in = getattr(request, "user", None) is not None and request.user.is_authenticated
        if (signed_in or "Authorization" in request.headers) and not response.has_header(
            "Cache-Control"
        ):
            add_never_cache_headers(response)
        return response

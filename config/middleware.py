from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from config.api import error_body


class ApiBodySizeLimitMiddleware:
    """Refuse an API request whose declared body is larger than API_MAX_BODY_BYTES with 413,
    before anything reads it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path.startswith("/api/"):
            try:
                declared = int(request.META.get("CONTENT_LENGTH") or 0)
            except ValueError:
                return JsonResponse(
                    error_body("VALIDATION_ERROR", "Content-Length is not a number."), status=400
                )
            if declared > settings.API_MAX_BODY_BYTES:
                return JsonResponse(
                    error_body(
                        "PAYLOAD_TOO_LARGE",
                        "The request body is too large.",
                        {"max_bytes": settings.API_MAX_BODY_BYTES, "declared_bytes": declared},
                    ),
                    status=413,
                )
        return self.get_response(request)

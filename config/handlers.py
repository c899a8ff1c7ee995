"""The WSGI and ASGI handlers of config/wsgi.py and config/asgi.py, with requests that survive
a Content-Type Django cannot parse.

Django parses the Content-Type while it builds the request, before any middleware runs: an
RFC 2231 parameter in a charset no codec knows (`boundary*=bogus''abc`) raised ValueError
there, which no error handler sees, so every page and endpoint answered it with a crash. Such a
request is built with no content type, marked, and refused with 400 by the first middleware
(`config.middleware.UnreadableContentTypeMiddleware`), before anything reads its body.
"""

from django.core.exceptions import SuspiciousOperation
from django.core.handlers import asgi, wsgi


class MalformedContentType(SuspiciousOperation):
    """The request's Content-Type header cannot be parsed."""


class _ContentTypeTolerant:
    content_type_unreadable = False

    def _set_content_type_params(self, meta: dict) -> None:
        try:
            super()._set_content_type_params(meta)
        except ValueError:
            self.content_type, self.content_params = "", {}
            self.content_type_unreadable = True


class WSGIRequest(_ContentTypeTolerant, wsgi.WSGIRequest):
    pass


class ASGIRequest(_ContentTypeTolerant, asgi.ASGIRequest):
    pass


class WSGIHandler(wsgi.WSGIHandler):
    request_class = WSGIRequest


class ASGIHandler(asgi.ASGIHandler):
    request_class = ASGIRequest

"""A request whose Content-Type cannot be read is refused with 400 at both entry points,
WSGI and ASGI, on the API and on pages alike, before anything reads or stores it."""

import io
import json

import pytest

from config.wsgi import application as wsgi_application
from registry.models import ToolVersion
from registry.services.tenancy import api_token_issue
from tests.config.test_asgi_body_limit import asgi_call
from tests.config.test_request_bodies import _tool_body
from tests.registry.factories import PASSWORD

# RFC 2231 parameters in a charset no codec knows: Django cannot parse the header at all.
MALFORMED = ["multipart/form-data; boundary*=bogus''abc", "application/json; charset*=bogus''x"]

REFUSED = {
    "error": {
        "code": "VALIDATION_ERROR",
        "message": "The Content-Type header cannot be read.",
        "details": {},
    }
}


def _via_wsgi(path: str, content_type: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    environ = {
        "REQUEST_METHOD": "POST",
        "SCRIPT_NAME": "",
        "PATH_INFO": path,
        "QUERY_STRING": "",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": "testserver",
        "CONTENT_TYPE": content_type,
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": io.StringIO(),
        "wsgi.multithread": False,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        **{f"HTTP_{name.upper().replace('-', '_')}": value for name, value in headers.items()},
    }
    started = []
    chunks = wsgi_application(environ, lambda status, sent: started.append((status, sent)))
    try:
        content = b"".join(chunks)
    finally:
        chunks.close()
    [(status, sent)] = started
    return int(status.split()[0]), {name.lower(): value for name, value in sent}, content


def _via_asgi(path: str, content_type: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    status, sent, content, _ = asgi_call(
        path=path,
        headers=[
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body)).encode()),
            *((name.lower().encode(), value.encode()) for name, value in headers.items()),
        ],
        chunks=[body],
    )
    return status, sent, content


ENTRY_POINTS = {"wsgi": _via_wsgi, "asgi": _via_asgi}


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("content_type", MALFORMED)
def test_an_api_request_with_an_unreadable_content_type_is_the_api_s_400(
    requests_keep_connection, publisher, acme, entry_point, content_type
):
    _, key = api_token_issue(username=publisher.username, password=PASSWORD, tenant_slug="acme")

    status, headers, content = ENTRY_POINTS[entry_point](
        "/api/v1/tools",
        content_type,
        json.dumps(_tool_body()).encode(),
        {"Authorization": f"Token {key}"},
    )

    assert status == 400
    assert headers["content-type"] == "application/json"
    assert json.loads(content) == REFUSED
    assert not ToolVersion.objects.exists()


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("content_type", MALFORMED)
def test_a_page_s_form_with_an_unreadable_content_type_is_a_400_page(
    requests_keep_connection, entry_point, content_type
):
    status, headers, content = ENTRY_POINTS[entry_point](
        "/accounts/login/", content_type, b"username=root&password=x", {}
    )

    assert status == 400
    assert headers["content-type"].startswith("text/html")
    assert b"Traceback" not in content


def test_an_unreadable_content_type_is_logged_as_one_warning_line_without_the_header(
    requests_keep_connection, console
):
    status, _, _ = _via_wsgi("/api/v1/tools", MALFORMED[0], b"", {})

    assert status == 400
    [line] = console.getvalue().splitlines()
    assert " WARNING django.security.MalformedContentType " in line
    assert "bogus" not in line


@pytest.mark.parametrize(
    "content_type",
    [
        "application/x-www-form-urlencoded; charset=bogus",
        "multipart/form-data; boundary=b; charset=bogus",
    ],
)
def test_a_page_s_form_in_an_unknown_charset_is_read_as_utf_8(client, platform_admin, content_type):
    body = b"username=root&password=x"
    if content_type.startswith("multipart/"):
        body = (
            b'--b\r\nContent-Disposition: form-data; name="username"\r\n\r\nroot\r\n'
            b'--b\r\nContent-Disposition: form-data; name="password"\r\n\r\nx\r\n--b--\r\n'
        )

    response = client.generic("POST", "/accounts/login/", body, content_type=content_type)

    # the form is read and answered (wrong password), not a crash
    assert response.status_code == 200
    assert response.context["form"].data["username"] == "root"

import http.client
import json
import socket
from urllib.parse import urlsplit

import pytest

from config.urls import handler500
from registry.models import ToolVersion
from tests.registry.factories import tool_content


def _tool_body(**overrides) -> dict:
    body = {"name": "project_search", "version": "1.0.0", **tool_content(), **overrides}
    return body


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            json.dumps(_tool_body(description="nul \u0000 inside")),
            "NUL characters are not allowed.",
        ),
        (
            json.dumps(_tool_body(result_contract={"k\u0000": 1})),
            "NUL characters are not allowed.",
        ),
        (
            json.dumps(_tool_body(result_contract=json.loads("[" * 40 + "]" * 40))),
            "JSON nested deeper than 32 levels.",
        ),
        ("[" * 100_000 + "]" * 100_000, "JSON nested deeper than 32 levels."),
        # json.dumps escapes a lone surrogate as "\udfff": valid JSON, but no UTF-8 text
        (
            json.dumps(_tool_body(description="lone \udfff surrogate")),
            "Strings must be valid Unicode (no unpaired surrogates).",
        ),
        (
            json.dumps(_tool_body(result_contract={"k\ud800": 1})),
            "Strings must be valid Unicode (no unpaired surrogates).",
        ),
    ],
    ids=[
        "nul-in-value",
        "nul-in-key",
        "deep",
        "absurdly-deep",
        "unpaired-surrogate-in-value",
        "unpaired-surrogate-in-key",
    ],
)
def test_bodies_postgres_cannot_store_are_refused(api, publisher, acme, body, message):
    client = api.as_user(publisher, acme)
    client.raise_request_exception = False  # a crash must show as the 500 a client gets

    response = client.post("/api/v1/tools", body, content_type="application/json")

    assert response.status_code == 400
    assert response.json() == {
        "error": {"code": "VALIDATION_ERROR", "message": message, "details": {}}
    }
    assert not ToolVersion.objects.exists()


LATIN_1 = json.dumps(_tool_body(description="café"), ensure_ascii=False).encode("latin-1")
# a surrogate written in UTF-8's form (CESU-8), which UTF-8 text cannot hold
CESU_8 = json.dumps(_tool_body(description="\ud800"), ensure_ascii=False).encode(
    "utf-8", "surrogatepass"
)
LATIN_1_AT, CESU_8_AT = LATIN_1.index(b"\xe9"), CESU_8.index(b"\xed")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            LATIN_1,
            "JSON parse error - JSON is UTF-8 (RFC 8259): the byte at offset "
            f"{LATIN_1_AT} (0xE9) is not.",
        ),
        (
            CESU_8,
            "JSON parse error - JSON is UTF-8 (RFC 8259): the byte at offset "
            f"{CESU_8_AT} (0xED) is not.",
        ),
        (
            b"\xef\xbb\xbf" + LATIN_1,
            "JSON parse error - JSON is UTF-8 (RFC 8259): the byte at offset "
            f"{LATIN_1_AT + 3} (0xE9) is not.",
        ),
        (
            '{"name": "x"} {"name": "y"}',
            "JSON parse error - Data after the JSON value: line 1 column 15.",
        ),
        (
            '{"name": "x",',
            "JSON parse error - Expecting property name enclosed in double quotes: "
            "line 1 column 14.",
        ),
        (
            b"\xef\xbb\xbf\xef\xbb\xbf{}",
            "JSON parse error - The body starts with more than one byte order mark.",
        ),
        (json.dumps(_tool_body(result_contract={"k": float("nan")})), "Numbers must be finite."),
        (json.dumps(_tool_body(result_contract={"k": float("-inf")})), "Numbers must be finite."),
    ],
    ids=[
        "latin-1",
        "cesu-8-surrogate",
        "latin-1-after-a-mark",
        "trailing-data",
        "truncated",
        "two-marks",
        "nan",
        "infinity",
    ],
)
def test_a_body_that_is_not_json_is_refused_saying_why_in_plain_words(
    api, publisher, acme, body, message
):
    client = api.as_user(publisher, acme)

    response = client.post("/api/v1/tools", body, content_type="application/json")

    assert response.status_code == 400
    assert response.json() == {
        "error": {"code": "VALIDATION_ERROR", "message": message, "details": {}}
    }
    assert not ToolVersion.objects.exists()


def test_a_body_starting_with_a_byte_order_mark_is_read_without_it(api, publisher, acme):
    client = api.as_user(publisher, acme)
    body = json.dumps(_tool_body(description="café"), ensure_ascii=False).encode()

    response = client.post("/api/v1/tools", b"\xef\xbb\xbf" + body, content_type="application/json")

    assert response.status_code == 201
    assert ToolVersion.objects.get().description == "café"


@pytest.mark.parametrize(
    ("charset", "body"),
    [
        # the body's bytes are UTF-8, which read as Latin-1 stored "cafÃ©"
        ("latin-1", json.dumps(_tool_body(description="café"), ensure_ascii=False).encode()),
        ("utf-16", json.dumps(_tool_body(description="café")).encode("utf-16")),
        ("windows-1252", json.dumps(_tool_body()).encode()),
        ("rot13", json.dumps(_tool_body()).encode()),
        ("no-such-charset", json.dumps(_tool_body()).encode()),
    ],
)
def test_a_json_body_declared_in_a_charset_other_than_utf_8_is_refused(
    api, publisher, acme, charset, body
):
    client = api.as_user(publisher, acme)
    client.raise_request_exception = False  # a crash must show as the 500 a client gets

    response = client.post(
        "/api/v1/tools", body, content_type=f"application/json; charset={charset}"
    )

    assert response.status_code == 415
    assert response.json() == {
        "error": {
            "code": "UNSUPPORTED_MEDIA_TYPE",
            "message": f'JSON is UTF-8 (RFC 8259): charset "{charset}" is not supported.',
            "details": {},
        }
    }
    assert not ToolVersion.objects.exists()


@pytest.mark.parametrize("charset", ["utf-8", "UTF-8", "utf8", '"utf-8"'])
def test_a_json_body_declared_in_utf_8_is_read(api, publisher, acme, charset):
    client = api.as_user(publisher, acme)
    body = json.dumps(_tool_body(description="café"), ensure_ascii=False).encode()

    response = client.post(
        "/api/v1/tools", body, content_type=f"application/json; charset={charset}"
    )

    assert response.status_code == 201
    assert ToolVersion.objects.get().description == "café"


@pytest.mark.parametrize("content_type", ["*/*", "application/*", "*/json"])
def test_a_body_whose_content_type_is_a_wildcard_is_refused(api, publisher, acme, content_type):
    # a wildcard belongs in Accept; a body is of one type
    client = api.as_user(publisher, acme)

    response = client.post("/api/v1/tools", json.dumps(_tool_body()), content_type=content_type)

    assert response.status_code == 415
    assert response.json() == {
        "error": {
            "code": "UNSUPPORTED_MEDIA_TYPE",
            "message": f'Unsupported media type "{content_type}" in request.',
            "details": {},
        }
    }
    assert not ToolVersion.objects.exists()


def test_a_body_over_the_limit_is_refused_before_it_is_read(api, publisher, acme, settings):
    client = api.as_user(publisher, acme)
    body = json.dumps(_tool_body(description="x" * settings.API_MAX_BODY_BYTES))

    response = client.post("/api/v1/tools", body, content_type="application/json")

    assert response.status_code == 413
    assert response.json() == {
        "error": {
            "code": "PAYLOAD_TOO_LARGE",
            "message": "The request body is too large.",
            "details": {"max_bytes": settings.API_MAX_BODY_BYTES, "declared_bytes": len(body)},
        }
    }
    assert not ToolVersion.objects.exists()


def test_below_a_script_name_a_body_over_the_limit_is_refused(api, publisher, acme, settings):
    client = api.as_user(publisher, acme)
    body = json.dumps(_tool_body(description="x" * settings.API_MAX_BODY_BYTES))

    response = client.post(
        "/api/v1/tools", body, content_type="application/json", SCRIPT_NAME="/agentgov"
    )

    # refused by the limit, before the body is read, not by the parser after it
    assert response.status_code == 413
    assert response.json()["error"]["details"] == {
        "max_bytes": settings.API_MAX_BODY_BYTES,
        "declared_bytes": len(body),
    }
    assert not ToolVersion.objects.exists()


def test_a_body_at_the_limit_is_read(api, publisher, acme, settings):
    client = api.as_user(publisher, acme)
    body = _tool_body(description="")
    body["description"] = "x" * (settings.API_MAX_BODY_BYTES - len(json.dumps(body)))

    response = client.post("/api/v1/tools", json.dumps(body), content_type="application/json")

    assert response.status_code == 201
    assert ToolVersion.objects.get().description == body["description"]


def test_a_bad_host_header_on_the_api_answers_the_json_error_body(client, db):
    response = client.get("/api/v1/tools", HTTP_HOST="attacker.example")

    assert response.status_code == 400
    assert response.json() == {
        "error": {"code": "VALIDATION_ERROR", "message": "Bad request.", "details": {}}
    }


def test_a_bad_host_header_is_logged_as_one_warning_line_without_a_traceback(client, db, console):
    response = client.get("/runs/", HTTP_HOST="attacker.example")

    assert response.status_code == 400
    [line] = console.getvalue().splitlines()
    assert " WARNING django.security.DisallowedHost " in line
    assert "attacker.example" in line


def test_a_crash_on_the_api_answers_the_json_error_body_without_a_trace(rf):
    response = handler500(rf.get("/api/v1/tools"))

    assert response.status_code == 500
    assert json.loads(response.content) == {
        "error": {
            "code": "INTERNAL_ERROR",
            "message": "The server could not complete the request.",
            "details": {},
        }
    }


def test_pages_keep_html_errors(client, db):
    response = client.get("/no-such-page/")

    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")


def test_a_chunked_body_the_development_server_cannot_read_is_411(live_server):
    # given Django's own server (what `make run` serves with), which does not decode chunks
    address = urlsplit(live_server.url)
    body = b'{"channel": "api", "parts": [{"type": "text", "text": "hi"}]}'
    request = (
        b"POST /api/v1/messages HTTP/1.1\r\n"
        + f"Host: {address.netloc}\r\n".encode()
        + b"Content-Type: application/json\r\nIdempotency-Key: chunked-1\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
    )

    # when a client sends a message without Content-Length (all of it at once: the server
    # answers before it reads a body)
    with socket.create_connection((address.hostname, address.port), timeout=10) as connection:
        connection.sendall(request)
        response = http.client.HTTPResponse(connection)
        response.begin()

        # then it is told to send one, rather than that its fields are missing
        assert response.status == 411
        assert json.loads(response.read())["error"]["code"] == "LENGTH_REQUIRED"


@pytest.mark.parametrize(
    "path", ["/admin/registry/toolversion/?status__exact=%00", "/runs/?status=%00", "/?a%00=1"]
)
def test_a_page_address_with_a_nul_character_is_400(client, platform_admin, path):
    client.force_login(platform_admin)

    response = client.get(path)

    assert response.status_code == 400
    assert b"Traceback" not in response.content


def test_below_a_script_name_an_api_address_with_a_nul_character_is_the_api_s_400(
    api, publisher, acme
):
    client = api.as_user(publisher, acme)

    response = client.get("/api/v1/runs?status=%00", SCRIPT_NAME="/agentgov")

    # the API names the parameter, in its error body, not the pages' plain text
    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"]["code"]


def test_below_a_script_name_an_unknown_api_address_is_the_api_s_404(api, publisher, acme):
    client = api.as_user(publisher, acme)

    response = client.get("/api/v1/no-such-thing", SCRIPT_NAME="/agentgov")

    assert response.status_code == 404
    assert response.json()["error"]["code"] == "NOT_FOUND"

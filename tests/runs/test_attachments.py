"""POST /api/v1/attachments and attachment references in messages: allowed types confirmed by
their content, bounded bodies (with or without Content-Length, under WSGI and ASGI), private
storage, and nothing left behind on refusal."""

import hashlib
import io
import json
import struct
import uuid
import zipfile
import zlib

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import RequestDataTooBig
from django.core.files import File
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test.client import (
    BOUNDARY,
    MULTIPART_CONTENT,
    AsyncClientHandler,
    FakePayload,
    encode_multipart,
)

from config.urls import handler400
from registry.choices import Role
from registry.services.tenancy import api_token_issue, membership_add
from runs.errors import ValidationFailed
from runs.models import Attachment, IngressRecord, Run, RunEvent, Session
from runs.services.attachments import attachment_store
from tests.registry.factories import PASSWORD, UserFactory

URL = "/api/v1/attachments"
MESSAGES = "/api/v1/messages"
MAX_BYTES = 4096
OVERHEAD = 16 * 1024


def _png() -> bytes:
    """A real 1x1 PNG."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00\xff\x00\x00")
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


PNG = _png()
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00" + b"\x00" * 64
PDF = (
    b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n"
    b"trailer\n<< /Root 1 0 R >>\n%%EOF\n"
)
TEXT = "Weekly notes: Apollo ships on Friday. ✓\n".encode()
CSV = "project,owner\napollo,Ana Müller\n".encode()
JSON = b'{"project": "apollo", "risks": [1, 2]}'


def _zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("notes.txt", "hello")
    return buffer.getvalue()


@pytest.fixture(autouse=True)
def small_files(private_root, settings):
    """Attachments of this test go to its own directory and may take MAX_BYTES."""
    settings.ATTACHMENT_MAX_BYTES = MAX_BYTES


def _stored_files(root) -> list:
    return [path for path in root.rglob("*") if path.is_file()] if root.exists() else []


def _upload(client, content: bytes, media_type: str, name: str = "notes.bin"):
    return client.post(
        URL,
        {"file": SimpleUploadedFile(name, content, content_type=media_type)},
        format="multipart",
    )


def _token(user, tenant) -> str:
    _, key = api_token_issue(username=user.username, password=PASSWORD, tenant_slug=tenant.slug)
    return key


def _multipart(content: bytes, media_type: str) -> bytes:
    upload = SimpleUploadedFile("notes.txt", content, content_type=media_type)
    return encode_multipart(BOUNDARY, {"file": upload})


def _row_counts() -> dict[str, int]:
    return {
        "runs": Run.objects.count(),
        "events": RunEvent.objects.count(),
        "sessions": Session.objects.count(),
        "ingress_records": IngressRecord.objects.count(),
    }


NOTHING = {"runs": 0, "events": 0, "sessions": 0, "ingress_records": 0}


@pytest.mark.parametrize(
    ("content", "media_type"),
    [
        (TEXT, "text/plain"),
        (CSV, "text/csv"),
        (JSON, "application/json"),
        (PDF, "application/pdf"),
        (PNG, "image/png"),
        (JPEG, "image/jpeg"),
        (b"BMW,Audi\n1,2\n", "text/csv"),
    ],
    ids=["text", "csv", "json", "pdf", "png", "jpeg", "csv-starting-like-a-bitmap"],
)
def test_each_allowed_type_is_stored_privately_with_its_digest(
    api, member, acme, private_root, settings, content, media_type
):
    client = api.as_user(member, acme)

    response = _upload(client, content, f"{media_type}; charset=utf-8", name="../../etc/x.dat")

    assert response.status_code == 201, response.json()
    attachment = Attachment.objects.get()
    assert response.json() == {
        "id": str(attachment.pk),
        "media_type": media_type,
        "size": len(content),
        "sha256": hashlib.sha256(content).hexdigest(),
    }
    assert (attachment.tenant, attachment.uploaded_by) == (acme, member)
    assert attachment.original_name == "x.dat"
    assert attachment.file.name == f"{acme.pk}/{attachment.pk}"
    stored = private_root / attachment.file.name
    assert _stored_files(private_root) == [stored]
    assert stored.read_bytes() == content
    assert stored.stat().st_mode & 0o777 == 0o600
    assert not stored.is_relative_to(settings.STATIC_ROOT)
    assert not stored.is_relative_to(settings.BASE_DIR)


@pytest.mark.parametrize(
    "media_type",
    [
        "application/vnd.ms-excel",
        "application/csv",
        "application/x-csv",
        "text/x-csv",
        "text/comma-separated-values",
        "text/x-comma-separated-values",
    ],
)
def test_a_csv_sent_under_another_name_for_csv_is_stored_as_text_csv(
    api, member, acme, private_root, media_type
):
    """A browser on Windows with Excel installed sends a .csv as application/vnd.ms-excel,
    and other clients use the older names of CSV: the file was refused as a type not
    accepted, though it is the CSV text the allowlist takes."""
    response = _upload(api.as_user(member, acme), CSV, media_type, name="status.csv")

    assert response.status_code == 201, response.json()
    attachment = Attachment.objects.get()
    assert response.json()["media_type"] == "text/csv"
    assert attachment.media_type == "text/csv"
    assert (private_root / attachment.file.name).read_bytes() == CSV


@pytest.mark.parametrize(
    ("content", "detected", "message"),
    [
        (
            b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + b"\x00" * 504,
            "application/octet-stream",
            "The content is not text/csv: text must be UTF-8, without NUL characters.",
        ),
        (PNG, "image/png", "The content is not text/csv."),
    ],
    ids=["excel-workbook", "png"],
)
def test_a_file_sent_under_another_name_for_csv_must_be_csv_text(
    api, member, acme, private_root, content, detected, message
):
    """application/vnd.ms-excel is taken for CSV only: an Excel workbook (or anything else
    that is not UTF-8 text) sent under it is refused, and nothing is stored."""
    response = _upload(api.as_user(member, acme), content, "application/vnd.ms-excel")

    assert response.status_code == 415
    body = response.json()["error"]
    assert (body["code"], body["message"]) == ("UNSUPPORTED_MEDIA_TYPE", message)
    assert body["details"]["declared"] == "application/vnd.ms-excel"
    assert body["details"]["detected"] == detected
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_a_file_of_exactly_the_limit_is_accepted(api, member, acme):
    content = b"x" * MAX_BYTES

    response = _upload(api.as_user(member, acme), content, "text/plain")

    assert response.status_code == 201
    assert response.json()["size"] == MAX_BYTES


def test_the_uploaders_file_name_is_kept_clean_and_bounded(api, member, acme):
    name = "report\u202egnp.txt\x07" + "a" * 300 + ".csv"

    response = _upload(api.as_user(member, acme), CSV, "text/csv", name=name)

    assert response.status_code == 201
    original_name = Attachment.objects.get().original_name
    assert "\u202e" not in original_name
    assert "\x07" not in original_name
    assert len(original_name) <= 255
    assert original_name.startswith("reportgnp.txt")
    assert original_name.endswith(".csv")


def _multipart_named(name: bytes, content: bytes, media_type: bytes) -> bytes:
    """A body whose file part has the name as sent, which the test client would refuse."""
    boundary = BOUNDARY.encode()
    return (
        b"--" + boundary + b"\r\n"
        b'Content-Disposition: form-data; name="file"; filename="' + name + b'"\r\n'
        b"Content-Type: " + media_type + b"\r\n\r\n" + content + b"\r\n"
        b"--" + boundary + b"--\r\n"
    )


@pytest.mark.parametrize(
    "name",
    [b"..", b"/", b"a/", b"..\\", b"\x01\x02", b"&#46;&#46;"],
    ids=["dots", "slash", "directory", "backslash", "controls", "entities"],
)
def test_a_file_whose_name_shows_nothing_is_kept_under_a_neutral_name(
    api, member, acme, private_root, name
):
    body = _multipart_named(name, TEXT, b"text/plain")

    response = api.as_user(member, acme).generic("POST", URL, body, content_type=MULTIPART_CONTENT)

    assert response.status_code == 201, response.json()
    attachment = Attachment.objects.get()
    assert attachment.original_name == "attachment"
    assert (private_root / attachment.file.name).read_bytes() == TEXT


@pytest.mark.parametrize(
    "boundary",
    ["b" * 71, "b" * 201, "b" * 226, "b" * 227, "b" * 1000, "curly{brace}", "at@sign", "ends "],
    ids=["71", "201", "226", "227", "1000", "braces", "at-sign", "trailing-space"],
)
def test_an_upload_whose_boundary_rfc_2046_does_not_allow_is_refused(
    api, member, acme, private_root, boundary
):
    client = api.as_user(member, acme)
    client.raise_request_exception = False  # a crash must show as the 500 a client gets
    body = encode_multipart(boundary, {"file": SimpleUploadedFile("notes.txt", TEXT)})

    response = client.generic(
        "POST", URL, body, content_type=f'multipart/form-data; boundary="{boundary}"'
    )

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "VALIDATION_ERROR"
    assert boundary not in error["message"]
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


@pytest.mark.parametrize(
    "boundary",
    ["b" * 70, "----WebKitFormBoundary7MA4YWxkTrZu0gW", "a'()+_,-./:=?z", "inner space"],
    ids=["70", "browser", "every-special-character", "inner-space"],
)
def test_an_upload_whose_boundary_rfc_2046_allows_is_stored(
    api, member, acme, private_root, boundary
):
    body = encode_multipart(boundary, {"file": SimpleUploadedFile("notes.txt", TEXT)})

    response = api.as_user(member, acme).generic(
        "POST", URL, body, content_type=f'multipart/form-data; boundary="{boundary}"'
    )

    assert response.status_code == 201, response.json()
    assert (private_root / Attachment.objects.get().file.name).read_bytes() == TEXT


@pytest.mark.parametrize("declared", ["*/*", "multipart/*"])
def test_an_upload_whose_content_type_is_a_wildcard_is_refused(
    api, member, acme, private_root, declared
):
    body = _multipart(TEXT, "text/plain")

    response = api.as_user(member, acme).generic(
        "POST", URL, body, content_type=f"{declared}; boundary={BOUNDARY}"
    )

    assert response.status_code == 415
    assert response.json()["error"]["code"] == "UNSUPPORTED_MEDIA_TYPE"
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


@pytest.mark.parametrize(
    ("charset", "name"),
    [
        # UTF-8 bytes that Latin-1 reads as "cafÃ©.txt"
        ("latin-1", "café.txt".encode()),
        ("windows-1252", b"notes.txt"),
        # every field name read as UTF-16 is garbled: "file" is missing
        ("utf-16", b"notes.txt"),
        ("rot13", b"notes.txt"),
        ("no-such-charset", b"notes.txt"),
    ],
)
def test_an_upload_declared_in_a_charset_other_than_utf_8_is_refused(
    api, member, acme, private_root, charset, name
):
    client = api.as_user(member, acme)
    client.raise_request_exception = False  # a crash must show as the 500 a client gets
    body = _multipart_named(name, TEXT, b"text/plain")

    response = client.generic(
        "POST", URL, body, content_type=f"{MULTIPART_CONTENT}; charset={charset}"
    )

    assert response.status_code == 415
    assert response.json() == {
        "error": {
            "code": "UNSUPPORTED_MEDIA_TYPE",
            "message": (
                f'Form fields and file names are UTF-8: charset "{charset}" is not supported.'
            ),
            "details": {},
        }
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


@pytest.mark.parametrize("charset", ["utf-8", "UTF-8", "utf8", '"utf-8"'])
def test_an_upload_declared_in_utf_8_is_stored(api, member, acme, private_root, charset):
    body = _multipart_named("café.txt".encode(), TEXT, b"text/plain")

    response = api.as_user(member, acme).generic(
        "POST", URL, body, content_type=f"{MULTIPART_CONTENT}; charset={charset}"
    )

    assert response.status_code == 201, response.json()
    attachment = Attachment.objects.get()
    assert attachment.original_name == "café.txt"
    assert (private_root / attachment.file.name).read_bytes() == TEXT


@pytest.mark.parametrize(
    ("content", "media_type", "detected"),
    [
        (PNG, "text/plain", "image/png"),
        (PNG, "image/jpeg", "image/png"),
        (TEXT, "image/png", "text/plain"),
        (JPEG, "application/pdf", "image/jpeg"),
        (PDF, "text/plain", "application/pdf"),
        (_zip(), "application/pdf", "application/zip"),
        (_zip(), "text/csv", "application/zip"),
        (b'{"project": "apollo",', "application/json", "text/plain"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", "text/plain"),
        (b'{"budget": NaN}', "application/json", "text/plain"),
        (b'{"budget": [Infinity, -Infinity]}', "application/json", "text/plain"),
    ],
    ids=[
        "png-as-text",
        "png-as-jpeg",
        "text-as-png",
        "jpeg-as-pdf",
        "pdf-as-text",
        "zip-as-pdf",
        "zip-as-csv",
        "broken-json",
        "absurdly-nested-json",
        "json-with-nan",
        "json-with-infinity",
    ],
)
def test_a_spoofed_type_is_refused_and_nothing_is_stored(
    api, member, acme, private_root, settings, content, media_type, detected
):
    settings.ATTACHMENT_MAX_BYTES = 1024 * 1024

    response = _upload(api.as_user(member, acme), content, media_type)

    assert response.status_code == 415
    assert response.json() == {
        "error": {
            "code": "UNSUPPORTED_MEDIA_TYPE",
            "message": f"The content is not {media_type}.",
            "details": {"declared": media_type, "detected": detected},
        }
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


@pytest.mark.parametrize(
    ("content", "media_type"),
    [
        ("café;menu\n".encode("latin-1"), "text/csv"),
        ("项目;状态\n阿波罗;延期\n".encode("gbk"), "text/csv"),
        ("project status\n".encode("utf-16"), "text/plain"),
        (b'{"project": "caf\xe9"}', "application/json"),
        (b"plain\x00text", "text/plain"),
    ],
    ids=["latin-1-csv", "gbk-csv", "utf-16-text", "latin-1-json", "text-with-nul"],
)
def test_text_that_is_not_utf_8_is_refused_saying_text_must_be_utf_8(
    api, member, acme, private_root, content, media_type
):
    """A CSV as Excel writes it on a Windows set to Chinese is GBK: it was refused as "not
    text/csv" only, which told the uploader nothing of what to change."""
    response = _upload(api.as_user(member, acme), content, media_type)

    assert response.status_code == 415
    assert response.json() == {
        "error": {
            "code": "UNSUPPORTED_MEDIA_TYPE",
            "message": (
                f"The content is not {media_type}: text must be UTF-8, without NUL characters."
            ),
            "details": {
                "declared": media_type,
                "detected": "application/octet-stream",
                "required_encoding": "utf-8",
            },
        }
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


@pytest.mark.parametrize(
    ("content", "media_type"),
    [
        (_zip(), "application/zip"),
        (b"<html><script>alert(1)</script></html>", "text/html"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"),
        (TEXT, "application/octet-stream"),
    ],
    ids=["zip", "html", "svg", "octet-stream"],
)
def test_a_type_not_on_the_allowlist_is_refused(
    api, member, acme, private_root, settings, content, media_type
):
    response = _upload(api.as_user(member, acme), content, media_type)

    assert response.status_code == 415
    assert response.json() == {
        "error": {
            "code": "UNSUPPORTED_MEDIA_TYPE",
            "message": "This media type is not accepted.",
            "details": {"declared": media_type, "allowed": settings.ATTACHMENT_MEDIA_TYPES},
        }
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_a_file_over_the_limit_inside_a_small_body_is_refused(api, member, acme, private_root):
    response = _upload(api.as_user(member, acme), b"x" * (MAX_BYTES + 1), "text/plain")

    assert response.status_code == 413
    assert response.json() == {
        "error": {
            "code": "PAYLOAD_TOO_LARGE",
            "message": "The file is too large.",
            "details": {"max_bytes": MAX_BYTES},
        }
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(
    api, member, acme, private_root
):
    body = _multipart(b"x" * (MAX_BYTES + OVERHEAD + 1), "text/plain")

    response = api.as_user(member, acme).generic("POST", URL, body, content_type=MULTIPART_CONTENT)

    assert response.status_code == 413
    assert response.json() == {
        "error": {
            "code": "PAYLOAD_TOO_LARGE",
            "message": "The request body is too large.",
            "details": {"max_bytes": MAX_BYTES + OVERHEAD, "declared_bytes": len(body)},
        }
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_form_fields_over_djangos_memory_limit_are_payload_too_large(
    api, member, acme, private_root, settings
):
    # Django raises RequestDataTooBig (a 400 by default) for form fields past this limit
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
    data = {"file": SimpleUploadedFile("a.txt", TEXT), "note": "x" * 200}

    response = api.as_user(member, acme).post(URL, data, format="multipart")

    assert response.status_code == 413
    assert response.json() == {
        "error": {
            "code": "PAYLOAD_TOO_LARGE",
            "message": "The request body is too large.",
            "details": {},
        }
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_request_data_too_big_outside_drf_is_payload_too_large(rf):
    response = handler400(rf.post(URL), RequestDataTooBig())

    assert response.status_code == 413
    assert json.loads(response.content)["error"]["code"] == "PAYLOAD_TOO_LARGE"


@pytest.mark.parametrize("declared", ["-1", "1_0", "\u0663", " 10", "+10"])
def test_a_content_length_that_is_not_digits_is_refused(api, member, acme, declared):
    """Content-Length is digits only (RFC 9110): Python's int() also reads "1_0", Arabic-Indic
    digits, spaces and a sign, and the view then read a body of another length than sent."""
    response = api.as_user(member, acme).generic(
        "POST", URL, _multipart(TEXT, "text/plain"), MULTIPART_CONTENT, CONTENT_LENGTH=declared
    )

    assert response.status_code == 400
    assert response.json()["error"] == {
        "code": "VALIDATION_ERROR",
        "message": "Content-Length is not a number of bytes.",
        "details": {},
    }


def test_other_endpoints_keep_the_json_body_limit(api, member, acme, settings):
    body = json.dumps({"channel": "api", "parts": [{"type": "text", "text": "x" * MAX_BYTES}]})
    settings.API_MAX_BODY_BYTES = len(body) - 1

    response = api.as_user(member, acme).post(
        MESSAGES, body, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k1"
    )

    assert response.status_code == 413
    assert response.json()["error"]["details"] == {
        "max_bytes": len(body) - 1,
        "declared_bytes": len(body),
    }
    assert _row_counts() == NOTHING


def _chunked(client, stream, *, path: str = URL, content_type: str = MULTIPART_CONTENT):
    """A WSGI request without Content-Length, as a server hands over a chunked body: the
    de-chunked bytes in wsgi.input."""
    return client.generic(
        "POST",
        path,
        content_type=content_type,
        HTTP_TRANSFER_ENCODING="chunked",
        **{"wsgi.input": stream},
    )


def test_a_chunked_body_over_the_limit_is_refused_after_reading_one_byte_past_it(
    api, member, acme, private_root
):
    limit = MAX_BYTES + OVERHEAD
    stream = io.BytesIO(_multipart(b"x" * (limit * 4), "text/plain"))

    response = _chunked(api.as_user(member, acme), stream)

    assert response.status_code == 413
    assert response.json() == {
        "error": {
            "code": "PAYLOAD_TOO_LARGE",
            "message": "The request body is too large.",
            "details": {"max_bytes": limit},
        }
    }
    assert stream.tell() == limit + 1
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_a_chunked_body_over_the_limit_is_refused_through_the_test_clients_payload(
    api, member, acme
):
    # the test client's own wsgi.input, with the Content-Length it sets removed
    body = _multipart(b"x" * (MAX_BYTES + OVERHEAD), "text/plain")

    response = api.as_user(member, acme).generic(
        "POST",
        URL,
        body,
        content_type=MULTIPART_CONTENT,
        HTTP_TRANSFER_ENCODING="chunked",
        CONTENT_LENGTH="",
    )

    assert response.status_code == 413
    assert not Attachment.objects.exists()


def test_a_chunked_body_within_the_limit_is_read_and_stored(api, member, acme, private_root):
    response = _chunked(api.as_user(member, acme), io.BytesIO(_multipart(PNG, "image/png")))

    assert response.status_code == 201, response.json()
    assert response.json()["sha256"] == hashlib.sha256(PNG).hexdigest()
    assert (private_root / Attachment.objects.get().file.name).read_bytes() == PNG


def test_a_chunked_json_body_over_the_limit_is_refused_on_other_endpoints(
    api, member, acme, settings
):
    settings.API_MAX_BODY_BYTES = 100
    body = json.dumps({"channel": "api", "parts": [{"type": "text", "text": "x" * 200}]})

    response = _chunked(
        api.as_user(member, acme),
        io.BytesIO(body.encode()),
        path=MESSAGES,
        content_type="application/json",
    )

    assert response.status_code == 413
    assert response.json()["error"]["details"] == {"max_bytes": 100}
    assert _row_counts() == NOTHING


def _asgi_post(token: str, body: bytes):
    """An ASGI request without Content-Length, through ASGIRequest and the async middleware
    chain. The body arrives whole, as ASGIHandler.read_body hands it over after receiving all
    of it (unbounded: only a proxy or server limit bounds that step)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": URL,
        "query_string": b"",
        "scheme": "http",
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 50000),
        "headers": [
            (b"host", b"testserver"),
            (b"authorization", f"Token {token}".encode()),
            (b"content-type", MULTIPART_CONTENT.encode()),
            (b"transfer-encoding", b"chunked"),
        ],
        "_body_file": FakePayload(body),
    }
    return async_to_sync(AsyncClientHandler())(scope)


def test_under_asgi_a_chunked_body_over_the_limit_is_refused(member, acme, private_root):
    body = _multipart(b"x" * (MAX_BYTES + OVERHEAD), "text/plain")

    response = _asgi_post(_token(member, acme), body)

    assert response.status_code == 413
    assert json.loads(response.content)["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_under_asgi_a_chunked_body_within_the_limit_is_stored(member, acme, private_root):
    response = _asgi_post(_token(member, acme), _multipart(JSON, "application/json"))

    assert response.status_code == 201, response.content
    assert json.loads(response.content)["sha256"] == hashlib.sha256(JSON).hexdigest()
    assert (private_root / Attachment.objects.get().file.name).read_bytes() == JSON


def test_an_empty_file_is_refused(api, member, acme, private_root):
    response = _upload(api.as_user(member, acme), b"", "text/plain")

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "code": "VALIDATION_ERROR",
            "message": "The request is not valid.",
            "details": {"file": ["The submitted file is empty."]},
        }
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


@pytest.mark.parametrize(
    ("data", "details"),
    [
        ({}, {"file": ["No file was submitted."]}),
        (
            {"file": "not a file"},
            {"file": ["The submitted data was not a file. Check the encoding type on the form."]},
        ),
        (
            {"file": SimpleUploadedFile("a.txt", TEXT), "note": "x"},
            {"note": ["Unknown field."]},
        ),
        (
            {"file": [SimpleUploadedFile("a.txt", TEXT), SimpleUploadedFile("b.txt", TEXT)]},
            {"file": ["Send one file per request."]},
        ),
    ],
    ids=["no-file", "text-field", "unknown-field", "two-files"],
)
def test_a_body_without_exactly_one_file_is_refused(api, member, acme, private_root, data, details):
    response = api.as_user(member, acme).post(URL, data, format="multipart")

    assert response.status_code == 400
    assert response.json()["error"] == {
        "code": "VALIDATION_ERROR",
        "message": "The request is not valid.",
        "details": details,
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_a_body_of_more_files_than_django_reads_is_refused_saying_so(
    api, member, acme, private_root, settings
):
    settings.DATA_UPLOAD_MAX_NUMBER_FILES = 3
    files = [SimpleUploadedFile(f"{index}.txt", TEXT) for index in range(4)]

    response = api.as_user(member, acme).post(URL, {"file": files}, format="multipart")

    assert response.status_code == 400
    assert response.json()["error"] == {
        "code": "VALIDATION_ERROR",
        "message": "The request carried more than 3 files.",
        "details": {"max_files": 3},
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_a_json_body_is_refused_as_unsupported(api, member, acme):
    response = api.as_user(member, acme).post(URL, {"file": "x"}, format="json")

    assert response.status_code == 415
    assert response.json()["error"]["code"] == "UNSUPPORTED_MEDIA_TYPE"
    assert not Attachment.objects.exists()


def test_anonymous_uploads_are_refused(client, db, private_root):
    response = client.post(URL, {"file": SimpleUploadedFile("a.txt", TEXT)})

    assert response.status_code == 401
    assert response.json()["error"]["code"] == "AUTHENTICATION_REQUIRED"
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_a_user_who_may_not_start_runs_cannot_upload(api, acme, private_root):
    approver = UserFactory(username="bob")
    membership_add(actor=None, user=approver, tenant=acme, role=Role.APPROVER)

    response = _upload(api.as_user(approver, acme), TEXT, "text/plain")

    assert response.status_code == 403
    assert response.json() == {
        "error": {
            "code": "PERMISSION_DENIED",
            "message": "You may not upload attachments in this tenant.",
            "details": {},
        }
    }
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def test_the_service_refuses_an_empty_file_whoever_calls_it(member, acme, private_root):
    with pytest.raises(ValidationFailed) as refused:
        attachment_store(
            actor=member,
            tenant=acme,
            upload=File(io.BytesIO(b""), name="empty.txt"),
            declared_media_type="text/plain",
        )

    assert refused.value.details == {"file": ["The file is empty."]}
    assert not Attachment.objects.exists()
    assert _stored_files(private_root) == []


def _message(client, *parts: dict, key: str = "key-1"):
    body = {"channel": "api", "parts": [{"type": "text", "text": "Summarise this"}, *parts]}
    return client.post(MESSAGES, body, format="json", HTTP_IDEMPOTENCY_KEY=key)


@pytest.mark.parametrize("owner", ["other-tenant", "other-user", "unknown"])
def test_a_message_may_not_refer_to_an_attachment_the_actor_did_not_upload_here(
    api, member, acme, globex_member, globex, owner
):
    if owner == "other-tenant":
        _upload(api.as_user(globex_member, globex), TEXT, "text/plain")
    elif owner == "other-user":
        colleague = UserFactory(username="frank")
        membership_add(actor=None, user=colleague, tenant=acme, role=Role.MEMBER)
        _upload(api.as_user(colleague, acme), TEXT, "text/plain")
    foreign_id = str(Attachment.objects.get().pk) if owner != "unknown" else str(uuid.uuid4())

    response = _message(api.as_user(member, acme), {"type": "attachment_ref", "id": foreign_id})

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "code": "VALIDATION_ERROR",
            "message": "A part refers to an attachment you cannot use.",
            "details": {
                "parts": [{"index": 1, "id": foreign_id, "message": "No such attachment."}]
            },
        }
    }
    assert _row_counts() == NOTHING


def test_a_message_referring_to_one_attachment_twice_is_refused(api, member, acme):
    """Before, the run read the file once for each reference, each in half the excerpt the
    file would have had, and showed the model both halves as two pieces of evidence."""
    client = api.as_user(member, acme)
    attachment_id = _upload(client, TEXT, "text/plain").json()["id"]
    part = {"type": "attachment_ref", "id": attachment_id}

    response = _message(client, part, {"type": "text", "text": "and again"}, part)

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "code": "VALIDATION_ERROR",
            "message": "A message refers to each attachment once.",
            "details": {
                "parts": [
                    {"index": 3, "id": attachment_id, "message": "Part 1 refers to it already."}
                ]
            },
        }
    }
    assert _row_counts() == NOTHING


def test_a_message_carries_its_attachments_by_digest_never_by_content(api, member, acme):
    client = api.as_user(member, acme)
    uploaded = [
        _upload(client, content, media_type).json()
        for content, media_type in [(CSV, "text/csv"), (PNG, "image/png")]
    ]

    response = _message(
        client, *({"type": "attachment_ref", "id": attachment["id"]} for attachment in uploaded)
    )

    assert response.status_code == 202, response.json()
    run = Run.objects.get(pk=response.json()["run_id"])
    expected = [
        {"type": "text", "text": "Summarise this"},
        *({"type": "attachment_ref", **attachment} for attachment in uploaded),
    ]
    assert run.message["message"]["parts"] == expected
    normalized = run.events.get(type="message.normalized").payload["message"]
    assert normalized["message"]["parts"] == expected
    assert "apollo" not in json.dumps(run.message)


def test_a_retried_message_with_attachments_returns_the_same_run(api, member, acme):
    client = api.as_user(member, acme)
    attachment_id = _upload(client, TEXT, "text/plain").json()["id"]
    part = {"type": "attachment_ref", "id": attachment_id}

    first = _message(client, part)
    second = _message(client, part)

    assert (first.status_code, second.status_code) == (202, 200)
    assert first.json()["run_id"] == second.json()["run_id"]
    assert Run.objects.count() == 1

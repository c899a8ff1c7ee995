"""A deployment serves the admin's and the API documentation's static files from the ASGI
application, once `collectstatic` has put them in STATIC_ROOT."""

import httpx
import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command

from config import asgi


@pytest.fixture
def collected(settings, tmp_path):
    settings.STATIC_ROOT = tmp_path / "static"
    call_command("collectstatic", interactive=False, verbosity=0)
    (tmp_path / "outside.txt").write_text("not a static file")
    return asgi.StaticAssets(asgi.BodyLimit(asgi.django_application))


def _get(application, path: str, *, root_path: str = "") -> httpx.Response:
    """GET as uvicorn asks: under a root path, `path` starts with it."""

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=application, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.get(path)

    return async_to_sync(get)()


def test_the_application_serves_static_files_before_anything_else():
    assert isinstance(asgi.application, asgi.StaticAssets)
    assert isinstance(asgi.application.app, asgi.BodyLimit)


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/static/admin/css/base.css", "text/css"),
        ("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js", "javascript"),
    ],
)
def test_a_collected_static_file_is_served(collected, path, content_type):
    response = _get(collected, path)

    assert response.status_code == 200
    assert content_type in response.headers["content-type"]
    assert response.headers["x-content-type-options"] == "nosniff"
    assert (
        response.headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'"
    )
    assert response.headers["x-frame-options"] == "DENY"
    assert len(response.content) > 1000


def test_a_static_file_is_served_below_the_server_s_root_path(collected):
    response = _get(collected, "/agentgov/static/admin/css/base.css", root_path="/agentgov")

    assert response.status_code == 200
    assert "text/css" in response.headers["content-type"]


def test_without_collectstatic_a_static_file_is_not_found(settings, tmp_path):
    settings.STATIC_ROOT = tmp_path / "never-collected"
    application = asgi.StaticAssets(asgi.BodyLimit(asgi.django_application))

    response = _get(application, "/static/admin/css/base.css")

    assert response.status_code == 404
    assert response.headers["x-frame-options"] == "DENY"


@pytest.mark.parametrize(
    "path",
    ["/static/admin/css/missing.css", "/static/../outside.txt", "/static/%2e%2e/outside.txt"],
)
def test_no_file_outside_the_collected_ones_is_served(collected, path):
    response = _get(collected, path)

    assert response.status_code == 404
    assert b"not a static file" not in response.content


@pytest.mark.django_db
def test_other_paths_reach_django(collected):
    response = _get(collected, "/api/v1/runs")

    assert response.status_code == 401
    assert response.json()["error"]["code"] == "AUTHENTICATION_REQUIRED"

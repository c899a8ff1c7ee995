"""What the platform answers a signed-in person or an API token is never kept by a cache, and
its pages carry the browser's protections."""

import pytest
from django.urls import reverse

from registry.demo import DEMO_PASSWORD
from runs.loop import run_execute
from tests.celery_worker import alice_client
from tests.runs import conftest as runs_fixtures
from tests.runs.conftest import demo_run

pytestmark = pytest.mark.django_db

demo = runs_fixtures.demo


@pytest.fixture
def finished_run(demo):
    run = demo_run(demo, project_id="apollo")
    run_execute(run_id=str(run.pk))
    return run


@pytest.mark.parametrize("page", ["runs:detail", "runs:export", "runs:stream"])
def test_an_auditor_s_run_pages_are_not_kept_by_caches(client, finished_run, page):
    assert client.login(username="carol", password=DEMO_PASSWORD)

    response = client.get(reverse(page, args=[finished_run.pk]))

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["X-Frame-Options"] == "DENY"


@pytest.mark.parametrize("suffix", ["", "/stream"])
def test_an_api_answer_to_a_token_is_not_kept_by_caches(finished_run, suffix):
    response = alice_client().get(
        f"/api/v1/runs/{finished_run.pk}{suffix}", HTTP_ACCEPT="text/event-stream, */*"
    )

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]


def test_a_page_anyone_may_read_is_left_to_the_caches(client):
    response = client.get("/")

    assert response.status_code == 200
    assert not response.has_header("Cache-Control")


def _policy(response) -> dict[str, list[str]]:
    directives = (part.split() for part in response["Content-Security-Policy"].split(";"))
    return {name: values for name, *values in directives}


@pytest.mark.parametrize(
    ("username", "path"),
    [
        ("carol", "runs:detail"),
        ("carol", "runs:history"),
        ("bob", "approvals:queue"),
        ("dave", "/admin/registry/toolversion/"),
        (None, "/api/docs/"),
        (None, "/accounts/login/"),
    ],
)
def test_a_page_runs_only_the_platform_s_own_scripts(client, finished_run, username, path):
    if username:
        assert client.login(username=username, password=DEMO_PASSWORD)
    url = path if path.startswith("/") else reverse(path, **_args(path, finished_run))

    response = client.get(url)

    assert response.status_code == 200
    policy = _policy(response)
    assert policy["script-src"] == ["'self'"]
    assert policy["default-src"] == ["'self'"]
    assert policy["object-src"] == ["'none'"]
    assert policy["frame-ancestors"] == ["'none'"]
    assert policy["form-action"] == ["'self'"]
    assert b"<script>" not in response.content


def _args(path: str, run) -> dict:
    return {"args": [run.pk]} if path == "runs:detail" else {}

"""What `make run` promises, seen in a browser: the seeded registry in the admin with its
history, and the API documentation rendered from local assets."""

import io

import pytest
from django.core.management import call_command
from django_celery_beat.models import CrontabSchedule

from tests.e2e.conftest import log_in

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def seeded(db):
    call_command("seed_demo", stdout=io.StringIO())


def test_a_publisher_sees_the_seeded_registry_and_its_history(
    page, live_server, seeded, http_cookies
):
    log_in(page, live_server, "dave", path="/admin/login/")
    page.wait_for_url(f"{live_server.url}/admin/")

    page.goto(f"{live_server.url}/admin/registry/toolversion/")
    names = sorted(page.locator("#result_list tbody tr th a").all_inner_texts())
    assert names == ["directory_lookup@1.0.0", "mail_send@1.0.0", "project_search@2.0.0"]

    page.click("text=mail_send@1.0.0")
    page.click("a.historylink")
    history = page.inner_text("#change-history")
    assert "published" in history
    assert "draft created" in history
    assert "admin" in history


def test_the_api_documentation_renders_every_registry_endpoint(page, live_server, db):
    page.goto(f"{live_server.url}/api/docs/")

    page.wait_for_selector(".opblock-summary-path")
    paths = {
        element.get_attribute("data-path")
        for element in page.query_selector_all(".opblock-summary-path")
    }
    assert {
        "/api/v1/auth/token/",
        "/api/v1/tools",
        "/api/v1/tools/{id}/publish",
        "/api/v1/skills",
        "/api/v1/skills/{id}/rollback",
    } <= paths
    assert "Agent Governance Platform API" in page.inner_text(".info .title")


def test_the_admin_s_pages_run_under_the_content_security_policy(
    page, live_server, seeded, http_cookies
):
    CrontabSchedule.objects.get_or_create(minute="0", hour="9", day_of_week="1")
    refused = []
    page.on("console", lambda message: refused.append(message.text))
    page.on("pageerror", lambda error: refused.append(str(error)))
    log_in(page, live_server, "admin", path="/admin/login/")

    for path in (
        "/admin/",
        "/admin/registry/toolversion/",
        "/admin/django_celery_beat/periodictask/add/",
        "/api/docs/",
    ):
        response = page.goto(f"{live_server.url}{path}")
        page.wait_for_load_state("networkidle")
        assert response.status == 200, path

    # the periodic task form's own script ran: the crontab's help says what it means
    page.goto(f"{live_server.url}/admin/django_celery_beat/periodictask/add/")
    assert not page.is_visible(".field-crontab_translation")
    page.select_option("#id_crontab", index=1)
    assert "Translation: At 09:00" in page.inner_text(".field-crontab .help")
    assert [text for text in refused if "Content Security Policy" in text] == []

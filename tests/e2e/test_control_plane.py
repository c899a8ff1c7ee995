"""What `make run` promises, seen in a browser: the seeded registry in the admin with its
history, and the API documentation rendered from local assets."""

import io

import pytest
from django.core.management import call_command
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from registry.demo import DEMO_PASSWORD

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def seeded(db):
    call_command("seed_demo", stdout=io.StringIO())


def _log_in(browser, live_server, username: str) -> None:
    browser.delete_all_cookies()
    browser.get(f"{live_server.url}/admin/login/")
    browser.find_element(By.NAME, "username").send_keys(username)
    browser.find_element(By.NAME, "password").send_keys(DEMO_PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    WebDriverWait(browser, 10).until(expected_conditions.url_to_be(f"{live_server.url}/admin/"))


def test_a_publisher_sees_the_seeded_registry_and_its_history(
    browser, live_server, seeded, http_cookies
):
    _log_in(browser, live_server, "dave")

    browser.get(f"{live_server.url}/admin/registry/toolversion/")
    rows = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    names = sorted(row.find_element(By.CSS_SELECTOR, "th a").text for row in rows)
    assert names == ["directory_lookup@1.0.0", "mail_send@1.0.0", "project_search@2.0.0"]

    browser.find_element(By.LINK_TEXT, "mail_send@1.0.0").click()
    browser.find_element(By.LINK_TEXT, "HISTORY").click()
    history = browser.find_element(By.ID, "change-history").text
    assert "published" in history
    assert "draft created" in history
    assert "admin" in history


def test_the_api_documentation_renders_every_registry_endpoint(browser, live_server, db):
    browser.get(f"{live_server.url}/api/docs/")

    WebDriverWait(browser, 15).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, ".opblock-summary-path"))
    )
    paths = {
        element.get_attribute("data-path")
        for element in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")
    }
    assert {
        "/api/v1/auth/token/",
        "/api/v1/tools",
        "/api/v1/tools/{id}/publish",
        "/api/v1/skills",
        "/api/v1/skills/{id}/rollback",
    } <= paths
    assert (
        "Agent Governance Platform API"
        in browser.find_element(By.CSS_SELECTOR, ".info .title").text
    )

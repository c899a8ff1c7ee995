"""Browser tests: Playwright driving Debian's Chromium (scripts/browser.sh installs it;
Playwright's own browser download is never used) against the live test server."""

import os
import shutil

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from registry.demo import DEMO_PASSWORD

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser() -> Browser:
    """One browser per module. Playwright's sync API keeps an event loop running on the
    test's thread while it is open, so the ORM calls the tests make between browser steps are
    allowed for that time only, and the loop is gone before any other module runs."""
    chromium = shutil.which("chromium")
    if not chromium:
        pytest.fail("Debian's Chromium is needed: run scripts/browser.sh (make test does).")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            launched = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            yield launched
            launched.close()
    finally:
        del os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"]


@pytest.fixture
def page(browser: Browser) -> Page:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(10_000)
    yield context.new_page()
    context.close()


@pytest.fixture
def http_cookies(settings):
    """The live test server speaks plain HTTP; production cookies are Secure."""
    settings.SESSION_COOKIE_SECURE = False
    settings.CSRF_COOKIE_SECURE = False


def log_in(page: Page, live_server, username: str, *, path: str = "/accounts/login/") -> None:
    page.goto(f"{live_server.url}{path}")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", DEMO_PASSWORD)
    page.click("[type=submit]")
    page.wait_for_load_state()

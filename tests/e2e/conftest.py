"""Browser tests: Playwright driving Debian's Chromium (scripts/browser.sh installs it;
Playwright's own browser download is never used) against the live test server."""

import os
import shutil

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from registry.demo import DEMO_PASSWORD

# Playwright's sync API keeps an event loop on the test's thread; the ORM calls the tests make
# between browser steps are still plain synchronous calls.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def browser() -> Browser:
    chromium = shutil.which("chromium")
    if not chromium:
        pytest.fail("Debian's Chromium is needed: run scripts/browser.sh (make test does).")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


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

"""Browser tests: Debian's Chromium driven by its chromedriver, against the live test server."""

import shutil

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
)


@pytest.fixture(scope="session")
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.fail(
            "Chromium and chromedriver are needed: run scripts/browser.sh (make test does)."
        )
    options = Options()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    session = webdriver.Chrome(options=options, service=Service(driver))
    session.implicitly_wait(5)
    yield session
    session.quit()


@pytest.fixture
def http_cookies(settings):
    """The live test server speaks plain HTTP; production cookies are Secure."""
    settings.SESSION_COOKIE_SECURE = False
    settings.CSRF_COOKIE_SECURE = False

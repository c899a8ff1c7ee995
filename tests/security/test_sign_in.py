"""The sign-in pages count password tries with the API's token exchange: a client that used up
its allowance on any of them is refused on all of them, before its password is checked."""

import re

import pytest
from django.test import Client
from rest_framework.test import APIClient

from runs.api.throttles import PasswordTries
from tests.registry.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.django_db

PAGES = ["/accounts/login/", "/admin/login/"]


@pytest.fixture
def two_tries(monkeypatch):
    monkeypatch.setattr(PasswordTries, "THROTTLE_RATES", {"auth_token": "2/min"})


@pytest.fixture
def alice(db):
    return UserFactory(username="alice", is_staff=True)


def sign_in(client, page, password):
    return client.post(page, {"username": "alice", "password": password})


@pytest.mark.parametrize("page", PAGES)
def test_a_client_past_its_tries_is_refused_even_with_the_right_password(
    client, alice, two_tries, page
):
    # given a client that guessed wrong twice
    assert [sign_in(client, page, "guess").status_code for _ in range(2)] == [200, 200]

    # when it posts the right password
    refused = sign_in(client, page, PASSWORD)

    # then it is refused, told when to come back, and not signed in
    assert refused.status_code == 429
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert b"Too many sign-in attempts" in refused.content
    assert "_auth_user_id" not in client.session


def test_the_pages_and_the_token_exchange_count_one_allowance(client, alice, two_tries):
    api = APIClient()
    for _ in range(2):
        api.post("/api/v1/auth/token/", {"username": "alice", "password": "guess"}, format="json")

    assert sign_in(client, "/admin/login/", PASSWORD).status_code == 429
    assert sign_in(client, "/accounts/login/", PASSWORD).status_code == 429


def test_showing_the_form_is_not_a_try(client, alice, two_tries):
    for _ in range(5):
        assert client.get("/accounts/login/").status_code == 200

    signed_in = sign_in(client, "/accounts/login/", PASSWORD)

    assert signed_in.status_code == 302
    assert "_auth_user_id" in client.session


def test_with_redis_down_a_sign_in_is_refused_503(client, alice, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"

    refused = sign_in(client, "/accounts/login/", PASSWORD)

    assert refused.status_code == 503
    assert int(refused["Retry-After"]) > 0
    assert "_auth_user_id" not in client.session


def test_a_person_signed_in_on_the_pages_signs_out_from_them(alice):
    # given alice, signed in on the pages (a browser: CSRF is checked)
    browser = Client(enforce_csrf_checks=True)
    browser.get("/accounts/login/")
    sign_in_form = {"csrfmiddlewaretoken": browser.cookies["csrftoken"].value}
    browser.post("/accounts/login/", {**sign_in_form, "username": "alice", "password": PASSWORD})
    assert "_auth_user_id" in browser.session

    # when she uses the sign-out button a page shows her
    page = browser.get("/memories/")
    html = page.content.decode()
    form = re.search(r'<form method="post" action="([^"]+)"[^>]*>(.*?)</form>', html, re.S)
    assert form is not None, "no sign-out form"
    assert "Sign out" in form.group(2)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.group(2)).group(1)
    signed_out = browser.post(form.group(1), {"csrfmiddlewaretoken": token})

    # then she is signed out and back at the sign-in page
    assert signed_out.status_code == 302
    assert signed_out["Location"] == "/accounts/login/"
    assert "_auth_user_id" not in browser.session
    assert browser.get("/memories/").status_code == 302


def test_the_sign_in_page_shows_no_sign_out_button(client):
    assert b"Sign out" not in client.get("/accounts/login/").content

"""The sign-in pages count password tries with the API's token exchange: a client that used up
its allowance on any of them is refused on all of them, before its password is checked."""

import re

import pytest
from django.test import Client
from rest_framework.test import APIClient

from runs.api.throttles import AccountTries, PasswordTries
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


@pytest.fixture
def three_tries_an_account(monkeypatch):
    monkeypatch.setattr(AccountTries, "THROTTLE_RATES", {"auth_account": "3/hour"})


def test_guesses_of_one_account_from_many_addresses_are_throttled(
    member, auditor, three_tries_an_account
):
    # given three guesses of alice's password, each from another address
    wrong = {"username": "alice", "password": "guess"}
    guesses = [
        APIClient().post("/api/v1/auth/token/", wrong, format="json", REMOTE_ADDR=f"10.0.0.{n}")
        for n in range(3)
    ]

    # when a fourth address tries, on the API and on either page, even with the right password
    api = APIClient().post(
        "/api/v1/auth/token/",
        {"username": "alice", "password": PASSWORD},
        format="json",
        REMOTE_ADDR="10.0.1.1",
    )
    pages = [
        Client(REMOTE_ADDR=f"10.0.2.{n}").post(page, {"username": "alice", "password": PASSWORD})
        for n, page in enumerate(PAGES)
    ]

    # then each is refused with 429 and told when to come back; another account is not
    assert [guess.status_code for guess in guesses] == [400] * 3
    assert api.status_code == 429
    assert api.json()["error"]["code"] == "RATE_LIMITED"
    assert 1 <= int(api["Retry-After"]) <= 3600
    assert [page.status_code for page in pages] == [429, 429]
    assert all(1 <= int(page["Retry-After"]) <= 3600 for page in pages)
    carol = {"username": "carol", "password": PASSWORD}
    other = APIClient().post("/api/v1/auth/token/", carol, format="json", REMOTE_ADDR="10.0.3.1")
    assert other.status_code == 200


def test_a_try_refused_for_its_address_spends_nothing_of_the_account(
    member, two_tries, three_tries_an_account
):
    # given a client that used up its address's two tries on other accounts
    client = APIClient()
    for _ in range(2):
        client.post("/api/v1/auth/token/", {"username": "mallory", "password": "x"}, format="json")

    # when it goes on guessing alice's password
    refused = [
        client.post("/api/v1/auth/token/", {"username": "alice", "password": "x"}, format="json")
        for _ in range(5)
    ]

    # then it is refused for its address, and alice still has her three tries elsewhere
    assert [answer.status_code for answer in refused] == [429] * 5
    right = {"username": "alice", "password": PASSWORD}
    elsewhere = [
        APIClient().post("/api/v1/auth/token/", right, format="json", REMOTE_ADDR=f"10.9.0.{n}")
        for n in range(4)
    ]
    assert [answer.status_code for answer in elsewhere] == [200, 200, 200, 429]


def test_another_spelling_of_the_username_counts_against_the_same_account(
    member, three_tries_an_account
):
    # given three guesses of alice's password under spellings the sign-in page takes for hers
    spellings = [" alice", "alice\t", "\uff41\uff4c\uff49\uff43\uff45"]
    guesses = [
        Client(REMOTE_ADDR=f"10.0.0.{n}").post(
            "/accounts/login/", {"username": spelling, "password": "guess"}
        )
        for n, spelling in enumerate(spellings)
    ]

    # when a fourth address signs in as alice
    fourth = APIClient().post(
        "/api/v1/auth/token/",
        {"username": "alice", "password": PASSWORD},
        format="json",
        REMOTE_ADDR="10.0.1.1",
    )

    # then the guesses were hers, and her allowance is spent
    assert [guess.status_code for guess in guesses] == [200] * 3
    assert fourth.status_code == 429


def change_password(client, old_password, *, address="127.0.0.1"):
    new_password = "a-new-passphrase-for-alice-9"
    return client.post(
        "/admin/password_change/",
        {
            "old_password": old_password,
            "new_password1": new_password,
            "new_password2": new_password,
        },
        REMOTE_ADDR=address,
    )


def test_guesses_of_the_old_password_on_the_password_change_page_are_throttled(
    client, alice, two_tries
):
    # given a session of alice's (left open, or taken) that guessed her password twice on the
    # password change page, which checks the old password
    client.force_login(alice)
    assert [change_password(client, "guess").status_code for _ in range(2)] == [200, 200]

    # when it posts the right one
    refused = change_password(client, PASSWORD)

    # then it is refused, told in the words of a password change when to come back, and the
    # password is unchanged
    assert refused.status_code == 429
    wait = int(refused["Retry-After"])
    assert 1 <= wait <= 60
    page = refused.content.decode()
    assert f"Too many password-change attempts; try again in {wait} seconds." in page
    assert "sign-in" not in page.lower()
    alice.refresh_from_db()
    assert alice.check_password(PASSWORD)


def test_guesses_of_the_old_password_count_against_the_account_from_any_address(
    alice, three_tries_an_account
):
    # given three guesses of alice's password on the password change page, from three addresses
    session = Client()
    session.force_login(alice)
    guesses = [change_password(session, "guess", address=f"10.0.0.{n}") for n in range(3)]

    # when a fourth address asks for a token as alice, with her password
    api = APIClient().post(
        "/api/v1/auth/token/",
        {"username": "alice", "password": PASSWORD},
        format="json",
        REMOTE_ADDR="10.0.1.1",
    )

    # then the guesses were hers, and her allowance is spent
    assert [guess.status_code for guess in guesses] == [200] * 3
    assert api.status_code == 429

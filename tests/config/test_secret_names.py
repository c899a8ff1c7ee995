"""Which field names hold secrets (config.secret_names): one rule for tool results, traces,
pages, memory and model parameters."""

import pytest

from config.secret_names import secret_key


@pytest.mark.parametrize(
    "name",
    [
        "access_token",
        "accessToken",
        "ACCESS_TOKEN",
        "accesstoken",
        "refresh_tokens",
        "id_token",
        "csrf_token",
        "token",
        "api_key",
        "apiKey",
        "APIKey",
        "x-api-key",
        "X-API-KEY",
        "apikey",
        "AWS_SECRET_ACCESS_KEY",
        "secretAccessKey",
        "private_key",
        "privateKey",
        "signing_key",
        "ssh_keys",
        "client_secret",
        "clientSecret",
        "clientsecret",
        "password",
        "db_password",
        "dbPassword",
        "passwd",
        "dbpassword",
        "passphrase",
        "sessionkey",
        "Authorization",
        "Set-Cookie",
        "credentials",
    ],
)
def test_names_that_hold_secrets(name):
    assert secret_key(name) is True


@pytest.mark.parametrize(
    "name",
    [
        "input_tokens",
        "max_tokens",
        "max_output_tokens",
        "tokens_used",
        "token_count",
        "tokenUsage",
        "nextPageToken",
        "continuation_token",
        "tokenizer",
        "idempotency_key",
        "primary_key",
        "public_key",
        "publicKey",
        "cache_key",
        "key",
        "keys",
        "key_results",
        "keyResults",
        "keywords",
        "monkey",
        "secretary",
        "passenger",
        "capability_hash",
    ],
)
def test_names_that_only_sound_like_secrets(name):
    assert secret_key(name) is False


def test_a_long_name_is_answered_without_being_kept():
    long_name = "api_key_" + "x" * 1_000_000
    short_name = "x_api_key_7f3a"
    before = secret_key.cache_info().currsize

    assert secret_key(long_name) is True
    assert secret_key(short_name) is True

    assert secret_key.cache_info().currsize == before + 1

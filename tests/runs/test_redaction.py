"""Redaction before anything is stored in a trace or shown (runs.redaction)."""

import base64
import urllib.parse

import pytest

from config.secret_names import secret_key
from runs import redaction
from runs.redaction import REDACTED, mask_email, redact
from runs.tools.envelope import strip_secrets


def test_emails_are_masked_for_viewers_without_clearance_only():
    record = {"to": ["li.wei@acme.example"], "note": "ask hank@globex.example"}

    assert redact(record) == {"to": ["l***@acme.example"], "note": "ask h***@globex.example"}
    assert redact(record, cleared=True) == record


def test_fields_a_tool_contract_marks_sensitive_are_replaced_without_clearance():
    envelope = {"raw": {"display_name": "Li Wei", "role": "lead"}}

    masked = redact(envelope, sensitive=frozenset({"display_name"}))

    assert masked == {"raw": {"display_name": REDACTED, "role": "lead"}}
    assert redact(envelope, cleared=True, sensitive=frozenset({"display_name"})) == envelope


def test_what_a_tool_returned_under_a_sensitive_field_is_masked_inside_text_as_a_whole_word():
    texts = frozenset(
        redaction.sensitive_texts(["Li Wei", "Li Wei Chen", "Li", 120000, True, {"x": " Ann "}])
    )
    record = {
        "body": "Dear Li Wei, and LI  WEI CHEN; Lin, Li Weiss, Ann-Marie, ANNa, 1200001, 120000.",
        "Li Wei": "a key is left",
    }

    assert texts == {"Li Wei", "Li Wei Chen", "120000", "Ann"}
    assert redact(record, texts=texts) == {
        "body": "Dear [redacted], and [redacted]; Lin, Li Weiss, [redacted]-Marie, ANNa, 1200001, "
        "[redacted].",
        "Li Wei": "a key is left",
    }
    assert redact(record, cleared=True, texts=texts) == record
    # as a refused argument is quoted in a tool.rejected event's reason
    refused = {"reason": "project_id: 'Li Wei' is not of type 'integer'"}
    assert redact(refused, texts=texts) == {
        "reason": "project_id: '[redacted]' is not of type 'integer'"
    }


@pytest.mark.parametrize(
    "written",
    [
        # NFD: "e" and a combining diaeresis
        "Zoe\u0308 Brandt",
        # as JSON text holds it, escaped once or twice (JSON inside JSON), in either case
        "Zo\\u00eb Brandt",
        "ZO\\\\u00CB\\nBRANDT",
        "Zoe\\u0308\\u00a0Brandt",
        # as HTML holds it
        "Zo&euml; Brandt",
        "Zo&#235;&nbsp;Brandt",
        "zo&#xEB; brandt",
    ],
)
def test_a_sensitive_text_beyond_ascii_is_masked_however_the_text_writes_it(written):
    texts = frozenset(redaction.sensitive_texts(["Zoë Brandt"]))

    assert redaction.texts_masked(f"Dear {written}, hi", texts) == "Dear [redacted], hi"
    assert redaction.texts_masked(f'"{written}\\n"', texts) == '"[redacted]\\n"'


def test_a_sensitive_text_is_masked_in_its_escaped_forms_as_a_whole_word_only():
    texts = frozenset(redaction.sensitive_texts(["O'Hara", "Zoe", "Zoë"]))

    assert redaction.texts_masked(
        "O&#x27;Hara, O\\u0027hara, O&apos;Hara; \\nZoe, Zoe\u0308, Zoe\u0301, Zoës, "
        "Zo\\u00ebs, Zoey",
        texts,
    ) == (
        "[redacted], [redacted], [redacted]; \\n[redacted], [redacted], Zoe\u0301, Zoës, "
        "Zo\\u00ebs, Zoey"
    )


@pytest.mark.parametrize(
    "value",
    [
        "Bearer abcdefghijklmnop",
        "key sk-abcdefghijklmnopqrstu",
        # the shortest key known by its prefix alone: sk- and 12 characters
        "sk-abcdefghijkl",
        "ghp_abcdefghijklmnopqrstuvwx",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
        # a JWT with neither - nor _ (only its "eyJ" says it may be one)
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5NXgL0n3I9PlFUP0THsR8U",
        # this platform's own API tokens (agt_ and 43 URL-safe characters), with or without
        # their scheme
        "Authorization: Token agt_Zk3v9QwXr7Tn2LpB8sYd5Hc1Mf6Ja4Ue0Gi-Ko_Wq2E",
        "my key is agt_Zk3v9QwXr7Tn2LpB8sYd5Hc1Mf6Ja4Ue0Gi-Ko_Wq2E",
        # an auth scheme is case-insensitive (RFC 9110, 11.1)
        "authorization: bearer 4f9c2a7e1b8d6c3a5e0f",
        # other services' credentials: Basic (user:s3cret in base64), a hex token, a header
        # with any scheme or none
        "Basic dXNlcjpzM2NyZXQ=",
        "the proxy wants basic YWxpY2U6aHVudGVyMg==",
        "Token 9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b",
        "Authorization: Splunk 5e9f1c3a-2b4d-4c1e-9f0a-7b3c2d1e0f9a",
        "authorization: 4f9c2a7e1b8d6c3a5e0f",
        # the same pasted as JSON or Python, unpadded, or as a field
        '{"Authorization": "Splunk 5e9f1c3a-2b4d-4c1e-9f0a-7b3c2d1e0f9a"}',
        "'Authorization': 'Token 4f9c2a7e1b8d6c3a5e0f4f9c'",
        "Basic dXNlcjpzM2NyZXQ",
        "token: 9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b",
        # keys known by their prefixes: AWS, GitHub, Google
        "use AKIAIOSFODNN7EXAMPLE",
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz",
        "ghs_16C7e42F292c6912E7710c838347Ae178B4a",
        "AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY",
        # Slack, GitLab, Hugging Face, npm, Stripe webhook and restricted keys
        "xapp-1-A0123456789-0123456789-abcdef0123456789",
        "xoxe-1-abcdef0123456789abcdef",
        "glpat-abcdefghij0123456789",
        "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH",
        "npm_abcdefghijklmnopqrstuvwxyz0123456789",
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "rk_live_51H8abcdefghijklmnop",
        # incoming webhooks: the URL is the credential
        "post to https://hooks.slack.com/services/T0123ABCD/B0456EFGH/AbCdEfGhIjKlMnOpQrStUvWx",
        "https://discord.com/api/webhooks/123456789012345678/AbC-dEf_GhIjKlMnOpQr",
    ],
)
def test_secrets_in_text_are_removed_even_for_cleared_viewers(value):
    text = redact({"text": value}, cleared=True)["text"]

    assert REDACTED in text
    assert value.split()[-1] not in text


@pytest.mark.parametrize(
    "value",
    [
        "a basic understanding of the project",
        "Basic abcdefgh",
        "the token budget is 60000 tokens",
        "Token limits apply",
        "token 12345",
        "Authorization: required for every send",
        "authorization = pending approval",
        "Authorization: see RFC-7235 for details",
        "Authorization: ticket INC-20240511 approved",
        "prior authorization: PA-2024-0012 pending",
        "authorization = v1.2.3-rc1",
        # a name that does not end in a secret, or a value that does not look like one: prose,
        # JSON, code, dates, ids, paths
        "password: see the vault",
        "api_key: required",
        "idempotency_key=send-2024-0012",
        "public_key=ssh-ed25519",
        "the key risks: 3 open",
        "passport: X1234567",
        "primarykey=order2024id",
        "monkey: abc123def456",
        "session_id=8f14e45f",
        '{"has_secret": false}',
        '{"id": 7, "password_set": false}',
        '{"items": [{"token_expires": 1715420000}]}',
        'password = request.POST["password"]',
        "api_key = settings.OPENAI_API_KEY",
        "def check(password=None, token=DEFAULT_TOKEN):",
        "token_expiry=2024-05-11T10:00:00Z",
        '{"password_changed_at": "2024-05-11"}',
        "SESSION_COOKIE_AGE=1209600",
        "eos_token_id: 128001",
        "Token: ERC-20",
        "private_key_file=/etc/ssl/private/server.key",
        "secret_name=prod/db-password",
        "upstream token-service:8080/v1/issue",
        "secret = base64.b64encode(data)",
        "access_token = oauth2_client.fetch_token(url)",
        "apiKey: process.env.OPENAI_API_KEY_V2,",
        "session_key: 2024-05-11T10:00:00Z",
        "my_secret: v1.2.3-rc1",
        "Reset your password: https://accounts.example.com/reset/v2",
        # SQL names and identifiers that share a key's prefix
        'duplicate key value violates unique constraint "pk_customer_orders"',
        "sk_orders_customer_idx",
        "hf_model_name_base_large_v2_checkpoint",
        # a port before a list of addresses is no URL's password
        "http://example.com:8080,bob@example.com",
        "http://localhost:8000;alice@example.com",
        # a URL with a port or a user, and no password
        "https://acme.example:8443/status?page=2",
        "ssh://git@git.acme.example/platform.git",
    ],
)
def test_ordinary_words_after_a_scheme_name_are_kept(value):
    assert redact({"text": value}, cleared=True)["text"] == value


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("password=hunter2secret", "password=[redacted]"),
        ("password:      hunter2secret", "password:      [redacted]"),
        ("DB_PASSWORD=Xy7!pq2Lm next", "DB_PASSWORD=[redacted] next"),
        (
            "aws_secret_access_key=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            "aws_secret_access_key=[redacted]",
        ),
        ("api_key=9f8e7d6c5b4a39281706f5e4d3c2b1a0", "api_key=[redacted]"),
        # a name written as one word that names a secret by itself
        ("PGPASSWORD=S3cretPass1 psql -h db", "PGPASSWORD=[redacted] psql -h db"),
        ('{"apikey": "Zx9-Qw7-Er5-Ty3"}', '{"apikey": "[redacted]"}'),
        ("accesstoken=abc123def456", "accesstoken=[redacted]"),
        # a quoted value is taken whole, escapes and all, and the JSON stays JSON
        ('{"client_secret": "Zx9-Qw7-Er5-Ty3"}', '{"client_secret": "[redacted]"}'),
        ('{"password": "correct horse battery"}', '{"password": "[redacted]"}'),
        ('{"password": "abcdef\\"gh1", "user": "li"}', '{"password": "[redacted]", "user": "li"}'),
        # in a query string, first or later, behind a scheme or not
        (
            "https://api.example/v1?api_key=Zx9Qw7Er5Ty3&x=1",
            "https://api.example/v1?api_key=[redacted]&x=1",
        ),
        (
            "https://api.example/v1?apikey=Zx9Qw7Er5Ty3&x=1",
            "https://api.example/v1?apikey=[redacted]&x=1",
        ),
        (
            "url: https://api.example/v1?user=li&apiKey=Zx9Qw7Er5Ty3",
            "url: https://api.example/v1?user=li&apiKey=[redacted]",
        ),
        (
            "redirect=https://acme.example/login?password=hunter2x",
            "redirect=https://acme.example/login?password=[redacted]",
        ),
        (
            "see [docs](https://x.example/?access_token=abc123def456)",
            "see [docs](https://x.example/?access_token=[redacted])",
        ),
        # a command line, Markdown, code
        ("mysql -u root --password=S3cretPass1 app", "mysql -u root --password=[redacted] app"),
        ("**Password:** S3cretPass1", "**Password:** [redacted]"),
        ('if password == "S3cretPass1":', 'if password == "[redacted]":'),
        ('password := "S3cretPass1"', 'password := "[redacted]"'),
        # a long quoted value, and JSON text inside JSON text
        (
            '{"SessionToken": "IQoJb3JpZ2luX2VjEOr//' + "A" * 400 + '"}',
            '{"SessionToken": "[redacted]"}',
        ),
        (
            '"SecretString": "{\\"password\\":\\"S3cretPass1\\",\\"user\\":\\"app\\"}"',
            '"SecretString": "{\\"password\\":\\"[redacted]\\",\\"user\\":\\"app\\"}"',
        ),
        # Azure: a storage account key, a user@server in a URL
        (
            "AccountName=x;AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq==;",
            "AccountName=x;AccountKey=[redacted];",
        ),
        (
            "postgresql://admin@server:Passw0rd1@server.postgres.database.azure.com/db",
            "postgresql://admin@server:[redacted]@server.postgres.database.azure.com/db",
        ),
    ],
)
def test_a_value_given_to_a_name_ending_in_a_secret_is_removed_and_the_rest_kept(text, kept):
    assert redact(text, cleared=True) == kept


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("我的密码是 Tr0ub4dor&3\uff0c请记住", "我的密码是 [redacted]\uff0c请记住"),
        ("验证码\uff1a482913", "验证码\uff1a[redacted]"),
        ("一次性口令 482913", "一次性口令 [redacted]"),
        ("访问令牌 abcdefghijklmnop", "访问令牌 [redacted]"),
        ("私钥=Zx9Qw7Er5Ty3", "私钥=[redacted]"),
        # a question about one, a word that goes on in Chinese, a short word: nothing to remove
        ("密码是什么\uff1f", "密码是什么\uff1f"),
        ("密码策略 v2 已发布", "密码策略 v2 已发布"),
        ("密码 reset 流程", "密码 reset 流程"),
        ("项目代码 123456", "项目代码 123456"),
    ],
)
def test_a_secret_given_in_chinese_is_removed_and_the_rest_kept(text, kept):
    assert redact(text, cleared=True) == kept


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        # typed by an input method in full-width mode: the value, or the whole line
        (
            "wifi 密码\uff1a\uff48\uff55\uff4e\uff54\uff45\uff52\uff12\uff12",
            "wifi 密码\uff1a[redacted]",
        ),
        (
            "\uff50\uff41\uff53\uff53\uff57\uff4f\uff52\uff44\uff1d\uff54\uff52\uff4f\uff55\uff42\uff14\uff44\uff4f\uff52\uff13\u3000好的",
            "\uff50\uff41\uff53\uff53\uff57\uff4f\uff52\uff44\uff1d[redacted]\u3000好的",
        ),
        (
            "令牌\u3000\uff47\uff48\uff50\uff3f"
            + "\uff41\uff42\uff43\uff11\uff12\uff13" * 3
            + "。",
            "令牌\u3000[redacted]。",
        ),
        # full-width text without a secret is kept as it was written
        (
            "\uff12\uff10\uff12\uff16年进度\uff1a\uff41\uff50\uff4f\uff4c\uff4c\uff4f",
            "\uff12\uff10\uff12\uff16年进度\uff1a\uff41\uff50\uff4f\uff4c\uff4c\uff4f",
        ),
    ],
    ids=["chinese-word", "ascii-name", "prefixed-token", "no-secret"],
)
def test_a_secret_typed_in_full_width_characters_is_removed_and_the_rest_kept_as_typed(text, kept):
    assert redact(text, cleared=True) == kept


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        # inside a prefixed key, a bearer token, the word that names a secret
        ("key: sk-\u200bproj4f9c2a7eABCDEFGH12 ok", "key: [redacted] ok"),
        ("key: sk-proj4f9c2a7e\u2060ABCDEFGH12 ok", "key: [redacted] ok"),
        ("Bearer abcdefgh\u200b12345678 sent", "Bearer [redacted] sent"),
        (
            "to\u200bken 9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b",
            "to\u200bken [redacted]",
        ),
        ("ghp_\u00adabcdefghijklmnop1234", "[redacted]"),
        ("api\ufeff_key=Zx9Qw7Er5Ty3 \u200d👍", "api\ufeff_key=[redacted] \u200d👍"),
        # beside full-width characters, and text without a secret kept as it was written
        (
            "令牌\u3000\uff47\uff48\uff50\uff3f\u200b" + "abc123" * 3 + "。",
            "令牌\u3000[redacted]。",
        ),
        ("zero\u200bwidth \u200cjoiners kept", "zero\u200bwidth \u200cjoiners kept"),
    ],
    ids=[
        "after-prefix",
        "word-joiner-inside",
        "bearer",
        "inside-the-word",
        "soft-hyphen",
        "in-the-name",
        "full-width",
        "no-secret",
    ],
)
def test_a_secret_with_invisible_characters_inside_is_removed(text, kept):
    """A zero-width space, a word joiner or a soft hyphen shows nothing, and a token copied
    from a page that breaks long words with them still works when pasted: they hid the
    secret from the patterns (or left half of it shown)."""
    assert redact(text, cleared=True) == kept


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("Ba\u017f\u0131c dXNlcjpzM2NyZXQ=", "Ba\u017f\u0131c [redacted]"),
        (
            "the proxy wants BA\u017fIC YWxpY2U6aHVudGVyMg==",
            "the proxy wants BA\u017fIC [redacted]",
        ),
        ("\u0130nvoice: t\u0131cket 42", "\u0130nvoice: t\u0131cket 42"),
    ],
    ids=["basic", "basic-upper", "no-secret"],
)
def test_a_secret_named_with_letters_a_pattern_reads_as_ascii_is_removed(text, kept):
    """The patterns' words match whatever the case, and a case-insensitive match reads the
    long s as s and the dotless i as i: the word that names the credential was read that
    way, but the text was searched only when it held something else that may name one."""
    assert redact(text, cleared=True) == kept


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        # Cyrillic er and a in the name, Cyrillic dze and ka in a key's prefix, the word in
        # Greek capitals
        ("\u0440\u0430ssword=Tr0ub4dor3 ok", "\u0440\u0430ssword=[redacted] ok"),
        ("key: \u0455\u043a-proj4f9c2a7eABCDEFGH12 ok", "key: [redacted] ok"),
        (
            "\u03a4\u039f\u039a\u0395\u039d 9944b09199c62bcf9418ad846dd0e4bb",
            "\u03a4\u039f\u039a\u0395\u039d [redacted]",
        ),
        # in mathematical bold letters
        (
            "\U0001d429\U0001d41a\U0001d42c\U0001d42c"
            "\U0001d430\U0001d428\U0001d42b\U0001d41d=Tr0ub4dor3 ok",
            "\U0001d429\U0001d41a\U0001d42c\U0001d42c"
            "\U0001d430\U0001d428\U0001d42b\U0001d41d=[redacted] ok",
        ),
        # in the value, beside a zero-width space
        ("api_key=Zx9\u0430\u200bQw7Er5Ty3 \u043e\u043a", "api_key=[redacted] \u043e\u043a"),
        # Russian and Greek text without a secret is kept as it was written
        ("Отчёт готов: расход 12345678", "Отчёт готов: расход 12345678"),
        (
            "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1",
            "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1",
        ),
    ],
    ids=[
        "cyrillic-name",
        "cyrillic-prefix",
        "greek-word",
        "mathematical-letters",
        "in-the-value",
        "russian",
        "greek",
    ],
)
def test_a_secret_written_with_look_alike_letters_of_another_script_is_removed(text, kept):
    """A Cyrillic er or a Greek rho looks like a Latin p, and a name or a prefix written with one
    reads the same to whoever sees it, and to the model (as does a word in mathematical bold
    letters): the patterns, written in ASCII, did not find it."""
    assert redact(text, cleared=True) == kept


def test_a_private_key_is_removed_from_its_begin_line_to_its_end_line():
    key = (
        "-----BEGIN RSA PRIVATE KEY-----\n"
        "MIIEowIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM9Oi+b7cH8W0Y0cXz\n"
        "QZ1v+Yk3bM0c7XcdK9Ffq2x8P4Jw6Ls9Gm5Rt2Bn8Vy1Hk7Ud3W==\n"
        "-----END RSA PRIVATE KEY-----"
    )
    unterminated = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC"

    encrypted = (
        "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\n"
        "DEK-Info: AES-128-CBC,3F17F5316E2BAC89\n\nMIIEowIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM9Oi\n"
        "-----END RSA PRIVATE KEY-----"
    )
    in_json = (
        '{"key": "-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBgkqhkiG9w0B\\n'
        '-----END PRIVATE KEY-----"}'
    )

    assert redact(f"the key:\n{key}\nthanks", cleared=True) == "the key:\n[redacted]\nthanks"
    assert redact(f"pasted {unterminated}", cleared=True) == "pasted [redacted]"
    assert redact(f"{encrypted}\nafter", cleared=True) == "[redacted]\nafter"
    assert redact(in_json, cleared=True) == '{"key": "[redacted]"}'
    # a header named in prose takes nothing after it: no words, no "Note:" line
    assert redact("Never paste -----BEGIN PRIVATE KEY----- into chat. Thanks", cleared=True) == (
        "Never paste [redacted] into chat. Thanks"
    )
    assert redact("-----BEGIN PRIVATE KEY----- internationalization", cleared=True) == (
        "[redacted] internationalization"
    )
    assert redact("-----BEGIN PRIVATE KEY-----\nNote: see RFC 5208.", cleared=True) == (
        "[redacted]\nNote: see RFC 5208."
    )


def test_the_password_of_a_url_is_removed_and_the_rest_kept():
    text = "connect to postgres://app:s3cretpass@db.internal:5432/prod then"

    assert redact(text, cleared=True) == (
        "connect to postgres://app:[redacted]@db.internal:5432/prod then"
    )


def test_a_secret_or_an_email_used_as_a_key_is_redacted_like_a_value():
    record = {"sessions": {"sk-abcdefghijklmnopqrstu": "active"}, "li.wei@acme.example": "lead"}

    assert redact(record) == {
        "sessions": {REDACTED: "active"},
        "l***@acme.example": "lead",
    }
    assert redact(record, cleared=True) == {
        "sessions": {REDACTED: "active"},
        "li.wei@acme.example": "lead",
    }


@pytest.mark.parametrize(
    "name, secret",
    [
        ("access_token", True),
        ("api_key", True),
        ("Authorization", True),
        ("client_secret", True),
        ("password", True),
        ("input_tokens", False),
        ("idempotency_key", False),
        ("capability_hash", False),
    ],
)
def test_secret_fields_are_named_by_their_words(name, secret):
    assert secret_key(name) is secret
    assert (redact({name: "value"}, cleared=True)[name] == REDACTED) is secret


def test_a_secret_field_named_with_look_alike_letters_is_hidden_wherever_it_is_kept():
    """A service that answers {"password": ...} written with a Cyrillic er and a names its
    field to whoever reads it, and to the model, as the Latin name does: its value was kept
    in the call's envelope and sent to the model."""
    record = {
        "\u0440\u0430ssword": "hunter2",
        "user": {"\u0430pi_k\u0435y": "abc", "note": "ok"},
        "\u0440\u0430ss": "kept",
    }
    hidden = {
        "\u0440\u0430ssword": REDACTED,
        "user": {"\u0430pi_k\u0435y": REDACTED, "note": "ok"},
        "\u0440\u0430ss": "kept",
    }

    assert redact(record, cleared=True) == hidden
    assert strip_secrets(record) == hidden
    assert strip_secrets(record, secrets=("unrelated-secret",)) == hidden


@pytest.mark.parametrize(
    "text, masked",
    [
        ("write to Li <li.wei@acme.example>.", "write to Li <l***@acme.example>."),
        ("-li.wei@acme.example", "-l***@acme.example"),
        ("a.b@c.de and z@y.org", "a***@c.de and z***@y.org"),
        ("ask first#last@acme.example", "ask f***@acme.example"),
        ("o'brien@acme.example", "o***@acme.example"),
        (
            "https://crm.example/people?email=li.wei%40acme.example&x=1",
            "https://crm.example/people?email=l***%40acme.example&x=1",
        ),
    ],
)
def test_masking_keeps_the_first_letter_and_the_domain(text, masked):
    assert mask_email(text) == masked


def test_a_long_key_is_shown_without_being_kept():
    long_key = "password" + "x" * 1_000_000 + " Bearer abcdef0123456789abcdef"
    before = redaction.key_shown.cache_info().currsize

    shown, _ = redaction.key_shown(long_key, cleared=True)

    assert "abcdef0123456789abcdef" not in shown
    assert redaction.key_shown.cache_info().currsize == before


KNOWN_SECRET = "s3cr3t~~value??-0123456789"


@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("user", ["", "ann", "dave", "alice"], ids=lambda user: user or "bare")
def test_a_known_secret_echoed_base64_encoded_is_replaced_alone_or_after_a_user(
    encode, padded, user
):
    # given a service that echoes the credential it was given base64-encoded, alone or as
    # Basic authentication encodes it after a user name (each name puts it at another of the
    # three places a character of base64 can start inside it), standard or URL-safe, padded
    # or not
    credential = f"{user}:{KNOWN_SECRET}" if user else KNOWN_SECRET
    encoded = encode(credential.encode()).decode()
    encoded = encoded if padded else encoded.rstrip("=")

    # when it is redacted
    replaced = redaction.known_secrets_replaced(f"sent {encoded}; retry", (KNOWN_SECRET,))

    # then the credential is gone, and what encodes the user name alone is kept
    user_part = encode(f"{user}:".encode()).decode()[: (len(user) + 1) * 8 // 6] if user else ""
    assert replaced == f"sent {user_part}{REDACTED}; retry"


def test_a_known_secret_base64_encoded_inside_a_percent_encoded_link_is_replaced():
    encoded = base64.b64encode(f"dave:{KNOWN_SECRET}".encode()).decode()
    link = "https://status.example/?auth=" + urllib.parse.quote(encoded, safe="")

    replaced = redaction.known_secrets_replaced(link, (KNOWN_SECRET,))

    assert replaced == f"https://status.example/?auth=ZGF2ZT{REDACTED}"


@pytest.mark.parametrize(
    "text",
    [
        # another secret's base64, and base64 of part of the secret only
        base64.b64encode(b"another-credential-0123456789").decode(),
        base64.b64encode(KNOWN_SECRET[:12].encode()).decode(),
        # ordinary words and a base64 picture
        "the quick brown fox",
        "data:image/png;base64," + base64.b64encode(bytes(range(256)) * 4).decode(),
    ],
    ids=["other-secret", "part-of-the-secret", "words", "picture"],
)
def test_text_that_holds_no_base64_form_of_a_known_secret_is_kept(text):
    assert redaction.known_secrets_replaced(text, (KNOWN_SECRET,)) == text


def test_a_short_known_secret_is_not_sought_in_base64_which_would_find_it_by_chance():
    # given a secret whose base64 forms are a few characters, which other text holds by
    # chance: "hpI" of "eGhpIXg=" (base64 of "xhi!x") would be its form after one byte
    text = base64.b64encode(b"xhi!x").decode()

    assert redaction.known_secrets_replaced(text, ("hi!",)) == text

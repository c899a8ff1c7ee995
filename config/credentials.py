"""Credentials by reference: a model config, an MCP server or an HTTP tool names the environment
variable that holds its secret (`credential_ref`), and the host reads it when it calls out.

The environment is the platform's: it also holds the Django secret key, the database URL and
every tenant's secrets. An object owned by the platform (no tenant; only platform admins make
them) may name any variable, and so may a stdio MCP server's environment (only platform admins
register those). An object a tenant owns may name only the variables the operator granted to
that tenant in `TENANT_CREDENTIALS` (tenant slug: [variable names]): otherwise a tenant's
publisher could have the host send the platform's secrets, or another tenant's, to a URL of
their choosing. The grant is checked when the object is saved and again at every use.
"""

import os
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlsplit

from django.conf import settings

from config.secret_names import name_words, secret_key
from runs.redaction import as_read, names_secret, secrets_removed

if TYPE_CHECKING:
    from registry.models import Tenant


def credential_refusal(reference: str | None, *, owner: "Tenant | None") -> str | None:
    """Why an object that `owner` owns (None: the platform) may not name `reference` (no
    reason when it names none)."""
    if not reference or owner is None:
        return None
    if reference in settings.TENANT_CREDENTIALS.get(owner.slug, ()):
        return None
    return (
        f"The credential {reference} is not granted to tenant {owner.slug}: the operator "
        "grants it in TENANT_CREDENTIALS."
    )


def credential_value(reference: str, *, owner: "Tenant | None") -> str | None:
    """The secret `reference` names for an object that `owner` owns (None: the platform),
    or None when the variable is unset or not granted to the tenant."""
    if credential_refusal(reference, owner=owner) is not None:
        return None
    return os.environ.get(reference)


def url_secret_refusal(url: str | None) -> str | None:
    """Why an endpoint's URL may not be stored (no reason for one that may): a password in it
    (`https://user:sk-…@host`), or a query parameter named as a secret (`?api_key=…`, in
    letters of another script that look like Latin ones too: `names_secret`), is the secret
    itself, shown to whoever reads the row, its history and its list page."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if "@" in parts.netloc:
        return (
            "A URL names no user or password; name the environment variable that holds the "
            "secret in credential_ref instead."
        )
    named = sorted(
        {name for name, _ in parse_qsl(parts.query, keep_blank_values=True) if names_secret(name)}
    )
    if named:
        return (
            f"The query parameter {', '.join(named)} looks like a credential; name the "
            "environment variable that holds the secret in credential_ref instead."
        )
    return None


# The last word of an option that names where a secret is, not the secret: --token-file,
# --password-env.
_SECRET_ELSEWHERE = frozenset({"env", "file", "path", "var"})


def args_secret_refusal(args: list[str]) -> str | None:
    """Why a stdio server's arguments may not be stored (no reason for ones that may): an
    argument that looks like a key or token (`sk-live-…`, `--api-key=sk-…`), or a value given
    to an option named as a secret (`--password=…`, `--token ghp_…`), is the secret itself,
    shown to whoever reads the row and its history. The error names the argument, never its
    value."""
    named = []
    following = False  # whether the argument was read as the value of the option before it
    for index, arg in enumerate(args):
        if following:
            following = False
            continue
        name, equals, value = arg.partition("=")
        if not equals:
            valued = index + 1 < len(args) and not args[index + 1].startswith("-")
            name, value = (arg, args[index + 1]) if arg.startswith("-") and valued else ("", "")
        read = as_read(name)
        option_holds_secret = (
            bool(value) and secret_key(read) and name_words(read)[-1] not in _SECRET_ELSEWHERE
        )
        if option_holds_secret or any(secrets_removed(text) != text for text in (arg, value)):
            named.append(name or f"#{index + 1}")
            following = bool(value) and not equals
    if not named:
        return None
    return (
        f"The argument {', '.join(named)} looks like a credential; give the process the secret "
        "in env instead, as VARIABLE: SECRET_REFERENCE, the host's environment variable that "
        "holds it."
    )

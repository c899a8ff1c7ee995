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

from django.conf import settings

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

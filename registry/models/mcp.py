"""MCP servers as tool sources, and what discovery last read from them.

A server's remote tools become draft `ToolVersion`s in the namespace of the server's name;
every distinct remote definition is kept (`McpToolDefinition`, by hash) with the risk its
annotations propose and the flags a reviewer must see; `McpRemoteTool` says which definition
the server serves now, or that it stopped serving the tool.
"""

import uuid

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from config.credentials import args_secret_refusal, credential_refusal, url_secret_refusal
from config.history import history_records
from registry.choices import CALLABLE_STATUSES, FROZEN_STATUSES, AdapterKind, Risk
from registry.models.configs import CREDENTIAL_REF_VALIDATOR
from registry.models.definitions import NAMESPACE_VALIDATOR
from registry.models.tenancy import Tenant
from registry.models.tools import ToolVersion


class McpServer(models.Model):
    """A registered MCP server. Secrets are references: names of environment variables of the
    host, read when a connection opens, never stored or shown."""

    class Transport(models.TextChoices):
        STDIO = "stdio", "stdio (a local process)"
        STREAMABLE_HTTP = "streamable_http", "Streamable HTTP"

    class Health(models.TextChoices):
        UNKNOWN = "unknown", "Unknown"
        HEALTHY = "healthy", "Healthy"
        UNHEALTHY = "unhealthy", "Unhealthy"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(
        Tenant,
        on_delete=models.PROTECT,
        related_name="+",
        null=True,
        blank=True,
        help_text="Owner tenant; empty for a platform-wide server granted to tenants.",
    )
    name = models.CharField(
        max_length=63,
        validators=[NAMESPACE_VALIDATOR],
        help_text="Also the namespace of the tools discovered on it.",
    )
    description = models.TextField(blank=True)
    transport = models.CharField(max_length=16, choices=Transport.choices)
    command = models.CharField(max_length=500, blank=True, help_text="stdio: the executable.")
    args = models.JSONField(default=list, blank=True, help_text="stdio: a list of arguments.")
    env = models.JSONField(
        default=dict,
        blank=True,
        help_text="stdio: {VARIABLE: SECRET_REFERENCE}; the process gets each variable set "
        "to the value of the host's environment variable of that reference.",
    )
    url = models.URLField(max_length=500, blank=True, help_text="streamable HTTP: the endpoint.")
    credential_ref = models.CharField(
        max_length=128,
        blank=True,
        validators=[CREDENTIAL_REF_VALIDATOR],
        help_text="streamable HTTP: sent as a bearer token.",
    )
    timeout_s = models.PositiveIntegerField(
        default=10,
        validators=[MinValueValidator(1), MaxValueValidator(120)],
        help_text="Connecting and listing; each tool call uses its tool version's timeout.",
    )
    granted_tenants = models.ManyToManyField(
        Tenant,
        blank=True,
        related_name="granted_mcp_servers",
        help_text="Tenants whose runs may use a platform-wide server's tools and resources.",
    )
    is_enabled = models.BooleanField(default=True)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.UNKNOWN)
    health_detail = models.CharField(max_length=300, blank=True)
    health_checked_at = models.DateTimeField(null=True, blank=True)
    last_discovered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+", null=True
    )

    history = history_records(m2m_fields=[granted_tenants])

    class Meta:
        ordering = ["name"]
        verbose_name = "MCP server"
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name"],
                condition=models.Q(tenant__isnull=False),
                name="mcpserver_unique_tenant_name",
            ),
            models.UniqueConstraint(
                fields=["name"],
                condition=models.Q(tenant__isnull=True),
                name="mcpserver_unique_platform_name",
            ),
        ]

    def __str__(self) -> str:
        owner = self.tenant.slug if self.tenant_id else "platform"
        return f"{owner}/{self.name}"

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.transport == self.Transport.STDIO:
            if not self.command:
                errors["command"] = "A stdio server needs the command that starts it."
            if not isinstance(self.args, list) or not all(isinstance(a, str) for a in self.args):
                errors["args"] = "A list of strings."
            elif refusal := args_secret_refusal(self.args):
                errors["args"] = refusal
            if not isinstance(self.env, dict) or not all(
                isinstance(value, str) and CREDENTIAL_REF_VALIDATOR.regex.match(value)
                for value in self.env.values()
            ):
                errors["env"] = "An object of VARIABLE: SECRET_REFERENCE (upper-case names)."
        elif self.transport == self.Transport.STREAMABLE_HTTP and not self.url:
            errors["url"] = "A streamable HTTP server needs its endpoint URL."
        refusal = url_secret_refusal(self.url)
        if refusal:
            errors["url"] = refusal
        refusal = credential_refusal(self.credential_ref, owner=self.tenant)
        if refusal:
            errors["credential_ref"] = refusal
        stored = self._stored()
        for field in self._identity_changed_under_released_tools(stored):
            errors[field] = (
                "Tool versions released from this server call it by its owner and name "
                "(registry.selectors.mcp_server_of): they no longer change."
            )
        for field, calling in self._endpoint_changed_under_callable_tools(stored).items():
            errors[field] = (
                f"Published or deprecated tool versions call this server ({calling}): a new "
                "endpoint would answer their calls unreviewed. Register a new server at the "
                "new endpoint and publish its tools, or revoke these versions first."
            )
        if errors:
            raise ValidationError(errors)

    # Where the calls of the server's tools go: its endpoint, or the process that serves them.
    ENDPOINT_FIELDS = ("transport", "url", "command", "args")

    def _stored(self) -> dict | None:
        """The server's owner, name and endpoint as stored; none for a new server."""
        if self._state.adding:
            return None
        return (
            McpServer.objects.filter(pk=self.pk)
            .values("tenant_id", "name", *self.ENDPOINT_FIELDS)
            .first()
        )

    @staticmethod
    def versions_calling(
        *, tenant_id: int | None, name: str, statuses: frozenset[str] = CALLABLE_STATUSES
    ) -> models.QuerySet:
        """The tool versions in `statuses` that call the server of this owner and name, by
        name and version (`registry.selectors.mcp_server_of`)."""
        return (
            ToolVersion.objects.filter(
                adapter_kind=AdapterKind.MCP,
                tool__tenant_id=tenant_id,
                adapter_config__server=name,
                status__in=statuses,
            )
            .select_related("tool")
            .order_by("tool__name", "version")
        )

    def _identity_changed_under_released_tools(self, stored: dict | None) -> list[str]:
        """The fields of the server's owner and name changed since it was stored, when a
        published, deprecated or revoked tool version calls it by them: renamed or moved, the
        server would leave them calling nothing, or whatever server took the name next."""
        if stored is None:
            return []
        changed = [
            field
            for field, attname in (("tenant", "tenant_id"), ("name", "name"))
            if stored[attname] != getattr(self, attname)
        ]
        released = self.versions_calling(
            tenant_id=stored["tenant_id"], name=stored["name"], statuses=FROZEN_STATUSES
        )
        return changed if changed and released.exists() else []

    def _endpoint_changed_under_callable_tools(self, stored: dict | None) -> dict[str, str]:
        """The endpoint fields changed since the server was stored, each with the published or
        deprecated versions that call it: a new endpoint would answer their calls with no new
        version reviewed (drift compares definitions, not endpoints). Revoked ones call no more."""
        if stored is None:
            return {}
        changed = [field for field in self.ENDPOINT_FIELDS if stored[field] != getattr(self, field)]
        if not changed:
            return {}
        calling = ", ".join(
            str(version)
            for version in self.versions_calling(tenant_id=stored["tenant_id"], name=stored["name"])
        )
        return dict.fromkeys(changed, calling) if calling else {}


class McpToolDefinition(models.Model):
    """One remote tool definition as a server served it, kept by the hash of what it served,
    with the credentials it held replaced (what reviewers are shown)."""

    server = models.ForeignKey(McpServer, on_delete=models.CASCADE, related_name="definitions")
    remote_name = models.CharField(max_length=200)
    definition_hash = models.CharField(max_length=64)
    definition = models.JSONField()
    proposed_risk = models.CharField(max_length=32, choices=Risk.choices)
    review_flags = models.JSONField(default=list, blank=True)
    first_seen_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["server", "remote_name", "-first_seen_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["server", "definition_hash"], name="mcptooldefinition_unique_hash"
            )
        ]

    def __str__(self) -> str:
        return f"{self.server.name}/{self.remote_name} {self.definition_hash[:12]}"


class McpRemoteTool(models.Model):
    """Which definition a server serves under a name now; `removed_at` once it stopped, and
    `last_seen_at` when it last listed the name (served, or listed ambiguously)."""

    server = models.ForeignKey(McpServer, on_delete=models.CASCADE, related_name="remote_tools")
    remote_name = models.CharField(max_length=200)
    # Kept while a remote tool serves it; both go when their server is deleted.
    current = models.ForeignKey(McpToolDefinition, on_delete=models.RESTRICT, related_name="+")
    last_seen_at = models.DateTimeField()
    removed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["server", "remote_name"]
        constraints = [
            models.UniqueConstraint(
                fields=["server", "remote_name"], name="mcpremotetool_unique_name"
            )
        ]

    def __str__(self) -> str:
        return f"{self.server.name}/{self.remote_name}"

    @property
    def is_listed_ambiguously(self) -> bool:
        """Whether the server still lists the name it stopped serving: more than once, with
        different definitions (it was seen when, or after, it stopped)."""
        return self.removed_at is not None and self.last_seen_at >= self.removed_at


class McpPrompt(models.Model):
    """A prompt a server lists: a template a human may read, never a skill."""

    server = models.ForeignKey(McpServer, on_delete=models.CASCADE, related_name="prompts")
    name = models.CharField(max_length=200)
    title = models.CharField(max_length=200, blank=True)
    description = models.TextField(blank=True)
    arguments = models.JSONField(default=list, blank=True)
    review_flags = models.JSONField(default=list, blank=True)
    last_seen_at = models.DateTimeField()

    class Meta:
        ordering = ["server", "name"]
        constraints = [
            models.UniqueConstraint(fields=["server", "name"], name="mcpprompt_unique_name")
        ]

    def __str__(self) -> str:
        return f"{self.server.name}/{self.name}"


class McpResource(models.Model):
    """A resource a server lists; a run may read it as untrusted evidence, by its URI."""

    server = models.ForeignKey(McpServer, on_delete=models.CASCADE, related_name="resources")
    uri = models.CharField(max_length=500)
    name = models.CharField(max_length=200, blank=True)
    title = models.CharField(max_length=200, blank=True)
    description = models.TextField(blank=True)
    mime_type = models.CharField(max_length=100, blank=True)
    last_seen_at = models.DateTimeField()

    class Meta:
        ordering = ["server", "uri"]
        constraints = [
            models.UniqueConstraint(fields=["server", "uri"], name="mcpresource_unique_uri")
        ]

    def __str__(self) -> str:
        return self.uri

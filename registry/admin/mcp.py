"""MCP servers: registration, discovery, and what a reviewer must see before publishing.

Everything a server sent (descriptions, schemas, prompt texts) is shown escaped, with hidden
characters spelled out, next to the flags discovery raised.
"""

import json
from typing import Any

from django.contrib import admin, messages
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join

from config.errors import ApplicationError
from registry.admin.base import RegistryAdmin, error_text
from registry.mcp.review import visible
from registry.models import McpPrompt, McpRemoteTool, McpResource, McpServer
from registry.selectors import mcp_server_callers
from registry.services.mcp import (
    mcp_drift_of_servers,
    mcp_server_delete,
    mcp_server_discover,
    mcp_server_save,
)


def flags_html(flags: list[dict[str, str]]) -> str:
    if not flags:
        return "—"
    return format_html(
        "<ul>{}</ul>",
        format_html_join(
            "",
            "<li><strong>{}</strong> in {}: <code>{}</code></li>",
            ((flag["code"], flag["field"], flag["excerpt"]) for flag in flags),
        ),
    )


def remote_text_html(text: str) -> str:
    """Untrusted text from a server, escaped, hidden characters made visible."""
    return format_html('<pre style="white-space: pre-wrap">{}</pre>', visible(text or ""))


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class McpRemoteToolInline(ReadOnlyInline):
    model = McpRemoteTool
    fields = ("remote_name", "proposed_risk", "description", "flags", "last_seen_at", "removed_at")
    readonly_fields = fields

    @admin.display(description="proposed risk")
    def proposed_risk(self, obj: McpRemoteTool) -> str:
        return obj.current.proposed_risk

    @admin.display(description="description (as served)")
    def description(self, obj: McpRemoteTool) -> str:
        return remote_text_html(obj.current.definition.get("description", ""))

    @admin.display(description="review flags")
    def flags(self, obj: McpRemoteTool) -> str:
        return flags_html(obj.current.review_flags)


class McpPromptInline(ReadOnlyInline):
    model = McpPrompt
    fields = ("name", "title", "text", "arguments", "flags", "last_seen_at")
    readonly_fields = fields

    @admin.display(description="description (as served)")
    def text(self, obj: McpPrompt) -> str:
        return remote_text_html(obj.description)

    @admin.display(description="review flags")
    def flags(self, obj: McpPrompt) -> str:
        return flags_html(obj.review_flags)


class McpResourceInline(ReadOnlyInline):
    model = McpResource
    fields = ("uri", "name", "title", "mime_type", "last_seen_at")
    readonly_fields = fields


@admin.register(McpServer)
class McpServerAdmin(RegistryAdmin):
    list_display = (
        "name",
        "tenant",
        "transport",
        "is_enabled",
        "health",
        "last_discovered_at",
        "drifted_tools",
    )
    list_select_related = ("tenant",)
    list_filter = ("transport", "health", "is_enabled", "tenant")
    search_fields = ("name", "description", "url", "command")
    filter_horizontal = ("granted_tenants",)
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}
    readonly_fields = (
        "health",
        "health_detail",
        "health_checked_at",
        "last_discovered_at",
        "created_at",
        "created_by",
    )
    inlines = (McpRemoteToolInline, McpPromptInline, McpResourceInline)
    actions = ("discover",)

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """The page's servers, each with its drift: found for the whole page at once."""
        changelist = super().get_changelist_instance(request)
        drifted = mcp_drift_of_servers(changelist.result_list)
        for server in changelist.result_list:
            server.drift = drifted[server.pk]
        return changelist

    @admin.display(description="changed since publish")
    def drifted_tools(self, obj: McpServer) -> str:
        return ", ".join(f"{name} ({reason})" for name, reason in sorted(obj.drift.items())) or "—"

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if not change:
            obj.created_by = request.user
        mcp_server_save(server=obj, actor=request.user, reason="saved in admin")

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple:
        """A server that published or deprecated tool versions call is not deleted: the page
        (templates/admin/registry/mcpserver/) lists them, to be revoked first."""
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        callers = [
            f"{version} ({version.get_status_display().lower()}) calls {server}"
            for server in objs
            for version in mcp_server_callers(server)
        ]
        return deleted, counts, perms_needed, [*protected, *callers]

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        mcp_server_delete(server=obj, actor=request.user, reason="deleted in admin")

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        for server in queryset:
            mcp_server_delete(server=server, actor=request.user, reason="deleted in admin")

    def has_discover_permission(self, request: HttpRequest) -> bool:
        return self._allowed(request)

    @admin.action(description="Discover tools, prompts and resources now", permissions=["discover"])
    def discover(self, request: HttpRequest, queryset: QuerySet) -> None:
        for server in queryset:
            try:
                report = mcp_server_discover(server=server, actor=request.user)
            except ApplicationError as error:
                self.message_user(request, error_text(error), level=messages.ERROR)
                continue
            self.message_user(request, report.summary(), level=messages.SUCCESS)

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs):
        form = super().get_form(request, obj, change=change, **kwargs)

        def clean(form_self: Any) -> dict[str, Any]:
            cleaned = super(form, form_self).clean()
            stdio = cleaned.get("transport") == McpServer.Transport.STDIO
            if stdio and not request.user.is_superuser:
                form_self.add_error(
                    "transport",
                    "Only platform admins may register stdio servers; they run a command "
                    "on the host.",
                )
            return cleaned

        return type(form.__name__, (form,), {"clean": clean})


def mcp_review_html(definition: dict[str, Any], flags: list[dict[str, str]], drift: str) -> str:
    """The remote definition a draft was made from, for the reviewer of a ToolVersion."""
    return format_html(
        "<p><strong>Drift:</strong> {}</p><p><strong>Review flags:</strong></p>{}"
        "<p><strong>Description as served:</strong></p>{}"
        "<p><strong>Input schema as served:</strong></p>{}",
        drift or "none: the server serves this definition",
        flags_html(flags),
        remote_text_html(definition.get("description", "")),
        remote_text_html(json.dumps(definition.get("inputSchema"), indent=2, ensure_ascii=False)),
    )

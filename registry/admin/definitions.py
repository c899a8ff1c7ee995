"""Tools, skills and their versions: lifecycle actions, frozen published rows, version diffs."""

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from django import forms
from django.contrib import admin, messages
from django.db import transaction
from django.db.models import JSONField, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from guardian.admin import AdminGroupObjectPermissionsForm

from config.errors import ApplicationError
from evaluations.gates import skill_version_changed
from registry.admin.base import RegistryAdmin, ScopedInline, error_text
from registry.admin.mcp import mcp_review_html
from registry.choices import AdapterKind
from registry.models import (
    McpToolDefinition,
    Skill,
    SkillToolDependency,
    SkillVersion,
    Tenant,
    Tool,
    ToolVersion,
)
from registry.models.versions import LIFECYCLE_FIELDS, DefinitionVersion
from registry.schemas import skill_version_errors, tool_version_errors
from registry.selectors import mcp_drift, user_may_publish, version_diff
from registry.services import skills, tools
from registry.services.common import registry_object_save
from registry.services.skills import SKILL_CONTENT_FIELDS, skill_pins_check
from registry.services.tenancy import definition_grant
from registry.services.tools import TOOL_CONTENT_FIELDS


class DefinitionGrantForm(AdminGroupObjectPermissionsForm):
    """A group's object permissions on a definition. The use of a platform-wide one by a
    tenant's grant group is the tenant's grant, made as every grant is (`definition_grant`):
    a skill granted is held to its release gate, which a written reason lets it through."""

    override_reason = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="Grant a skill over its release gate, for this reason.",
    )
    actor: ClassVar[Any] = None

    def save_obj_perms(self) -> None:
        """A tenant's use of a tenant's own definition is refused by the service too: only
        platform-wide ones are shared by grants, and one ticked would be listed as granted
        and give nothing."""
        tenant = Tenant.objects.filter(grant_group=self.group).first()
        granted = (
            f"use_{self.obj._meta.model_name}" in self.cleaned_data[self.get_obj_perms_field_name()]
        )
        if tenant is not None and (self.obj.tenant_id is None or granted):
            definition_grant(
                actor=self.actor,
                definition=self.obj,
                tenant=tenant,
                granted=granted,
                override_reason=self.cleaned_data["override_reason"],
            )
        super().save_obj_perms()


class DefinitionAdmin(RegistryAdmin):
    """Non-superusers must name one of their tenants: only platform admins own
    platform-wide definitions."""

    list_display = ("name", "namespace", "tenant", "current_version", "created_at")
    list_filter = ("tenant", "namespace")
    search_fields = ("name", "namespace")
    readonly_fields = ("current_version", "created_at", "created_by")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Sequence[str]:
        fields = super().get_readonly_fields(request, obj)
        if obj is not None and obj.versions.any_frozen():
            return (*fields, "tenant", "namespace", "name")
        return fields

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if not change:
            obj.created_by = request.user
        registry_object_save(instance=obj, actor=request.user, reason="saved in admin")

    def get_obj_perms_manage_group_form(self, request: HttpRequest) -> type[DefinitionGrantForm]:
        return type(DefinitionGrantForm.__name__, (DefinitionGrantForm,), {"actor": request.user})

    def obj_perms_manage_group_view(
        self, request: HttpRequest, object_pk: str, group_id: str
    ) -> HttpResponse:
        """A grant the service refuses is said on the page again, and nothing is saved."""
        try:
            with transaction.atomic():
                return super().obj_perms_manage_group_view(request, object_pk, group_id)
        except ApplicationError as error:
            self.message_user(request, error_text(error), level=messages.ERROR)
            return HttpResponseRedirect(request.path)


@admin.register(Tool)
class ToolAdmin(DefinitionAdmin):
    list_select_related = ("tenant", "current_version__tool")


@admin.register(Skill)
class SkillAdmin(DefinitionAdmin):
    list_select_related = ("tenant", "current_version__skill")


class ContentValidatingForm(forms.ModelForm):
    """Shows each contract violation next to its field instead of failing later, and refuses
    a definition the user may not publish versions of."""

    content_errors: ClassVar[Callable[[dict[str, Any]], dict[str, list[str]]]]
    user: ClassVar[Any] = None

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        for name, value in list(cleaned.items()):
            model_field = self._meta.model._meta.get_field(name)
            if value is None and isinstance(model_field, JSONField) and not model_field.null:
                cleaned[name] = model_field.get_default()
        parent_field = self._meta.model.parent_field
        parent = cleaned.get(parent_field)
        if parent is not None and not user_may_publish(user=self.user, definition=parent):
            self.add_error(parent_field, f"You may not manage versions of {parent}.")
        values = {**{f: getattr(self.instance, f, None) for f in self._meta.fields}, **cleaned}
        for field, field_errors in type(self).content_errors(values).items():
            if field in self.errors:
                continue
            target = field if field in self.fields else None
            for message in field_errors:
                self.add_error(target, message if target else f"{field}: {message}")
        return cleaned


class ToolVersionForm(ContentValidatingForm):
    content_errors = staticmethod(tool_version_errors)

    class Meta:
        model = ToolVersion
        fields = ("tool", "version", *TOOL_CONTENT_FIELDS)


class SkillVersionForm(ContentValidatingForm):
    content_errors = staticmethod(skill_version_errors)

    class Meta:
        model = SkillVersion
        fields = ("skill", "version", *SKILL_CONTENT_FIELDS)


class VersionAdmin(RegistryAdmin):
    """Drafts are edited here; published versions are read-only and move only by the
    lifecycle actions, which call the same services as the API."""

    list_display = ("__str__", "owner", "status", "is_current", "published_at", "published_by")
    list_filter = ("status",)
    date_hierarchy = "created_at"
    actions = ("publish", "deprecate", "revoke", "make_current", "compare")
    lifecycle_readonly = (*sorted(LIFECYCLE_FIELDS), "created_at", "created_by")
    content_fields: ClassVar[tuple[str, ...]]
    service_argument: ClassVar[str]
    services: ClassVar[dict[str, Callable[..., DefinitionVersion]]]

    @admin.display(description="owner")
    def owner(self, obj: DefinitionVersion) -> str:
        return obj.parent.tenant.slug if obj.parent.tenant_id else "platform"

    @admin.display(boolean=True, description="current")
    def is_current(self, obj: DefinitionVersion) -> bool:
        return obj.is_current

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        if obj is not None and obj.is_frozen:
            return (obj.parent_field, "version", *self.content_fields, *self.lifecycle_readonly)
        if obj is not None:
            return (obj.parent_field, *self.lifecycle_readonly)
        return self.lifecycle_readonly

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs):
        form = super().get_form(request, obj, change=change, **kwargs)
        return type(form.__name__, (form,), {"user": request.user})

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """A published version is frozen: its page is view-only, lifecycle actions move it."""
        return super().has_change_permission(request, obj) and (obj is None or not obj.is_frozen)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_delete_permission(request, obj) and (obj is None or not obj.is_frozen)

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        content = {field: form.cleaned_data[field] for field in self.content_fields}
        if change:
            self.services["update"](actor=request.user, **{self.service_argument: obj}, **content)
            return
        parent = getattr(obj, obj.parent_field)
        created = self.services["create"](
            actor=request.user,
            tenant=parent.tenant,
            name=parent.name,
            namespace=parent.namespace,
            version=form.cleaned_data["version"],
            **content,
        )
        # The inline pins and the admin's log entry refer to the row the service created.
        obj.pk = created.pk
        obj._state.adding = False

    def _each(self, request: HttpRequest, queryset: QuerySet, verb: str, **extra: Any) -> None:
        for version in queryset:
            self.run_service(
                request,
                lambda version=version: self.services[verb](
                    actor=request.user, **{self.service_argument: version}, **extra
                ),
                f"{version.qualified_name}: {verb} done.",
            )

    def has_lifecycle_permission(self, request: HttpRequest) -> bool:
        return self._allowed(request)

    @admin.action(description="Publish selected drafts", permissions=["lifecycle"])
    def publish(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._each(request, queryset, "publish")

    @admin.action(description="Deprecate selected versions", permissions=["lifecycle"])
    def deprecate(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._each(request, queryset, "deprecate", reason="deprecated in admin")

    @admin.action(description="Revoke selected versions", permissions=["lifecycle"])
    def revoke(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._each(request, queryset, "revoke", reason="revoked in admin")

    @admin.action(
        description="Make the selected version current (rollback)", permissions=["lifecycle"]
    )
    def make_current(self, request: HttpRequest, queryset: QuerySet) -> None:
        if queryset.count() != 1:
            self.message_user(request, "Select exactly one version.", level=messages.ERROR)
            return
        self._each(request, queryset, "rollback")

    @admin.action(description="Compare two selected versions")
    def compare(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        versions = sorted(queryset, key=lambda version: version.semver)
        if len(versions) != 2 or versions[0].parent.pk != versions[1].parent.pk:
            self.message_user(
                request, "Select exactly two versions of the same definition.", messages.ERROR
            )
            return None
        opts = self.model._meta
        return HttpResponseRedirect(
            reverse(
                f"admin:{opts.app_label}_{opts.model_name}_compare",
                args=[versions[0].pk, versions[1].pk],
            )
        )

    def get_urls(self) -> list:
        opts = self.model._meta
        return [
            path(
                "<uuid:old_id>/compare/<uuid:new_id>/",
                self.admin_site.admin_view(self.compare_view),
                name=f"{opts.app_label}_{opts.model_name}_compare",
            ),
            *super().get_urls(),
        ]

    def compare_view(self, request: HttpRequest, old_id: Any, new_id: Any) -> HttpResponse:
        queryset = self.get_queryset(request)
        old = get_object_or_404(queryset, pk=old_id)
        new = get_object_or_404(queryset, pk=new_id)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "title": f"{old} → {new}",
            "old": old,
            "new": new,
            "diffs": version_diff(old, new),
        }
        return TemplateResponse(request, "admin/registry/version_diff.html", context)


@admin.register(ToolVersion)
class ToolVersionAdmin(VersionAdmin):
    form = ToolVersionForm
    tenant_lookup = "tool__tenant"
    list_display = (
        *VersionAdmin.list_display[:3],
        "risk",
        "drift",
        *VersionAdmin.list_display[3:],
    )
    list_filter = (
        "status",
        "risk",
        "adapter_kind",
        "approval_rule",
        "data_classification",
        "tool__tenant",
    )
    search_fields = ("tool__name", "version", "description")
    list_select_related = ("tool", "tool__tenant", "published_by")
    content_fields = TOOL_CONTENT_FIELDS
    service_argument = "tool_version"
    services = {
        "create": tools.tool_version_create,
        "update": tools.tool_version_update,
        "publish": tools.tool_version_publish,
        "deprecate": tools.tool_version_deprecate,
        "revoke": tools.tool_version_revoke,
        "rollback": tools.tool_rollback,
    }

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """The page's versions, each with its drift: found for the whole page at once."""
        changelist = super().get_changelist_instance(request)
        drift = mcp_drift(changelist.result_list)
        for version in changelist.result_list:
            version.mcp_drift = drift.get(str(version.pk), "")
        return changelist

    @admin.display(description="MCP drift")
    def drift(self, obj: ToolVersion) -> str:
        known = getattr(obj, "mcp_drift", None)
        return known if known is not None else mcp_drift([obj]).get(str(obj.pk), "")

    @admin.display(description="MCP review")
    def mcp_review(self, obj: ToolVersion) -> str:
        definition = McpToolDefinition.objects.filter(
            server__tenant_id=obj.tool.tenant_id,
            server__name=obj.adapter_config.get("server"),
            definition_hash=obj.adapter_config.get("definition_hash"),
        ).first()
        if obj.adapter_kind != AdapterKind.MCP or definition is None:
            return "—"
        return mcp_review_html(definition.definition, definition.review_flags, self.drift(obj))

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        fields = super().get_readonly_fields(request, obj)
        return (*fields, "mcp_review") if obj is not None else fields


class SkillToolPinFormSet(forms.BaseInlineFormSet):
    """The pins as typed, held to what the services hold them to (`skill_pins_check`): the
    formset saves them itself, past `skill_version_create` and `skill_version_update`."""

    def clean(self) -> None:
        super().clean()
        pinned = [
            form.cleaned_data["tool_version"]
            for form in self.forms
            if form.cleaned_data.get("tool_version") and not self._should_delete_form(form)
        ]
        try:
            skill_pins_check(pinned)
        except ApplicationError as error:
            raise forms.ValidationError(error_text(error)) from error


class SkillToolDependencyInline(ScopedInline, admin.TabularInline):
    model = SkillToolDependency
    formset = SkillToolPinFormSet
    extra = 0
    autocomplete_fields = ("tool_version",)

    def _editable(self, obj: SkillVersion | None) -> bool:
        return obj is None or not obj.is_frozen

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._editable(obj)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._editable(obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._editable(obj)


@admin.register(SkillVersion)
class SkillVersionAdmin(VersionAdmin):
    form = SkillVersionForm
    tenant_lookup = "skill__tenant"
    inlines = (SkillToolDependencyInline,)
    list_filter = ("status", "skill__tenant")
    search_fields = ("skill__name", "version", "description")
    list_select_related = ("skill", "skill__tenant", "published_by")
    content_fields = SKILL_CONTENT_FIELDS
    service_argument = "skill_version"
    services = {
        "create": skills.skill_version_create,
        "update": skills.skill_version_update,
        "publish": skills.skill_version_publish,
        "deprecate": skills.skill_version_deprecate,
        "revoke": skills.skill_version_revoke,
        "rollback": skills.skill_rollback,
    }

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        """The pins the inline saves are the draft's content too, as an edit through
        `skill_version_update` is: an eval run of it under way is marked when they change."""
        super().save_related(request, form, formsets, change)
        if change:
            skill_version_changed(skill_version=form.instance)

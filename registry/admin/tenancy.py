from collections.abc import Sequence
from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.http import HttpRequest

from registry.admin.base import RegistryAdmin, TenantScopedAdmin
from registry.choices import Action
from registry.models import ApiToken, Membership, Tenant
from registry.services.common import (
    TENANT_PLATFORM_FIELDS,
    api_tokens_revoke,
    registry_object_save,
)
from registry.services.tenancy import membership_remove, tenant_create, tenants_delete


class UsernameField(forms.ModelChoiceField):
    """A user named by username, in a text box: nothing is listed to choose from."""

    widget = forms.TextInput

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(to_field_name="username", **kwargs)

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, int):
            value = self.queryset.filter(pk=value).values_list("username", flat=True).first()
        return super().prepare_value(value)


@admin.register(Tenant)
class TenantAdmin(RegistryAdmin):
    tenant_lookup = "pk"
    required_action = Action.TENANT_ADMIN
    list_display = ("slug", "name", "is_active", "created_at")
    list_filter = ("is_active",)
    search_fields = ("slug", "name")
    readonly_fields = ("grant_group", "created_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.is_active and request.user.is_superuser

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        """A tenant's own admins rename it; what the platform decides stays the platform's."""
        fields = tuple(super().get_readonly_fields(request, obj))
        return fields if request.user.is_superuser else (*fields, *TENANT_PLATFORM_FIELDS)

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if change:
            registry_object_save(instance=obj, actor=request.user, reason="saved in admin")
            return
        created = tenant_create(actor=request.user, slug=obj.slug, name=obj.name)
        obj.pk, obj.grant_group = created.pk, created.grant_group
        obj._state.adding = False

    def delete_model(self, request: HttpRequest, obj: Tenant) -> None:
        tenants_delete(actor=request.user, tenants=Tenant.objects.filter(pk=obj.pk))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        tenants_delete(actor=request.user, tenants=queryset)


@admin.register(Membership)
class MembershipAdmin(RegistryAdmin):
    """Platform admins search every user; a tenant's admins, who may not list other tenants'
    people, name the person by exact username. A tenant's admins remove its people too, one
    or a selection at once, under the rules of `membership_remove`."""

    required_action = Action.TENANT_ADMIN
    list_display = ("user", "tenant", "role", "created_at")
    list_filter = ("role", "tenant")
    search_fields = ("user__username", "user__email", "tenant__slug")
    list_select_related = ("user", "tenant")
    autocomplete_fields = ("user",)

    def get_autocomplete_fields(self, request: HttpRequest) -> Sequence[str]:
        return self.autocomplete_fields if request.user.is_superuser else ()

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any):
        if db_field.name == "user" and not request.user.is_superuser:
            return UsernameField(
                queryset=get_user_model()._default_manager.filter(is_active=True),
                label="Username",
                help_text="The exact username of the person.",
            )
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        registry_object_save(instance=obj, actor=request.user, reason="saved in admin")

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._allowed(request, obj)

    def delete_model(self, request: HttpRequest, obj: Membership) -> None:
        membership_remove(actor=request.user, membership=obj, reason="removed in admin")

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Membership]) -> None:
        """One removal after another, taking the tenants' locks in the order of their keys."""
        for membership in queryset.order_by("tenant_id", "pk"):
            membership_remove(actor=request.user, membership=membership, reason="removed in admin")


@admin.register(ApiToken)
class ApiTokenAdmin(TenantScopedAdmin):
    """Tokens are issued by the API only; here a tenant's admins list and revoke its tokens."""

    required_action = Action.TENANT_ADMIN

    list_display = ("prefix", "user", "tenant", "created_at", "expires_at", "revoked_at")
    list_filter = ("tenant",)
    search_fields = ("user__username", "prefix")
    list_select_related = ("user", "tenant")
    readonly_fields = ("prefix", "user", "tenant", "created_at", "expires_at", "revoked_at")
    actions = ("revoke",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._allowed(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_active and request.user.is_superuser

    @admin.action(description="Revoke selected tokens", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset: QuerySet) -> None:
        revoked = api_tokens_revoke(tokens=queryset)
        self.message_user(request, f"{revoked} token(s) revoked.")

"""What every registry admin shares: history, object permissions, tenant scope by role."""

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from guardian.admin import GuardedModelAdmin
from simple_history.admin import SimpleHistoryAdmin

from config.errors import ApplicationError
from registry.choices import Action
from registry.models import Tenant
from registry.selectors import tenants_where_user_can


def error_text(error: ApplicationError) -> str:
    details = "; ".join(
        f"{field}: {' '.join(map(str, value)) if isinstance(value, list) else value}"
        for field, value in error.details.items()
    )
    return f"{error.message} {details}".strip()


class RegistryAdmin(SimpleHistoryAdmin, GuardedModelAdmin):
    """Platform admins see everything; other staff see the rows of the tenants where their
    role allows `required_action`, and nothing platform-wide."""

    tenant_lookup = "tenant"
    required_action: str = Action.REGISTRY_PUBLISH

    def scoped_tenants(self, request: HttpRequest) -> QuerySet[Tenant]:
        return tenants_where_user_can(user=request.user, action=self.required_action)

    def _allowed(self, request: HttpRequest, obj: Any = None) -> bool:
        user = request.user
        if not (user.is_active and user.is_staff):
            return False
        if user.is_superuser:
            return True
        if obj is None:
            return self.scoped_tenants(request).exists()
        return self.get_queryset(request).filter(pk=obj.pk).exists()

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        queryset = super().get_queryset(request)
        if request.user.is_superuser:
            return queryset
        return queryset.filter(**{f"{self.tenant_lookup}__in": self.scoped_tenants(request)})

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any):
        if db_field.related_model is Tenant and not request.user.is_superuser:
            kwargs["queryset"] = self.scoped_tenants(request)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self._allowed(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._allowed(request, obj)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return self._allowed(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._allowed(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_active and request.user.is_superuser

    def run_service(self, request: HttpRequest, call: Any, success: str) -> bool:
        """Run one service call; a domain refusal becomes a readable admin message."""
        try:
            call()
        except ApplicationError as error:
            self.message_user(request, error_text(error), level=messages.ERROR)
            return False
        self.message_user(request, success, level=messages.SUCCESS)
        return True


admin.site.site_header = "Agent Governance Platform"
admin.site.site_title = "Agent Governance"
admin.site.index_title = "Control plane"
